"""The sharded learner (learner.sharding=fsdp): FSDP2 (`torch.distributed.fsdp.fully_shard`) over the ranks of
a LearnerGroup, on gloo (CPU) and nccl (CUDA) alike; with expert parallelism (learner.sharding=ep, fsdp+ep).

    model = shard_learner_module(module, device, sharding, param_dtype, reduce_dtype)  # the learner calls it
    blocks = shard_train_module(module, device, param_dtype="auto", reduce_dtype="float32")
    full = full_state_dict(policy)            # collective: rank 0 gets the whole state dict, the others {}
    load_full_state_dict(policy, full)        # collective: every rank passes the whole state dict
    local_bytes(module, optimizer)            # this rank's parameter / gradient / optimizer-state bytes

Each decoder layer of an HF model is one FSDP unit; each Odyssey decoder layer gives two, its mixer (KDA /
MLA) and its FFN / MoE (`decoder_blocks`), the same for a separate critic's layers. The TrainModule is the
root unit holding the rest (embeddings, final norm, LM head, value head, vision tower, the Odyssey layers'
norms and AttnRes queries; tied embeddings stay in one unit). Parameters are DTensors sharded on dim 0 over
the ranks: the forward all-gathers one unit at a time, the backward reduce-scatters its gradient (averaged
over ranks, in `reduce_dtype`), and AdamW keeps its moments as sharded DTensors too, so at rest a rank holds
1/N of the parameters, gradients and optimizer state. Buffers (the MoE balancer's router biases) are not
sharded: every rank keeps them whole and updates them from all-reduced statistics, as under DDP.

Collectives: every rank must run the same sequence of unit forwards and backwards. The learner therefore pads
each rank's micro-batches to the most any rank has in that minibatch (zero-weighted one-token passes,
`Learner._idle_backward`), and gradients are reduce-scattered after every micro-batch (so they are
accumulated sharded). Parameters that took no part in a backward on some rank (an unused vision tower) are
reduce-scattered as zeros on every rank, so the collectives match. Sequence chunking runs every unit once per
window: each forward all-reduces the most windows any rank's micro-batch has, and the ranks with fewer run
zero-weighted idle windows (`TrainModule.sync_windows`, model/sequence_chunks.py `idle_window`).

Context parallelism (learner.context_parallel = R > 1; model/context_parallel.py): FSDP2 shards over all W
ranks (one 1-D mesh), and the CP groups of R consecutive ranks (r // R) live inside it as the W/R data-
parallel units. Why all W rather than a 2-D (data-parallel x CP) mesh that shards within a CP group and
replicates across groups (HSDP): memory, the reason for both. Every rank of a CP group runs every layer on
its shard, so each needs every unit's parameters gathered, whoever holds them; sharding over all W cuts the
resting parameter / gradient / AdamW bytes by W instead of R (the k3 plan, rl/plan/, cannot hold 1/8 of the
model per rank), and one reduce-scatter over W does what HSDP needs two collectives for. Gradient scaling is
the DDP path's, unchanged: each rank backpropagates W x the loss (`Learner.backward_micro_batch`), the loss
is computed whole on every rank of a CP group but each rank's backward reaches only its own shard's tokens,
so its gradient is its shard's share (the shares of a group sum to the group's gradient, the DDP x CP
convention); the reduce-scatter averages over W (FSDP2's default divide factor), which sums the shares and
the data-parallel groups exactly as DDP's all-reduce does. The CP all-gathers run on the CP group's own
process group, inside the mixer units (model/context_parallel.py says how their order is kept the same as
FSDP's and the experts' on every rank). Micro-batch counts are padded over all W ranks as above (an idle
group's ranks each run the one-token pass whole, with 1/R of its zero gradient). Refused with CP as without
sharding: sequence chunking, activation checkpointing inside a shard, a separate critic.

Expert parallelism (model/expert_parallel.py): with learner.sharding=ep or fsdp+ep the routed experts of every
LatentMoE are split over all N ranks (rank r holds experts [r*E/N, (r+1)*E/N) as DTensor shards on the same
1-D mesh FSDP uses), and each MoE layer sends its tokens' latent rows to the experts' ranks by all_to_all on a
process group of its own (so the exchanges never queue behind DDP's or FSDP's gradient collectives). The dense
part stays replicated under DDP (ep; the expert weights are excluded from DDP's all-reduce) or FSDP2-sharded
(fsdp+ep; the expert weights are `ignored_params` of fully_shard: already sharded on the expert dim, their
gradients already complete on the owning rank). The experts' gradients are divided by N inside the dispatch,
matching the averaging DDP and FSDP apply to the rest. Every MoE forward is a collective, so ep and fsdp+ep
share fsdp's rules: equal micro-batch counts on every rank (zero-weighted padding passes), collective state
gathering (DTensors: `full_state_dict` gathers the experts too), idle windows under sequence chunking. With
context parallelism the experts stay split over all W ranks (W divides n_routed_experts): each rank sends its
shard's tokens, so the all_to_all crosses the CP groups while the CP gathers stay inside them, and dividing
the experts' gradients by W matches the scaling above.

Mixed precision (`MixedPrecisionPolicy`): param_dtype is the dtype units compute in after the all-gather
("auto": bfloat16 on CUDA, float32 on CPU), reduce_dtype the dtype of the gradient reduce-scatter; the sharded
master weights and AdamW state stay fp32. All fp32 (the CPU default) applies no policy at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from model.expert_parallel import expert_parameters, shard_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """learner.fsdp_param_dtype / fsdp_reduce_dtype -> a torch dtype ("auto": bfloat16 on CUDA, else fp32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown FSDP dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def decoder_blocks(module: nn.Module) -> list[nn.Module]:
    """The FSDP units of every model inside `module`: the children of each nn.ModuleList named `layers` (HF's
    `model.layers`, a list named `h`), outermost lists only (a layer's own lists, e.g. shared experts, stay in
    its unit). An Odyssey decoder layer contributes its mixer and its FFN / MoE instead (see `_units`)."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or name.rsplit(".", 1)[-1] not in ("layers", "h"):
            continue
        if any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        blocks += [u for b in sub for u in _units(b) if any(True for _ in u.parameters())]
    return blocks


def _units(layer: nn.Module) -> list[nn.Module]:
    """An Odyssey decoder layer is called with the AttnRes stream, a dataclass it advances in place; FSDP2
    rebuilds dataclass arguments that hold tensors needing gradients (to hook their backward), so the layer
    would advance a copy. Its mixer and FFN take and return tensors: they are the units, and the layer's
    own few vectors (its RMSNorm scales and AttnRes pseudo-queries) stay with the root. Any other layer is
    one unit."""
    from model.modeling import OdysseyDecoderLayer

    if isinstance(layer, OdysseyDecoderLayer):
        return [layer.mixer, layer.mlp]
    return [layer]


SHARDINGS = ("none", "fsdp", "ep", "fsdp+ep")


def shard_learner_module(module: nn.Module, device: torch.device, sharding: str, param_dtype: str = "auto",
                         reduce_dtype: str = "float32") -> nn.Module:
    """Shard the TrainModule `module` in place over every rank of the default process group as
    learner.sharding says, and return what the learner calls forward on: the module itself (fsdp, fsdp+ep) or
    its DistributedDataParallel wrapper (none, ep). Collective; every rank passes identical weights."""
    if sharding not in SHARDINGS:
        raise ValueError(f"learner.sharding={sharding!r} is not one of {', '.join(SHARDINGS)}")
    ignored: set[nn.Parameter] = set()
    mesh = None
    if sharding in ("ep", "fsdp+ep"):
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh(device.type, (world,))  # FSDP's mesh too: one mesh for every DTensor
        shard_experts(module, group=torch.distributed.new_group(list(range(world))), mesh=mesh)
        ignored = set(expert_parameters(module))
    if sharding in ("fsdp", "fsdp+ep"):
        shard_train_module(module, device, param_dtype, reduce_dtype, ignored_params=ignored, mesh=mesh)
        return module
    return data_parallel(module, ignored)


def data_parallel(module: nn.Module, ignored: set[nn.Parameter] = frozenset()) -> DistributedDataParallel:
    """DistributedDataParallel over the default process group, leaving `ignored` (expert-parallel experts,
    whose gradients are complete on their own rank) out of the gradient all-reduce."""
    import warnings

    ids = {id(p) for p in ignored}
    names = [n for n, p in module.named_parameters() if id(p) in ids]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    with warnings.catch_warnings():  # torch deprecates broadcast_buffers; its replacement is not
        # equivalent yet (it syncs at init), so keep it and keep every run's log free of the warning
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        # the patch embedding takes part only in micro-batches with images: on a text-only batch (or rank) it
        # gets no gradient, which the reducer must expect
        policy = getattr(module, "policy", module)
        vision = getattr(getattr(policy, "model", None), "vision", None) is not None
        return DistributedDataParallel(module, broadcast_buffers=False, find_unused_parameters=vision)


def shard_train_module(module: nn.Module, device: torch.device, param_dtype: str = "auto",
                       reduce_dtype: str = "float32", ignored_params: set[nn.Parameter] | None = None,
                       mesh=None) -> list[nn.Module]:
    """Shard `module` (the TrainModule: policy + value model) in place with FSDP2 over the default process
    group: each decoder layer a unit, the module itself the root (module docstring). Returns the layer units.
    Must be called on every rank with identical weights (every rank builds the policy from the same seed or
    checkpoint); each keeps its dim-0 shard. ignored_params: left alone by every unit (expert-parallel
    experts, already sharded); mesh: FSDP's 1-D device mesh (None: FSDP's default over all ranks)."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError("the module is already sharded with FSDP; build a fresh one")
    # fp32 everywhere: no policy at all (FSDP2 then leaves the forward inputs alone)
    pd, rd = resolve_dtype(param_dtype, device), resolve_dtype(reduce_dtype, device)
    if pd == torch.float32 and rd == torch.float32:
        pd = rd = None
    blocks = decoder_blocks(module)
    if not blocks:
        raise ValueError(f"found no decoder layers (an nn.ModuleList named 'layers') in "
                         f"{type(module).__name__} to shard; learner.sharding=fsdp needs one, or use "
                         "learner.sharding=none")
    mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    kw = {"mp_policy": mp, "mesh": mesh, "ignored_params": set(ignored_params or ()) or None}
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(module, **kw)
    for m in [*blocks, module]:  # collectives must match on every rank, whatever each one's batch used
        m.set_reduce_scatter_unused_params(True)
    return blocks


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a (sub)module of an FSDP-sharded model, on CPU at rank 0 and {} on the
    others. Collective: every rank must call it."""
    return get_model_state_dict(module, options=_FULL)


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (every rank passes the whole one) into a sharded (sub)module: each rank
    keeps its shard. Collective."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's unsharded state, keyed by parameter name, at rank 0 ({} elsewhere). Collective."""
    return get_optimizer_state_dict(module, optimizer, options=_FULL)


