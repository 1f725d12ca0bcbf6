"""The sharded learner (learner.sharding=fsdp): FSDP2 (`torch.distributed.fsdp.fully_shard`) over the ranks of
a LearnerGroup, on gloo (CPU) and nccl (CUDA) alike.

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
reduce-scattered as zeros on every rank, so the collectives match. Sequence chunking and context parallelism
run a data-dependent number of unit forwards per micro-batch and are refused with learner.sharding=fsdp.

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
from torch.distributed.tensor import DTensor

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


def shard_train_module(module: nn.Module, device: torch.device, param_dtype: str = "auto",
                       reduce_dtype: str = "float32") -> list[nn.Module]:
    """Shard `module` (the TrainModule: policy + value model) in place with FSDP2 over the default process
    group: each decoder layer a unit, the module itself the root (module docstring). Returns the layer units.
    Must be called on every rank with identical weights (every rank builds the policy from the same seed or
    checkpoint); each keeps its dim-0 shard."""
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
    for b in blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(module, mp_policy=mp)
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
    """Load what `full_optimizer_state_dict` returned (every rank passes it); each rank keeps its shard."""
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


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
    "decoder_blocks",
    "full_optimizer_state_dict",
    "full_state_dict",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "local_bytes",
    "resolve_dtype",
    "shard_train_module",
]
