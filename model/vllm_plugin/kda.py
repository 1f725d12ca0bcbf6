"""KDA as a vLLM hybrid-state layer: `model.kda.KDAttention` whose per-request state lives in vLLM's cache.

vLLM allocates, per KDA layer, one state slot per running request (the "mamba" state cache, `MambaBase`)
holding two tensors (`get_state_shape`):

    conv       [C, W-1]   model dtype   the last W-1 inputs of the q|k|v short conv (C = 3 H K)
    recurrent  [H, K, V]  fp32          S of the delta-rule recurrence (model/kda.py, eq. 1)

A forward over vLLM's packed batch (query_start_loc = cu_seqlens [N+1], one slot index per request):

    state = KDALayerState(recurrent[slots], conv[slots])     zeros for requests with no computed tokens
    y, new = KDAttention.forward(x, cu_seqlens, state)       chunkwise prefill / recurrent decode step
    recurrent[slots], conv[slots] = new                      written back in place

so the math (projections, short conv, gate, `chunk_kda`, `fused_recurrent_kda_step`, output gate and norm)
is `model.kda`'s, shared with the trainer and `TorchEngine`. vLLM orders a batch decodes first; the decode
requests (one token each) and the others run as two groups, so decodes always take the recurrent step.
vLLM's own KDA kernels are CUDA-only. The metadata comes from vLLM's LINEAR state backend
(query_start_loc, seq_lens, state_indices_tensor).
Profile / warm-up forwards carry no metadata: the layer then runs statelessly and touches no cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from model.kda import KDALayerState, KDAttention


def kda_layer_name(layer_idx: int) -> str:
    """vLLM's name of the KDA layer `layer_idx` (its key in the forward context and the state cache)."""
    return f"model.layers.{layer_idx}.mixer"


def kda_state_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """((3HK, W-1), (H, K, K)): conv and recurrent state of one request in one KDA layer."""
    H, K = config.kda_num_heads, config.kda_head_dim
    return (3 * H * K, config.kda_conv_size - 1), (H, K, K)


def kda_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(conv dtype, recurrent dtype): the conv state holds inputs (model dtype); S is always fp32."""
    return model_dtype, torch.float32


class VllmKDA(KDAttention, MambaBase):
    """`KDAttention` with its decode state in vLLM's state cache. forward(x [T, D], cu_seqlens [N+1]) ->
    (y [T, D], None); cu_seqlens must be vLLM's query_start_loc of the current batch (the model passes it)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        vllm_config = get_current_vllm_config()
        self.prefix = kda_layer_name(layer_idx)
        self.model_dtype = vllm_config.model_config.dtype
        self.state_shapes = kda_state_shapes(config)
        ctx = vllm_config.compilation_config.static_forward_context
        if self.prefix in ctx:
            raise ValueError(f"duplicate vLLM layer name {self.prefix}")
        ctx[self.prefix] = self
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    # ---- MambaBase ---------------------------------------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return self.state_shapes

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtypes(self.model_dtype)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: KDALayerState | None = None) -> tuple[torch.Tensor, None]:
        if state is not None:
            raise ValueError("VllmKDA keeps its state in vLLM's cache; do not pass a KDALayerState")
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:  # profile / dummy run: no requests, no cache
            y, _ = KDAttention.forward(self, x, cu_seqlens)
            return y, None
        # vLLM puts the decode requests (one new token each) first: they take the recurrent step, the
        # rest (prefills, continuations) the chunkwise form; a mixed batch through chunk_kda alone would
        # pad every decode row to a whole chunk
        parts = [self._run(x[t0:t1], group) for t0, t1, group in _step_plan(meta)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), None

    def _run(self, x: torch.Tensor, group: _Group) -> torch.Tensor:
        """One group of the batch (its tokens x): gather its requests' states, run the layer, write the
        states back."""
        conv_cache, rec_cache = self.kv_cache
        rec, conv = rec_cache.index_select(0, group.slots), conv_cache.index_select(0, group.slots)
        if group.fresh is not None:  # no computed tokens yet: start from zeros
            rec.index_fill_(0, group.fresh, 0.0)
            conv.index_fill_(0, group.fresh, 0.0)
        y, new = KDAttention.forward(self, x, group.cu, KDALayerState(rec, conv))
        rec_cache.index_copy_(0, group.slots, new.recurrent)
        conv_cache.index_copy_(0, group.slots, new.conv.to(conv_cache.dtype))
        return y


@dataclass
class _Group:
    """Requests a..b-1 of a step that run together: cu [n+1] int32 (local cu_seqlens), their state slots
    [n] int64, the rows with no computed tokens [f] int64 (None if there are none)."""

    cu: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor | None


_plans: dict[int, tuple] = {}  # id(metadata) -> (metadata, plan) of the current forward; see `new_step`


def new_step() -> None:
    """Forget the step plan (the model calls this at the start of every forward: vLLM may reuse and
    update its metadata objects from one step to the next)."""
    _plans.clear()


def _step_plan(meta) -> list[tuple[int, int, _Group]]:
    """(first token, end token, group) of the decode and the prefill group of a step, computed once per
    forward and metadata object (vLLM's hybrid cache groups: each is shared by a few KDA layers)."""
    hit = _plans.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    nd, n = meta.num_decodes, meta.num_prefills + meta.num_decodes
    qsl = meta.query_start_loc
    plan = []
    for a, b in ((0, nd), (nd, n)):
        if b == a:
            continue
        cu = (qsl[a: b + 1] - qsl[a]).to(torch.int32)
        q_lens = cu[1:] - cu[:-1]
        fresh = torch.nonzero((meta.seq_lens[a:b] - q_lens) == 0).flatten()
        group = _Group(cu, meta.state_indices_tensor[a:b].long(), fresh if fresh.numel() else None)
        plan.append((int(qsl[a]), int(qsl[b]), group))
    _plans[id(meta)] = (meta, plan)
    return plan
