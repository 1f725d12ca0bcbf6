"""Per-rank model state of the sharded learner, counted from the real model built on the meta device.

    s = rank_state(config, ranks=W, ep=M, param_bytes=2)
    s.params, s.grads, s.optimizer      # bytes one rank holds at rest (the largest rank, rank 0)
    s.gather                            # transient: all-gathered units + one unsharded gradient

What a rank holds (rl/learner/fsdp.py): every parameter is a DTensor sharded on dim 0 over the ranks the way
FSDP2 splits it, `torch.chunk` semantics (chunk c = ceil(d0 / N) rows; rank r keeps rows [r c, min((r+1) c,
d0)), possibly none). The master weights and AdamW state stay fp32 whatever the compute dtype:

    params    = 4 * local numel                     (fp32 master shard)
    grads     = 4 * local numel                     (fp32 sharded gradient, reduce dtype fp32)
    optimizer = 8 * local numel + 4 per parameter   (AdamW exp_avg + exp_avg_sq fp32, and its 0-d fp32 step)

Expert parallelism (ep = M > 1, learner.sharding=fsdp+ep): the routed experts of every MoE layer (the
stacked `w_gate_up` / `w_down_experts` [n, ...]) are split across the M ranks of an expert-parallel group
(n / M whole experts each, exchanged tokens by all-to-all), and each rank's [n / M, ...] block is FSDP-sharded
over the W / M groups; every other parameter is FSDP-sharded over all W ranks. At rest that is the same
1/W of the bytes as FSDP alone; what EP changes is the all-gather (only n / M experts, over W / M ranks)
and the all-to-all of tokens.

Transient (`gather`): FSDP2 all-gathers one unit (rl/learner/fsdp.py `decoder_blocks`: each layer's mixer and
FFN/MoE, and the root holding the rest) in the compute dtype, prefetching the next one (2 units live), and
holds one unit's unsharded gradient in the reduce dtype (fp32) before the reduce-scatter:

    gather = largest unit numel * (2 * param_bytes + 4)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from model.config import OdysseyConfig
from model.count import ROUTED_PARAM_NAMES

MASTER_BYTES = 4  # fp32 master weights
GRAD_BYTES = 4  # fp32 sharded gradients (learner.fsdp_reduce_dtype=float32)
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
STEP_BYTES = 4  # AdamW's 0-d fp32 `step` tensor, one per parameter


@dataclass
class RankState:
    """Bytes of one learner rank (module docstring). units: FSDP units; largest_unit: its numel (unsharded,
    experts as one EP rank gathers them)."""

    ranks: int
    ep: int
    params: int
    grads: int
    optimizer: int
    gather: int
    largest_unit: int
    units: int

    @property
    def at_rest(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "at_rest": self.at_rest}


def chunk_rows(rows: int, n: int, rank: int) -> int:
    """Rows of dim 0 that FSDP2 gives `rank` of n (`torch.chunk`: chunks of ceil(rows / n), the last ones
    shorter or empty)."""
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not one of {n} ranks")
    c = math.ceil(rows / n) if rows else 0
    return max(0, min(c, rows - rank * c))


def meta_policy(config: OdysseyConfig) -> torch.nn.Module:
    """OdysseyForCausalLM(config) on the meta device: shapes only, nothing allocated (any preset, k3 too)."""
    from model.modeling import OdysseyForCausalLM

    with torch.device("meta"):
        return OdysseyForCausalLM(config)


def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ROUTED_PARAM_NAMES


@dataclass
class Shapes:
    """What rank_state needs of a model: per trainable parameter (is a routed-expert tensor, dim-0 rows, numel
    per row), and per FSDP unit (the root last) its parameters' (is expert, numel). memo: results the plan's
    searches computed for this model (rl/plan/plan.py learner_rank), keyed by their arguments."""

    params: list[tuple[bool, int, int]]
    units: list[list[tuple[bool, int]]]
    memo: dict = field(default_factory=dict, repr=False, compare=False)


def model_shapes(model: torch.nn.Module) -> Shapes:
    """`Shapes` of a (meta) policy, its FSDP units as rl/learner/fsdp.py `decoder_blocks` forms them."""
    from rl.learner.fsdp import decoder_blocks

    params = [(_is_expert(n), p.shape[0] if p.dim() else 1, p[0].numel() if p.dim() else 1)
              for n, p in model.named_parameters() if p.requires_grad]
    blocks = decoder_blocks(model)
    ids = {id(p) for u in blocks for p in u.parameters()}
    units = [[(_is_expert(n), p.numel()) for n, p in u.named_parameters()] for u in blocks]
    units.append([(False, p.numel()) for p in model.parameters() if id(p) not in ids])
    return Shapes(params, units)


def rank_state(config: OdysseyConfig, ranks: int, ep: int = 1, rank: int = 0, param_bytes: int = 2,
               model: torch.nn.Module | None = None, shapes: Shapes | None = None) -> RankState:
    """Bytes `rank` of `ranks` holds (module docstring); param_bytes: the compute dtype's (2: bf16 on GPU,
    4: fp32, the CPU default), used by the transient all-gather only. model: a prebuilt meta policy;
    shapes: its `model_shapes` (reused across calls)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if ep < 1 or ranks % ep:
        raise ValueError(f"ep ({ep}) must divide the learner ranks ({ranks}): W / M groups of M ranks")
    n = config.n_routed_experts
    if ep > 1 and (n == 0 or n % ep):
        raise ValueError(f"ep={ep} must divide the {n} routed experts of the model (n_routed_experts)")
    if shapes is None:
        shapes = model_shapes(meta_policy(config) if model is None else model)
    dp = ranks // ep  # FSDP degree of the experts
    local = 0
    for expert, rows, rest in shapes.params:
        if ep > 1 and expert:
            local += chunk_rows(rows // ep, dp, rank // ep) * rest
        else:
            local += chunk_rows(rows, ranks, rank) * rest
    n_params = len(shapes.params)
    largest = max(sum(n // (ep if ep > 1 and e else 1) for e, n in u) for u in shapes.units)
    return RankState(
        ranks=ranks, ep=ep,
        params=MASTER_BYTES * local,
        grads=GRAD_BYTES * local,
        optimizer=ADAM_BYTES * local + STEP_BYTES * n_params,
        gather=largest * (2 * param_bytes + GRAD_BYTES),
        largest_unit=largest, units=len(shapes.units),
    )


__all__ = ["RankState", "Shapes", "chunk_rows", "meta_policy", "model_shapes", "rank_state"]
