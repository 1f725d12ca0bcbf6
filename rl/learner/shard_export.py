"""Weights for the rollout engines, streamed out of an FSDP2-sharded policy one bucket at a time.

    for bucket in iter_weight_buckets(policy, bucket_bytes=256 << 20):  # collective: every rank iterates
        if rank == 0:
            send(bucket)                           # {name: whole CPU tensor}, then drop it

`full_state_dict(policy)` (rl/learner/fsdp.py) gathers the whole model onto rank 0's CPU before anything is
sent: rank 0 then holds its shard plus the whole model, and the engines' update waits for the whole gather.
Here the state dict's entries, in `module.state_dict()` order, are cut into buckets of consecutive entries of
at most `bucket_bytes` (sizes in the dtype the engines get; an entry larger than a bucket is a bucket of its
own). Every rank computes the same plan from the global shapes, so for each bucket every rank all-gathers
just that bucket's DTensors, one parameter at a time (`DTensor.full_tensor()`); rank `dst` keeps the CPU
copies and yields them, the other ranks drop each gathered parameter at once and yield {}. So at any time a
rank holds at most one bucket plus one gathered parameter beyond its shards, whatever the model's size.

Names are the unsharded state-dict names (FSDP2 keeps the module's FQNs; the buffers, e.g. the MoE router
biases, are whole on every rank and copied as they are): the concatenation of the buckets equals
`full_state_dict(policy)`, key for key and bit for bit when no cast is asked (tests/test_shard_export.py).

Over Ray (rl/learner/group.py, rl/rollout/worker.py) every rank runs `yield_weight_buckets` as a streaming
generator: rank 0 yields each bucket as soon as it is complete, so it goes to the object store and rank 0
drops it; the driver owns those objects (a generator's returns belong to its caller, so they outlive a learner
rank's restart) and `collect_weight_buckets` makes the `WeightBuckets` manifest, every name in order and one
ObjectRef per bucket. A rollout worker fetches and loads the buckets one by one (`WeightBuckets.stream`), so
it too holds one bucket at a time; the engines check the manifest's names before they load anything. The
object store holds the whole model, as it does for an unsharded learner's state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rl.weight_buckets import DEFAULT_BUCKET_BYTES, WeightBuckets

# (name, tensor) -> the dtype the engines get it in (None: the tensor's own)
CastFn = Callable[[str, torch.Tensor], "torch.dtype | None"]


def _out_dtype(cast: CastFn | None, name: str, t: torch.Tensor) -> torch.dtype:
    dtype = cast(name, t) if cast is not None else None
    return t.dtype if dtype is None else dtype


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Cut `sizes` ([(name, bytes)] in order) into runs of consecutive names of at most `bucket_bytes` each; a
    name larger than a bucket gets a bucket of its own. Deterministic: every rank gets the same plan."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: a weight bucket needs a positive size (e.g. "
                         f"{DEFAULT_BUCKET_BYTES} = 256 MiB)")
    buckets: list[list[str]] = []
    used = 0
    for name, n in sizes:
        if buckets and buckets[-1] and used + n <= bucket_bytes:
            buckets[-1].append(name)
            used += n
        else:
            buckets.append([name])
            used = n
    return buckets


def gather_full(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor on CPU in `dtype`, never aliasing the module's own storage. A DTensor is all-gathered
    (collective over its mesh); the gathered tensor is not copied again when it is already a CPU tensor of
    `dtype` that owns all of a fresh storage (a one-rank mesh hands back the shard itself: that is copied)."""
    if isinstance(t, DTensor):
        full = t.full_tensor()
        shard = t.to_local().untyped_storage().data_ptr()
        fresh = full.untyped_storage().data_ptr() != shard
        owns = fresh and full.untyped_storage().nbytes() == full.numel() * full.element_size()
        return full.to("cpu", dtype=dtype, copy=not owns)
    return t.detach().to("cpu", dtype=dtype, copy=True)


def iter_weight_buckets(module: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        cast: CastFn | None = None, dst: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Yield `module`'s state dict as buckets {name: whole CPU tensor} of at most `bucket_bytes` (module
    docstring). Collective when the module holds DTensors: every rank of the process group must run the
    generator to the end (each yields once per bucket); rank `dst` gets the tensors, the others {}. Without
    a process group (an unsharded module) the one process is `dst`.

    cast(name, tensor) -> dtype or None: the dtype each entry is yielded in (sizes are counted in it)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    state = module.state_dict()  # the live (sharded) tensors under their unsharded names; nothing gathered
    sizes = []
    for name, t in state.items():
        sizes.append((name, t.numel() * _out_dtype(cast, name, t).itemsize))  # DTensor: the global numel
    for names in plan_buckets(sizes, bucket_bytes):
        bucket: dict[str, torch.Tensor] = {}
        for name in names:
            t = state[name]
            full = gather_full(t, _out_dtype(cast, name, t))
            if rank == dst:
                bucket[name] = full
            del full  # the other ranks drop each gathered tensor at once
        yield bucket
        del bucket


def yield_weight_buckets(buckets: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, Any]]:
    """A learner rank's side of a sync over Ray: run `iter_weight_buckets`' generator to the end (every rank
    must), passing on each non-empty bucket, then a summary {"names": [...], "nbytes": int} (empty on the
    ranks that got no tensors). Run as a Ray streaming generator, each bucket goes to the object store as it
    is yielded, owned by the caller, and the rank drops it before gathering the next."""
    names: list[str] = []
    nbytes = 0
    for bucket in buckets:
        if not bucket:
            continue
        names += list(bucket)
        nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
        yield bucket
        del bucket
    yield {"names": names, "nbytes": nbytes}


def collect_weight_buckets(streams: list[Any], bucket_bytes: int) -> WeightBuckets:
    """The caller's side: `streams` holds each rank's ObjectRefGenerator of `yield_weight_buckets`, the
    sending rank's first. Collects its bucket refs (without fetching them) and its summary, and runs the other
    ranks' to the end so that a failure on any rank raises here. Blocks until the gather is done."""
    import ray

    first, *others = streams
    refs = list(first)
    for gen in others:
        ray.get(list(gen))  # each holds only its (empty) summary
    summary = ray.get(refs[-1])
    return WeightBuckets(names=summary["names"], refs=refs[:-1], nbytes=summary["nbytes"],
                         bucket_bytes=bucket_bytes)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WeightBuckets",
    "collect_weight_buckets",
    "gather_full",
    "iter_weight_buckets",
    "plan_buckets",
    "yield_weight_buckets",
]