def load_full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                                   state: dict[str, Any]) -> None:
    """Load what `full_optimizer_state_dict` returned (every rank passes it); each rank keeps its shard.

    A parameter that never got a gradient has no AdamW state (under ep, DDP leaves an unused vision patch
    embedding without one, as torch.optim does unsharded). torch's loader would refuse such a checkpoint when
    strict, and when not strict it gives every parameter a fresh state; so the load is not strict, the fresh
    states of the parameters the checkpoint has none for are dropped again (the optimizer then is as it was
    saved), and every saved entry must have landed, else a ValueError names the mismatch."""
    set_optimizer_state_dict(module, optimizer, state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    saved = {name for name, st in state.get("state", {}).items() if st}
    names = {id(p): name for name, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if names.get(id(p)) not in saved:
                optimizer.state.pop(p, None)
    landed = {names.get(id(p)) for p, st in optimizer.state.items() if st}
    if landed != saved:
        raise ValueError(f"the checkpoint's optimizer state does not match this learner's parameters "
                         f"(not loaded: {sorted(saved - landed)[:5]}): it was written for another model or "
                         "layout; resume with the config it was written with")


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the trainable parameters, their gradients and the optimizer state (the local
    shards of DTensors; whole tensors otherwise)."""
    params = [p for p in module.parameters() if p.requires_grad]
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for v in state),
    }


__all__ = [
    "SHARDINGS",
    "data_parallel",
    "decoder_blocks",
    "full_optimizer_state_dict",
    "full_state_dict",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "local_bytes",
    "resolve_dtype",
    "shard_learner_module",
    "shard_train_module",
]
