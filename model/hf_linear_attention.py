r"""Hybrid Hugging Face models in the learner: transformers' KDA layers on Odyssey's kernels, packing-correct.

transformers' Kimi Delta Attention layers (`KimiLinearDeltaAttention` of `kimi_linear`,
`Glm5NextTextLinearAttention` of `glm5_next`) run their short convolution and recurrence over the whole
row: in the learner's packed row (HFPolicy.packed_hidden, sequences concatenated with position_ids
restarting at 0) the conv window and the state S run from one sequence into the next, so every sequence
after the first gets wrong log-probs and gradients, silently. `patch_linear_attention(hf)` (called by
HFPolicy at construction, before anything runs) fixes this per layer:

- the trunk (the module holding `layers`) reads the packing of each call: `cu_seq_lens_q` when given, else the
  starts of the packed sequences from `position_ids` [1, T] (a sequence starts where its position is 0), and
  passes it down as the keyword `odyssey_cu_seqlens` int32 [N+1]; transformers' decoder layers forward their
  keyword arguments to the token mixers, also in the recomputation of activation checkpointing;
- each KDA layer then runs, for all N sequences at once, with per-sequence state resets (DESIGN.md "Model",
  docs/kda.md):

      q, k, v = SiLU(ShortConv_W([W_q; W_k; W_v] x))  per sequence (model/short_conv.py, cu_seqlens)
      q <- L2Norm(q) K^-1/2,  k <- L2Norm(k),  beta = sigmoid(W_b x)
      g = -e^{A_h} softplus(W_fb W_fa x + dt_bias)      (kimi_linear: unbounded)
        = g_lb sigmoid(e^{A_h} (W_fb W_fa x + dt_bias))  (glm5_next: lower bound g_lb = -5)
      S_t = (I - beta_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t   (1)
      S_0 = 0 at every sequence start
      y = W_o [RMSNorm_head(o) * sigmoid(W_gb W_ga x)]

  on Odyssey's kernels: the fused CPU short conv and the C++ recurrence with its own backward
  (model/kda_recurrent.py) for fp32 on CPU (the recurrence always runs in fp32, as transformers' does),
  fla-core's Triton `chunk_kda` on CUDA (model/kda_fla.py; its exact path when a gate is below -5), the torch
  chunkwise form (model/kda_chunk.py) for a bounded gate elsewhere, the token-by-token reference otherwise;
- glm5_next's DSA attention layers (indexer top-k over pools of the row, then a sparse mask) are run once per
  sequence (transformers' own forward on each slice), so pools and top-k never cross a boundary; kimi_linear's
  MLA layers need nothing here (HFPolicy runs them on its per-sequence packed SDPA).

transformers' Gated DeltaNet layers (`qwen3_next`, `qwen3_5`, `qwen3_5_moe`) get the same treatment
(`_PackedGDN`, `stateful_gdn`): short conv over the concatenated [q; k; v] per sequence, then the gated delta
rule S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with one log-decay per head
(model/gated_delta.py: chunkwise for long pieces, token steps for decode; on CUDA with fla-core, fla's Triton
`chunk_gated_delta_rule` for the packed forward and prefills, model/gated_delta_fla.py), S_0 = 0 at every
sequence start;
their gated full-attention layers (output gate, partial rope) take HFPolicy's per-sequence packed SDPA
(`odyssey_packed_sdpa`), as do kimi_linear's MLA layers. In TorchEngine their rows carry the same
`KDAState` (conv tail [1, 2HkK + HvV, W-1], S [1, Hv, K, V] fp32).

Everything else (norms, MoE, hyper-connections, MLA) stays transformers' code. A call with a padding mask
takes transformers' own forward unchanged. A call with a cache (`past_key_values` / `cache_params`;
TorchEngine through HFPolicy.packed_logits: one forward per row, B = 1, for a prefill or observation;
B rows of one token each, their states stacked, for a decode step) runs `cached_kda`: each row carries,
per KDA layer, its short-conv tail [1, 3HK, W-1] and recurrent state S [1, H, K, V] fp32 (`KDAState`),
beside the attention layers' KV (kimi_linear's MLA latents; glm5_next's DSA K/V and indexer keys). A
prefill, or a continuation of a row (a multi-turn observation), runs the same kernels from the row's states
and returns the final ones; a decode step is the T = 1 case. A padded call takes transformers' own forward
(HFPolicy never pads these models).

Shapes: hidden states [B, T, D] (packed: B = 1), q, k, g [T, H, K], v [T, H, V], beta [T, H], conv input
[T, 3HK] with taps [3HK, W].
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import gated_delta_fla, kda, kda_chunk, kda_fla, kda_recurrent
from model.gated_delta import gated_delta, l2norm
from model.kda_reference import naive_recurrent_kda
from model.short_conv import causal_short_conv, causal_short_conv_silu, seq_lens_from_cu

CU_KWARG = "odyssey_cu_seqlens"
# model_type -> (module of transformers.models, KDA layer class, trunk class, DSA attention class or None)
KDA_MODELS: dict[str, tuple[str, str, str, str | None]] = {
    "kimi_linear": ("kimi_linear", "KimiLinearDeltaAttention", "KimiLinearModel", None),
    "glm5_next": ("glm5_next", "Glm5NextTextLinearAttention", "Glm5NextTextModel", "Glm5NextTextAttention"),
}
# model_type -> (module of transformers.models, Gated DeltaNet layer class, trunk class). A composite Qwen3.5
# checkpoint (model_type qwen3_5 / qwen3_5_moe) loads through AutoModelForCausalLM as its text model
# (qwen3_5_text / qwen3_5_moe_text): the same classes.
GDN_MODELS: dict[str, tuple[str, str, str]] = {
    "qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextModel"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text"), ("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5TextModel")),
    **dict.fromkeys(("qwen3_5_moe", "qwen3_5_moe_text"),
                    ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextModel")),
}
# transformers' reference functions of the KDA / Gated DeltaNet layers (torch; fla's replace them where fla is
# installed)
_TRANSFORMERS_KERNELS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                         "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                         "torch_recurrent_gated_delta_rule")


def _transformers_module(model_type: str) -> Any:
    import importlib

    name = (KDA_MODELS.get(model_type) or GDN_MODELS[model_type])[0]
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def model_type_of(config: Any) -> str:
    """The checkpoint's model_type (a composite config's own, e.g. 'glm5_next')."""
    return str(getattr(config, "model_type", ""))


# ------------------------------------------------------------------------------------------------ packing
def _cu_from_call(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """cu_seqlens int32 [N+1] of a packed full-sequence trunk call, or None (a cached call, B > 1, no
    position_ids: the layers treat each row as one sequence). From `cu_seq_lens_q` when given, else from
    position_ids [1, T]: a sequence starts at t = 0 and wherever position_ids[t] == 0."""
    if kwargs.get("past_key_values") is not None:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu.to(torch.int32)
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 2 or pos.shape[0] != 1:
        return None
    p = pos[0]
    T = p.shape[0]
    starts = (p == 0).nonzero().flatten().to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=p.device)
    end = torch.full((1,), T, dtype=torch.int32, device=p.device)
    return torch.unique(torch.cat([zero, starts, end]))  # sorted, no duplicates


class _PackedTrunk:
    """Mixin of the trunk (the module holding `layers`): every call passes its packing down as `CU_KWARG`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("odyssey_prefix_of") is not None:
            raise ValueError(
                "shared prefixes (learner.share_prefixes) are not supported for hybrid linear-attention "
                "models: a continuing sequence would need its prefix's recurrent and conv state. Set "
                "learner.share_prefixes=false")
        if CU_KWARG not in kwargs:
            cu = _cu_from_call(kwargs)
            if cu is not None:
                kwargs[CU_KWARG] = cu
        return super().forward(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ KDA layer
def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu: torch.Tensor, bounded: bool,
                initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence (1) over packed sequences, fp32: q, k, g [T, H, K], v [T, H, V], beta [T, H], cu int [N+1],
    initial_state [N, H, K, V] fp32 or None (zeros) -> (o [T, H, V] fp32, final state [N, H, K, V] fp32).
    q is used as given (already scaled by K^-1/2). bounded: every g >= -5 by construction (the torch
    chunkwise form's dense tiles then fit fp32)."""
    args = [t[None] for t in (q, k, v, g, beta)]
    S0 = None if initial_state is None else initial_state.float()
    if q.device.type == "cpu" and kda_recurrent.applies(*args, S0):
        o, S = kda_recurrent.recurrent_kda(*args, initial_state=S0, cu_seqlens=cu)
    elif q.is_cuda and kda_fla.available():  # fla; its exact (token-parallel) path for a gate below -5
        o, S = kda.chunk_kda(*args, initial_state=S0, cu_seqlens=cu, check_decay_bound=not bounded)
    elif bounded:
        o, S = kda_chunk.chunk_kda(*args, initial_state=S0, cu_seqlens=cu, check_decay_bound=False)
    else:  # unbounded gate, no C++ kernels: the exact token-by-token reference per sequence
        bounds = cu.tolist()
        outs = [naive_recurrent_kda(*(t[:, a:b] for t in args), None if S0 is None else S0[n:n + 1])
                for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([o[0] for o, _ in outs]), torch.cat([s for _, s in outs])
    return o[0].float(), S.float()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' / fla's KDA l2norm), x fp32 [..., K]."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class KDAState(NamedTuple):
    """One sequence's decode state of one KDA layer (a row of HFPolicy's HFPackedCache): `conv` [1, 3HK, W-1]
    the last W-1 inputs of the q/k/v short convolutions, oldest first (zeros before the sequence start; the
    conv weight's dtype), `recurrent` [1, H, K, V] fp32 the state S of recurrence (1) after the row's last
    token."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def stateful_kda(layer: nn.Module, x: torch.Tensor, cu: torch.Tensor, conv_state: torch.Tensor | None = None,
                 state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transformers KDA layer (its own parameters) over N packed sequences, each continuing from its
    given state: x [T, D] (sequence n at cu int32 [N+1]), conv_state [N, 3HK, W-1] (None: zeros, a fresh
    sequence), state [N, H, K, V] fp32 (None: zeros) -> (y [T, D] in x's dtype, the new conv state
    [N, 3HK, W-1], the new state S [N, H, K, V] fp32). Formulas in the module docstring; a decode step is
    T = N, one token per sequence. Running a sequence in pieces, each from the previous piece's states,
    equals running it whole (the short conv sees its last W-1 inputs, the recurrence its S)."""
    T = x.shape[0]
    H, K = layer.num_heads, layer.head_dim
    mixed = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)  # [T, 3HK]
    w = layer.conv1d.weight.squeeze(1)  # [3HK, W] (fp32 in glm5_next checkpoints: keep_in_fp32)
    mixed = mixed.to(w.dtype)
    if conv_state is not None:
        conv_state = conv_state.to(w.dtype)
    if layer.conv1d.bias is None and layer.activation in ("silu", "swish"):
        mixed, conv_new = causal_short_conv_silu(mixed, w, cu, conv_state)  # fused kernel on fp32 CPU
    else:
        from transformers.activations import ACT2FN

        y, conv_new = causal_short_conv(mixed, w, cu, conv_state)
        mixed = ACT2FN[layer.activation](y if layer.conv1d.bias is None else y + layer.conv1d.bias)
    q, k, v = mixed.to(x.dtype).float().view(T, 3, H, K).unbind(1)
    q = _l2norm(q) * K**-0.5
    k = _l2norm(k)
    g = layer.forget_gate(x[None])[0].float()  # [T, H, K] log-decay, the checkpoint's own gate
    beta = torch.sigmoid(layer.b_proj(x)).float()  # [T, H]
    lower = getattr(layer.forget_gate, "safe_gate_lower_bound", None)
    with torch.autocast(device_type=x.device.type, enabled=False):
        o, S = _recurrence(q, k, v, g, beta, cu, bounded=lower is not None and lower >= -5.0,
                           initial_state=state)
    gate = layer.g_b_proj(layer.g_a_proj(x)).view(T, H, K)
    return layer.o_proj(layer.o_norm(o.to(x.dtype), gate).reshape(T, H * K)), conv_new, S


def packed_kda(layer: nn.Module, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """One transformers KDA layer (its own parameters) over packed sequences, per-sequence state resets:
    x [T, D] (N sequences at cu int32 [N+1]) -> y [T, D] in x's dtype; formulas in the module docstring."""
    return stateful_kda(layer, x, cu)[0]


def _cached(layer: nn.Module, hidden_states: torch.Tensor, cache: Any, stateful: Any) -> torch.Tensor:
    """A linear-attention layer's call with a transformers cache, by its `stateful` function (`stateful_kda`,
    `stateful_gdn`): hidden_states [B, T, D], each row one sequence continuing from the state in
    `cache.layers[layer.layer_idx]` (a LinearAttentionLayer: `conv_states[0]` [B, C, W-1],
    `recurrent_states[0]` [B, H, K, V] fp32; both absent = a fresh sequence) -> y [B, T, D]. The new states
    replace the layer's (new tensors: the ones read are never written, so a cache row shared by branches
    stays intact)."""
    B, T, D = hidden_states.shape
    lc = cache.layers[layer.layer_idx]
    fresh = not lc.has_previous_state[0]
    conv = None if fresh else lc.conv_states[0]
    S = None if fresh else lc.recurrent_states[0]
    cu = torch.arange(0, B * T + 1, max(T, 1), dtype=torch.int32, device=hidden_states.device)[:B + 1]
    y, conv_new, S_new = stateful(layer, hidden_states.reshape(B * T, D), cu, conv, S)
    lc.conv_states[0], lc.recurrent_states[0] = conv_new, S_new
    lc.is_conv_states_initialized[0] = lc.is_recurrent_states_initialized[0] = True
    lc.has_previous_state[0] = True
    lc.conv_kernel_size[0] = layer.conv1d.weight.shape[-1]
    if lc.device is None:
        lc.dtype, lc.device = conv_new.dtype, conv_new.device
    return y.view(B, T, D)


def cached_kda(layer: nn.Module, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """A KDA layer's call with a transformers cache (HFPolicy's TorchEngine path, one forward per cache row
    or B rows of T tokens each): hidden_states [B, T, D] -> y [B, T, D]; per-row conv tail [B, 3HK, W-1] and
    state S [B, H, K, V] fp32 read from and written to the cache (`_cached`)."""
    return _cached(layer, hidden_states, cache, stateful_kda)


# ------------------------------------------------------------------------------------------ Gated DeltaNet
def _gdn_inputs(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The projections of a transformers Gated DeltaNet layer: x [T, D] -> (conv input [T, 2 Hk K + Hv V]
    ordered [q; k; v] as its conv1d channels, z [T, Hv, V], b [T, Hv], a [T, Hv]). Qwen3-Next projects
    q, k, v, z grouped per key head (`in_proj_qkvz`, `in_proj_ba`: the layer's own regrouping), Qwen3.5
    separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`)."""
    T = x.shape[0]
    if hasattr(layer, "in_proj_qkvz"):
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x)[None],
                                                              layer.in_proj_ba(x)[None])
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
        return mixed, z[0], b[0], a[0]
    z = layer.in_proj_z(x).view(T, layer.num_v_heads, layer.head_v_dim)
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x), layer.in_proj_a(x)


def stateful_gdn(layer: nn.Module, x: torch.Tensor, cu: torch.Tensor, conv_state: torch.Tensor | None = None,
                 state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transformers Gated DeltaNet layer (Qwen3-Next / Qwen3.5; its own parameters) over N packed
    sequences, each continuing from its given state: x [T, D] (sequence n at cu int32 [N+1]), conv_state
    [N, C, W-1] with C = 2 Hk K + Hv V (None: zeros), state [N, Hv, K, V] fp32 (None: zeros) -> (y [T, D] in
    x's dtype, new conv state [N, C, W-1], new state S [N, Hv, K, V] fp32):

        [q; k; v] = SiLU(ShortConv_W([W_q; W_k; W_v] x))   per sequence (model/short_conv.py, cu_seqlens)
        q, k repeated from Hk to Hv heads;  q <- L2Norm(q) K^-1/2,  k <- L2Norm(k)
        beta = sigmoid(W_b x),  g = -e^{A_log} softplus(W_a x + dt_bias)      (one log-decay per head)
        S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t  (gated_delta.py)
        y = W_out [RMSNorm_head(o) * SiLU(z)]   (the layer's gated norm)

    Running a sequence in pieces, each from the previous piece's states, equals running it whole."""
    T = x.shape[0]
    Hk, Hv, K, Vd = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    mixed, z, b, a = _gdn_inputs(layer, x)
    w = layer.conv1d.weight.squeeze(1)  # [C, W]
    mixed = mixed.to(w.dtype)
    if conv_state is not None:
        conv_state = conv_state.to(w.dtype)
    if layer.conv1d.bias is None and layer.activation in ("silu", "swish"):
        mixed, conv_new = causal_short_conv_silu(mixed, w, cu, conv_state)  # fused kernel on fp32 CPU
    else:
        from transformers.activations import ACT2FN

        y, conv_new = causal_short_conv(mixed, w, cu, conv_state)
        mixed = ACT2FN[layer.activation](y if layer.conv1d.bias is None else y + layer.conv1d.bias)
    q, k, v = mixed.to(x.dtype).split([Hk * K, Hk * K, Hv * Vd], -1)
    acc = torch.promote_types(x.dtype, torch.float32)  # the recurrence's dtype: fp32 (fp64 for fp64 models)
    q, k, v = q.reshape(T, Hk, K).to(acc), k.reshape(T, Hk, K).to(acc), v.reshape(T, Hv, Vd).to(acc)
    if Hv // Hk > 1:
        q, k = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
    beta = b.sigmoid().to(acc)
    g = -layer.A_log.to(acc).exp() * F.softplus(a.to(acc) + layer.dt_bias)
    args = ((l2norm(q) * K**-0.5)[None], l2norm(k)[None], v[None], g[None], beta[None], state, cu)
    with torch.autocast(device_type=x.device.type, enabled=False):
        if q.is_cuda and gated_delta_fla.applies(q, seq_lens_from_cu(cu, T)):  # fla: packed forward, prefills
            o, S = gated_delta_fla.chunk_gated_delta_fla(*args)
        else:  # CPU, decode steps, fp64: the torch forms (chunkwise / token steps)
            o, S = gated_delta(*args)
    o = layer.norm(o[0].to(x.dtype).reshape(T * Hv, Vd), z.reshape(T * Hv, Vd))
    return layer.out_proj(o.reshape(T, Hv * Vd)), conv_new, S


def packed_gdn(layer: nn.Module, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """One transformers Gated DeltaNet layer over packed sequences, per-sequence state resets: x [T, D]
    (N sequences at cu int32 [N+1]) -> y [T, D] in x's dtype (`stateful_gdn` from zero states)."""
    return stateful_gdn(layer, x, cu)[0]


def cached_gdn(layer: nn.Module, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """A Gated DeltaNet layer's call with a transformers cache (TorchEngine): hidden_states [B, T, D] ->
    y [B, T, D]; per-row conv tail [B, C, W-1] and state S [B, Hv, K, V] fp32 in the cache (`_cached`)."""
    return _cached(layer, hidden_states, cache, stateful_gdn)


class _PackedLinearAttention:
    """Mixin of a transformers linear-attention layer (KDA, Gated DeltaNet): a full-sequence call without
    cache runs its stateful function over the packing (`CU_KWARG`; zero start states), a call with a cache (no
    padding) runs it from the cache rows' states (`_cached`); a padded call is transformers' own forward."""

    stateful: Any = None  # set per layer kind: stateful_kda / stateful_gdn

    def forward(self, hidden_states: torch.Tensor, cache_params: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        cu = kwargs.pop(CU_KWARG, None)
        stateful = type(self).stateful
        padded = attention_mask is not None and not bool(attention_mask.all())
        if cache_params is not None and not padded:  # TorchEngine / decoding: Odyssey's stateful path
            return _cached(self, hidden_states, cache_params, stateful)
        if cache_params is not None or padded:  # padding: transformers' own path
            return super().forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                   **kwargs)
        B, T, D = hidden_states.shape
        if cu is None:  # each row one sequence
            cu = torch.arange(0, B * T + 1, max(T, 1), dtype=torch.int32, device=hidden_states.device)[:B + 1]
        elif B != 1:
            raise ValueError(f"a packed call (cu_seqlens) takes one row; got {B} rows")
        return stateful(self, hidden_states.reshape(B * T, D), cu)[0].view(B, T, D)


class _PackedKDA(_PackedLinearAttention):
    """Mixin of a transformers KDA layer: `stateful_kda` on packed calls and cache rows."""

    stateful = staticmethod(stateful_kda)


class _PackedGDN(_PackedLinearAttention):
    """Mixin of a transformers Gated DeltaNet layer: `stateful_gdn` on packed calls and cache rows."""

    stateful = staticmethod(stateful_gdn)


class _PerSequenceDSA:
    """Mixin of glm5_next's DSA attention: a packed call runs transformers' forward once per sequence (the
    indexer's pools and top-k then stay inside it). Returned top-k indices (for the next, "shared" layer) are
    per-sequence, concatenated along T: [1, T, W]."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                past_key_values: Any = None, prev_topk_indices: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        cu = kwargs.pop(CU_KWARG, None)
        if cu is None or past_key_values is not None or cu.numel() <= 2:
            return super().forward(hidden_states, attention_mask, past_key_values=past_key_values,
                                   prev_topk_indices=prev_topk_indices, **kwargs)
        T = hidden_states.shape[1]
        cut = lambda t, a, b: t[:, a:b] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == T \
            else t  # noqa: E731
        outs, tops = [], []
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            sub = {name: cut(val, a, b) for name, val in kwargs.items()}
            o, _, top = super().forward(cut(hidden_states, a, b), cut(attention_mask, a, b),
                                        past_key_values=None, prev_topk_indices=cut(prev_topk_indices, a, b),
                                        **sub)
            outs.append(o)
            tops.append(top)
        top = None if tops[0] is None else torch.cat(tops, 1)
        return torch.cat(outs, 1), None, top


@functools.cache
def _subclass(mixin: type, base: type) -> type:
    """`mixin` over a transformers class, as a class of this module (picklable by name)."""
    cls = type(f"Packed{base.__name__}", (mixin, base), {"__module__": __name__, "__doc__": mixin.__doc__})
    globals()[cls.__name__] = cls
    return cls


def _swaps(model_type: str) -> list[tuple[str, type]]:
    """(transformers class name, mixin) pairs that `patch_linear_attention` swaps for `model_type`."""
    if model_type in KDA_MODELS:
        _, kda_name, trunk_name, dsa_name = KDA_MODELS[model_type]
        pairs = [(trunk_name, _PackedTrunk), (kda_name, _PackedKDA)]
        return pairs + ([(dsa_name, _PerSequenceDSA)] if dsa_name is not None else [])
    if model_type in GDN_MODELS:
        _, gdn_name, trunk_name = GDN_MODELS[model_type]
        return [(trunk_name, _PackedTrunk), (gdn_name, _PackedGDN)]
    return []


def __getattr__(name: str) -> type:
    """The patched classes by name (`PackedKimiLinearDeltaAttention`, `PackedQwen3NextGatedDeltaNet`, ...),
    built on first use: a pickled patched model unpickles in a process that has not patched one yet."""
    for model_type in (*KDA_MODELS, *GDN_MODELS):
        for base_name, mixin in _swaps(model_type):
            if name == f"Packed{base_name}":
                return _subclass(mixin, getattr(_transformers_module(model_type), base_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def patch_linear_attention(hf: nn.Module) -> int:
    """Make a KDA hybrid (kimi_linear, glm5_next) or Gated DeltaNet hybrid (qwen3_next, qwen3_5,
    qwen3_5_moe) HF model's packed forward per-sequence correct on Odyssey's kernels (module docstring), in
    place: its trunk, linear-attention layers (and glm5_next's DSA layers) change class to packing-aware
    subclasses (same parameters, same state_dict). Any other model is left alone. Returns the number of
    linear-attention layers patched (0: not such a hybrid). Idempotent."""
    model_type = model_type_of(hf.config)
    pairs = _swaps(model_type)
    if not pairs:
        return 0
    mod = _transformers_module(model_type)
    swaps = [(getattr(mod, name), mixin) for name, mixin in pairs]
    n = 0
    for module in hf.modules():
        for base, mixin in swaps:
            if type(module) is base:
                module.__class__ = _subclass(mixin, base)
                n += issubclass(mixin, _PackedLinearAttention)
    return n


def has_kda_layers(hf: nn.Module) -> bool:
    """True when `hf` holds linear-attention layers patched by `patch_linear_attention` (KDA: kimi_linear,
    glm5_next; Gated DeltaNet: qwen3_next, qwen3_5, qwen3_5_moe): its TorchEngine cache rows then carry a
    per-layer `KDAState` (conv tail + recurrent state), whichever of the two rules the layer runs."""
    return any(isinstance(m, _PackedLinearAttention) for m in hf.modules())


def hybrid_causal_lm_classes() -> dict[str, type]:
    """model_type -> the transformers class HFPolicy loads for a KDA hybrid that AutoModelForCausalLM does not
    map (glm5_next's causal LM is Glm5NextForConditionalGeneration: `model` + `lm_head`; text-only calls)."""
    from transformers.models.glm5_next import Glm5NextForConditionalGeneration

    return {"glm5_next": Glm5NextForConditionalGeneration}


def register_hybrid_causal_lms() -> None:
    """Register `hybrid_causal_lm_classes` with AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for model_type, cls in hybrid_causal_lm_classes().items():
        AutoModelForCausalLM.register(type(AutoConfig.for_model(model_type)), cls, exist_ok=True)


@contextlib.contextmanager
def transformers_reference_kernels(model_type: str) -> Iterator[None]:
    """Within it, transformers' KDA layers of `model_type` run transformers' own torch reference functions
    (its chunked KDA and conv1d in torch), even where fla-core is installed (whose Triton kernels fail on
    CPU). The oracle of tests/test_hf_hybrid.py and the baseline of bench/hf_hybrid.py."""
    import inspect

    mod = _transformers_module(model_type)
    saved = {name: getattr(mod, name) for name in _TRANSFORMERS_KERNELS if hasattr(mod, name)}
    try:
        for name, fn in saved.items():
            setattr(mod, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)


__all__ = ["CU_KWARG", "GDN_MODELS", "KDA_MODELS", "KDAState", "cached_gdn", "cached_kda", "has_kda_layers",
           "hybrid_causal_lm_classes", "packed_gdn", "packed_kda", "patch_linear_attention",
           "register_hybrid_causal_lms", "stateful_gdn", "stateful_kda", "transformers_reference_kernels"]
