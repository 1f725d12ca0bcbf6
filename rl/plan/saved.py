"""Measured activation memory: the bytes autograd saves for the backward in a real forward of the policy.

    m = measure_saved_bytes(config, tokens=256, dtype=torch.bfloat16)
    m.per_layer[l] = {"mixer": bytes, "ffn": bytes, "rest": bytes}; m.embed, m.final

A `torch.autograd.graph.saved_tensors_hooks` pack hook sees every tensor the forward keeps for the backward.
Each is counted once by its storage (views and tensors saved by several ops share one storage; a storage is
charged to the part of the model that saved it first), parameters are not activations and are skipped, and
a storage counts with its full size (`untyped_storage().nbytes()`), which is what the allocator holds.
Parts: the sublayers of decoder layer l (its mixer, its FFN / MoE, and the rest: its two AttnRes reads and
RMSNorms), the embedding, and the final AttnRes read + norm.

The routing is forced to a perfectly balanced replay (token t picks experts (t*k + j) mod n, j < k), so each
expert receives exactly T*k/n tokens when n divides T*k: the expert buffers then have their balanced size,
which the analytic model (rl/plan/activations.py) predicts with a capacity factor of 1.

`measure_context_parallel_saved_bytes` does the same for one rank of a context-parallel forward
(model/context_parallel.py, learner.context_parallel = R): the bytes autograd holds on that rank after
`context_parallel_forward` of its shard, the oracle of `rl.plan.activations.shard_bytes` (run it on R real
processes, e.g. gloo: tests/test_plan_context_parallel.py).

This runs the real model on CPU and allocates its weights: use it on tiny / small shapes (the oracle of
rl/plan/activations.py), never on k3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.config import OdysseyConfig


@dataclass
class SavedBytes:
    """Bytes autograd holds after one forward of `tokens` tokens: per decoder layer {"mixer", "ffn", "rest"},
    the embedding's and the final read's."""

    tokens: int
    per_layer: list[dict[str, int]] = field(default_factory=list)
    embed: int = 0
    final: int = 0

    @property
    def total(self) -> int:
        return self.embed + self.final + sum(sum(p.values()) for p in self.per_layer)


def balanced_replay(config: OdysseyConfig, tokens: int) -> torch.Tensor | None:
    """Replayed experts [T, n_moe, k] int64 with token t -> experts (t*k + j) mod n (None without MoE)."""
    n, k, n_moe = config.n_routed_experts, config.num_experts_per_tok, len(config.moe_layer_indices)
    if n == 0 or n_moe == 0:
        return None
    ids = (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % n  # [T, k]
    return ids[:, None, :].expand(tokens, n_moe, k).contiguous()


def measure_saved_bytes(config: OdysseyConfig, tokens: int, dtype: torch.dtype = torch.float32,
                        seed: int = 0) -> SavedBytes:
    """One packed sequence of `tokens` tokens through the trunk of a random `config` model on CPU in `dtype`,
    with gradients on; the saved-tensor bytes per part (module docstring)."""
    from model.modeling import OdysseyForCausalLM

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    torch.manual_seed(seed)
    model = OdysseyForCausalLM(config).to(dtype).train()
    trunk = model.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    held: list[torch.Tensor] = []  # keeps every saved tensor alive, so no freed address is reused and missed
    out = SavedBytes(tokens, [{"mixer": 0, "ffn": 0, "rest": 0} for _ in trunk.layers])
    where: list[tuple[str, int]] = [("embed", -1)]

    def charge(part: str, layer: int, nbytes: int) -> None:
        if layer >= 0:
            out.per_layer[layer][part] += nbytes
        else:
            setattr(out, part, getattr(out, part) + nbytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        held.append(t)
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            charge(*where[-1], st.nbytes())
        return t

    hooks = []

    def enter(part: str, layer: int):
        return lambda *_: where.append((part, layer))

    def leave(*_):
        where.pop()

    for l, layer in enumerate(trunk.layers):
        hooks.append(layer.register_forward_pre_hook(enter("rest", l)))
        hooks.append(layer.register_forward_hook(leave))
        for part, sub in (("mixer", layer.mixer), ("ffn", layer.mlp)):
            hooks.append(sub.register_forward_pre_hook(enter(part, l)))
            hooks.append(sub.register_forward_hook(leave))
    hooks.append(trunk.final_read.register_forward_pre_hook(enter("final", -1)))
    ids = torch.randint(0, config.vocab_size, (tokens,))
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trunk(input_ids=ids, cu_seqlens=cu, replay_experts=balanced_replay(config, tokens))
    finally:
        for h in hooks:
            h.remove()
    return out


def measure_context_parallel_saved_bytes(config: OdysseyConfig, seq_lens: list[int], group,
                                         dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                                         checkpoint_layers: bool = False) -> int:
    """Bytes autograd holds on this rank of `group` (R ranks, collective: every rank calls it with the same
    arguments) after `context_parallel_forward` of its shard of the packed sequences `seq_lens` through the
    trunk of a random `config` model in `dtype` (same seed on every rank, so the same weights), balanced
    routing replayed. Counted as `measure_saved_bytes` counts: each storage once, parameters skipped.
    checkpoint_layers: each layer under its activation checkpoint; the rank then holds, until the backward,
    what autograd saves outside the checkpoints plus the tensors each checkpoint keeps to recompute its
    layer (its inputs: the AttnRes sources and the exchange chain's end), counted the same way."""
    import model.context_parallel as cp_module
    from model.context_parallel import context_parallel_forward
    from model.modeling import OdysseyForCausalLM

    torch.manual_seed(seed)
    model = OdysseyForCausalLM(config).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    held: list[torch.Tensor] = []  # keeps every saved tensor alive (no freed address reused and missed)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        st = t.untyped_storage()
        held.append(t)
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    def keep_inputs(fn, *args, **kwargs):  # the checkpoint as the layer calls it, its inputs counted
        for a in args:
            if isinstance(a, torch.Tensor):
                pack(a)
        return checkpoint(fn, *args, **kwargs)

    checkpoint = cp_module.checkpoint
    tokens = sum(seq_lens)
    ids = torch.randint(0, config.vocab_size, (tokens,))
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    cp_module.checkpoint = keep_inputs
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            context_parallel_forward(model.model, ids, cu, balanced_replay(config, tokens), group,
                                     checkpoint_layers=checkpoint_layers)
    finally:
        cp_module.checkpoint = checkpoint
    return total


__all__ = ["SavedBytes", "balanced_replay", "measure_context_parallel_saved_bytes", "measure_saved_bytes"]
