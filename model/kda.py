r"""Kimi Delta Attention (KDA) with lower-bound decay: the gate, the decode step, the layer, and
`chunk_kda`, which picks the chunkwise backend.

Notation (DESIGN.md, "Model"; docs/kda.md). Per head, with state S in R^{K x V}:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t     (1)

alpha_t = exp(g_t) in (0, 1]^K, g_t the log-decay, beta_t in (0, 1) the delta-rule step size.
Gate (lower-bound decay): g = g_min * sigmoid(e^{A_h} * z) in [g_min, 0), g_min = -5, A_h = 0 at init,
instead of the unbounded g = -e^{A_h} * softplus(z).

The code is split by role:
    model/kda_reference.py  the readable reference: token-by-token recurrence, plain chunked form (oracles)
    model/kda_chunk.py      the chunkwise fast path in torch (tiles, WY form, fused CPU kernels)
    model/kda_fla.py        the CUDA backend: fla-core's Triton `chunk_kda` behind our contract
    model/kda.py            this file: gates, decode step, backend choice, `KDALayerState`, `KDAttention`

The math functions do NOT scale q: `KDAttention` multiplies q by K^-1/2 (after its L2 norm) before
calling them, so o_t = S_t^T (K^-1/2 q_t) in the layer. Every name the layer file had before the split
(`naive_recurrent_kda`, `TILE`, ...) is still importable from here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import fused_cpu, kda_chunk, kda_fla, kda_recurrent
from model.fused_weights import ConcatWeight, small_linear
from model.kda_chunk import MAX_TILE_LOG_DECAY, TILE
from model.kda_reference import naive_chunk_kda, naive_recurrent_kda
from model.norm import RMSNorm
from model.short_conv import causal_short_conv_silu, seq_lens_from_cu


# --------------------------------------------------------------------------------------------- gates
def kda_gate(z: torch.Tensor, A_log: torch.Tensor, g_min: float = -5.0) -> torch.Tensor:
    """Lower-bounded log-decay g = g_min * sigmoid(e^{A_h} * z), per channel, in [g_min, 0).

    z: [..., H, K] gate pre-activation; A_log: [H] (initialised to 0). Returns fp32 g [..., H, K].
    Because g >= g_min per token, a 16-token tile has cumulative log-decay >= 16 * g_min = -80.
    """
    return g_min * torch.sigmoid(A_log.float().exp()[:, None] * z.float())


def unbounded_kda_gate(z: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """CONTROL ONLY: the unbounded gate g = -e^{A_h} * softplus(z) in (-inf, 0), [..., H, K] fp32.

    Not used by the model. tests/test_kda.py uses it to show that, for large z, a 16-token tile's
    cumulative log-decay exceeds what exp() can represent and the dense diagonal tiles overflow.
    """
    return -A_log.float().exp()[:, None] * F.softplus(z.float())


# ---------------------------------------------------------------------------------------------- decode
def fused_recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of (1)/(2) for N sequences at once (a fused kernel in fla; a few ops here).

    q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]; state: [N, H, K, V].
    Returns o [N, H, V] (v's dtype) and the new state [N, H, K, V] fp32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float() * g.exp()[..., None]
    delta = v - torch.einsum("nhk,nhkv->nhv", k, S)
    S = S + (beta[..., None] * k)[..., None] * delta[:, :, None, :]
    return torch.einsum("nhk,nhkv->nhv", q, S).to(v.dtype), S


# ------------------------------------------------------------------------------------- chunkwise backend
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    check_decay_bound: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel KDA on the best backend for the tensors; equals `naive_recurrent_kda`.

    CUDA tensors with fla-core installed: fla's Triton kernels (model/kda_fla.py; ODYSSEY_KDA_FLA=0
    turns them off). Otherwise the torch chunkwise form (model/kda_chunk.py), with fused C++ kernels on
    CPU without autograd. Same contract on both (see `model.kda_chunk.chunk_kda`):
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; cu_seqlens int [N+1] (then B = 1);
    initial_state [N, H, K, V] or None; q used as given. Returns o [B, T, H, V] (v's dtype) and the
    final state [N, H, K, V] fp32.
    """
    args = (q, k, v, g, beta, initial_state, chunk_size, cu_seqlens, check_decay_bound)
    if q.is_cuda and kda_fla.available():
        return kda_fla.chunk_kda_fla(*args)
    return kda_chunk.chunk_kda(*args)


def kda_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over whole sequences on the fastest backend for the tensors, `chunk_kda`'s contract (the layer's
    entry point): fp32 on CPU, the recurrence itself in C++ with its own backward (model/kda_recurrent.py,
    several times faster there than the chunkwise form; ODYSSEY_KDA_CPU_BACKEND=chunk turns it off);
    otherwise `chunk_kda` (fla on CUDA, the torch chunkwise form elsewhere). g must come from `kda_gate`."""
    if (q.device.type == "cpu" and os.environ.get("ODYSSEY_KDA_CPU_BACKEND", "recurrent") != "chunk"
            and kda_recurrent.applies(q, k, v, g, beta, initial_state)):
        return kda_recurrent.recurrent_kda(q, k, v, g, beta, initial_state, cu_seqlens)
    return chunk_kda(q, k, v, g, beta, initial_state, chunk_size, cu_seqlens, check_decay_bound=False)


# ------------------------------------------------------------------------------------------------ layer
class _KdaGates(torch.autograd.Function):
    """The layer's q/k L2 norms (q scaled by K^-1/2), decay gate and beta on fp32 CPU, one fused kernel each
    way (model/fused_cpu.cpp `kda_gates`): act [T, 2HK + HV] = SiLU(conv) as [q | k | v], b [T, H] beta
    logits, zf [T, HK] = W_fb W_fa x -> q, k, g [T, H, K], v [T, H, V], beta [T, H]."""

    @staticmethod
    def forward(ctx, act, b, zf, dt_bias, A_log, g_min: float, H: int, K: int):
        act, b, zf = act.contiguous(), b.contiguous(), zf.contiguous()
        ctx.save_for_backward(act, b, zf, dt_bias, A_log)
        ctx.args = (g_min, H, K)
        return tuple(fused_cpu.load().kda_gates(act, b, zf, dt_bias, A_log, g_min, H, K))

    @staticmethod
    def backward(ctx, dq, dk, dv, dg, dbeta):
        act, b, zf, dt_bias, A_log = ctx.saved_tensors
        _, H, K = ctx.args
        T, V = act.shape[0], (act.shape[1] - 2 * H * K) // H
        shapes = [(T, H, K), (T, H, K), (T, H, V), (T, H, K), (T, H)]
        grads = [d.contiguous() if d is not None else act.new_zeros(s)
                 for d, s in zip((dq, dk, dv, dg, dbeta), shapes)]
        kernels = fused_cpu.load()
        da, db, dzf, ddt, dal = kernels.kda_gates_backward(act, b, zf, dt_bias, A_log, *ctx.args, *grads)
        return da, db, dzf, ddt, dal, None, None, None


class _KdaOutput(torch.autograd.Function):
    """sigmoid(zg) * RMSNorm_head(o) (weight w [V]) on fp32 CPU, one kernel each way (`kda_output`):
    o [T, H, V], zg [T, HV] -> [T, HV]."""

    @staticmethod
    def forward(ctx, o, zg, w, eps: float):
        y, r = fused_cpu.load().kda_output(o, zg, w, eps)
        ctx.save_for_backward(o, zg, w, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        o, zg, w, r = ctx.saved_tensors
        do, dzg, dw = fused_cpu.load().kda_output_backward(o, zg, w, r, dy.contiguous())
        return do, dzg, dw, None


@dataclass
class KDALayerState:
    """Decode state of one KDA layer for N sequences.

    recurrent: [N, H, K, V] fp32 (S of recurrence (1)); conv: [N, C, conv_size-1] (the last inputs
    of the short conv, oldest first, C = 2*H*K + H*V channels of q|k|v).
    """

    recurrent: torch.Tensor
    conv: torch.Tensor

    @classmethod
    def zeros(
        cls, config: Any, n: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> KDALayerState:
        """A fresh state for n sequences (what None means in `KDAttention.forward`)."""
        H, K = config.kda_num_heads, config.kda_head_dim
        W = getattr(config, "kda_conv_size", 4)
        return cls(
            torch.zeros(n, H, K, K, device=device, dtype=torch.float32),
            torch.zeros(n, 3 * H * K, W - 1, device=device, dtype=dtype),
        )

    def select(self, idx: torch.Tensor | list[int]) -> KDALayerState:
        """Rows idx (e.g. the sequences that continue), in that order."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.recurrent.device)
        return KDALayerState(self.recurrent[idx], self.conv[idx])

    @staticmethod
    def concat(states: list[KDALayerState]) -> KDALayerState:
        """Stack the rows of several states (sequence order preserved)."""
        return KDALayerState(torch.cat([s.recurrent for s in states]), torch.cat([s.conv for s in states]))

    def nbytes(self) -> int:
        """Bytes held (recurrent + conv), for cache accounting."""
        return sum(t.numel() * t.element_size() for t in (self.recurrent, self.conv))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x||_2 over the last dim, computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def initial_dt_bias(like: torch.Tensor, g_min: float) -> torch.Tensor:
    """Initial dt_bias [H*K] (shape/dtype/device of `like`): g0 = -exp(U(log 1e-3, 0)),
    dt_bias = logit(g0 / g_min), so with A_log = 0 and a zero gate projection the log-decay
    g_min * sigmoid(dt_bias) = g0 is log-uniform in [-1, -1e-3] over channels."""
    g0 = -torch.exp(torch.empty_like(like).uniform_(math.log(1e-3), 0.0))
    return torch.logit(g0 / g_min)


class KDAttention(nn.Module):
    """One KDA token mixer (DESIGN.md "Model"), on packed sequences.

    q, k = L2Norm(SiLU(ShortConv4(W_q x / W_k x))), q scaled by K^-1/2 here; v = SiLU(ShortConv4(W_v x));
    beta = sigmoid(W_b x); g = kda_gate(W_fb W_fa x + dt_bias, A_log, g_min) (rank-K gate projection);
    y = W_o[sigmoid(W_gb W_ga x) * RMSNorm_head(o)] (rank-K output gate), o from recurrence (1).
    Parameter names follow fla / Kimi Linear (q_proj, conv1d, f_a_proj, A_log, dt_bias, o_norm, ...).

    config: hidden_size, kda_num_heads (H), kda_head_dim (K = V), kda_conv_size (4), kda_g_min (-5),
    kda_chunk_size (64), rms_norm_eps.
    """

    def __init__(self, config: Any, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.num_heads, self.head_dim = H, K
        self.conv_size = getattr(config, "kda_conv_size", 4)
        self.g_min = float(getattr(config, "kda_g_min", -5.0))
        self.chunk_size = getattr(config, "kda_chunk_size", 64)
        if not (self.g_min < 0 and -self.g_min * TILE <= MAX_TILE_LOG_DECAY):
            raise ValueError(
                f"kda_g_min must be in [-{MAX_TILE_LOG_DECAY / TILE:g}, 0) so that a {TILE}-token tile's"
                f" cumulative log-decay stays >= -{MAX_TILE_LOG_DECAY:g} (fits fp32/bf16); got {self.g_min}"
            )
        if not (self.chunk_size > 0 and self.chunk_size % TILE == 0):
            raise ValueError(
                f"kda_chunk_size must be a positive multiple of {TILE} (default 64), got {self.chunk_size}"
            )
        if self.conv_size < 1:
            raise ValueError(f"kda_conv_size must be >= 1, got {self.conv_size}")
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        C = 3 * H * K
        self.conv1d = nn.Conv1d(C, C, self.conv_size, groups=C, bias=False)  # depthwise, causal via state
        self.b_proj = nn.Linear(D, H, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = nn.Linear(K, H * K, bias=True)
        self.o_norm = RMSNorm(K, eps=getattr(config, "rms_norm_eps", 1e-6))  # per head, weight [K] shared
        self.o_proj = nn.Linear(H * K, D, bias=False)
        self._decode_in_weight = ConcatWeight()  # [W_q; W_k; W_v; W_b; W_fa; W_ga] for the fused decode step
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A_log = 0; dt_bias so that the initial per-token log-decay g0 (at z = 0) is log-uniform in
        [-1, -1e-3] over channels: dt_bias = logit(g0 / g_min). Call again after a generic re-init."""
        self.A_log.zero_()
        self.dt_bias.copy_(initial_dt_bias(self.dt_bias, self.g_min))

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        state: KDALayerState | None = None,
    ) -> tuple[torch.Tensor, KDALayerState]:
        """x: [T, D] packed tokens of N sequences; cu_seqlens: int32 [N+1] (None = one sequence);
        state: the N sequences' KDALayerState, or None for fresh sequences.
        Returns y [T, D] and the new KDALayerState (recurrent [N, H, K, V] fp32, conv [N, C, W-1])."""
        if x.dim() != 2:
            raise ValueError(f"KDAttention takes packed x [T, D] (+ cu_seqlens), got {tuple(x.shape)}")
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=x.device)
        lens = seq_lens_from_cu(cu_seqlens, T)
        N = len(lens)
        if state is not None and state.recurrent.shape != (N, H, K, K):
            raise ValueError(
                f"state holds {tuple(state.recurrent.shape)} but cu_seqlens has N={N} sequences "
                f"(expected recurrent [N, {H}, {K}, {K}]): select() the matching cache rows"
            )

        if state is not None and all(n == 1 for n in lens):  # decode: one new token per sequence
            fused = self.decode_step_fused(x, state)
        else:
            fused = self.forward_fused(x, lens, state)
        if fused is not None:
            return fused
        mixed = self.project_qkv(x)
        q, k, v, g, beta, conv_state, fused = self.features(x, mixed, cu_seqlens,
                                                            None if state is None else state.conv)
        if state is not None and all(n == 1 for n in lens):  # decode: one new token per sequence
            o, S = fused_recurrent_kda_step(q, k, v, g, beta, state.recurrent)
        else:
            o, S = self.recurrence(q, k, v, g, beta, cu_seqlens, None if state is None else state.recurrent)
        return self.output(x, o, fused), KDALayerState(S, conv_state)

    # The pieces of `forward` (context parallelism, model/context_parallel.py, runs them one by one).
    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[W_q; W_k; W_v] x: x [T, D] -> the short conv's input [T, 3HK]."""
        return F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))

    def features(
        self, x: torch.Tensor, mixed: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """Recurrence inputs of packed x [T, D] (mixed = project_qkv(x); conv_state [N, 3HK, W-1] | None):
        (q, k [T, H, K] (q scaled by K^-1/2), v [T, H, K], g [T, H, K] fp32 >= g_min, beta [T, H], the new
        conv state [N, 3HK, W-1], fused: whether the fused CPU kernels made them)."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        mixed, conv_state = causal_short_conv_silu(  # SiLU(ShortConv(.)), fused on fp32 CPU
            mixed, self.conv1d.weight.squeeze(1), cu_seqlens, conv_state
        )
        fused = mixed.dtype == torch.float32 and mixed.is_cpu and fused_cpu.load() is not None
        if fused:  # norms, decay gate and beta in one kernel forward and one backward (same formulas)
            zf = self.f_b_proj(self.f_a_proj(x))
            b = self.b_proj(x)
            q, k, v, g, beta = _KdaGates.apply(mixed, b, zf, self.dt_bias, self.A_log, self.g_min, H, K)
        else:
            q, k, v = mixed.view(T, 3, H, K).unbind(1)
            q = _l2norm(q) * K**-0.5  # the K^-1/2 query scale lives here, not in the kernels
            k = _l2norm(k)
            beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
            z = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
            g = kda_gate(z.view(T, H, K), self.A_log, self.g_min)  # [T, H, K] fp32, >= g_min
        return q, k, v, g, beta, conv_state, fused

    def recurrence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrence (1) over packed sequences: (o [T, H, V], final states [N, H, K, V] fp32)."""
        # kda_sequence picks its precisions (fp32 recurrence state): no autocast inside
        with torch.autocast(device_type=q.device.type, enabled=False):
            o, S = kda_sequence(  # g >= g_min >= -5 by construction (checked in __init__)
                q[None], k[None], v[None], g[None], beta[None],
                initial_state=initial_state, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
            )
        return o[0], S

    def output(self, x: torch.Tensor, o: torch.Tensor, fused: bool) -> torch.Tensor:
        """y = W_o[sigmoid(W_gb W_ga x) * RMSNorm_head(o)]: x [T, D], o [T, H, V] -> [T, D]."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        zg = self.g_b_proj(self.g_a_proj(x))
        if fused and o.dtype == torch.float32:  # head norm and output gate: one kernel each way
            o = _KdaOutput.apply(o.contiguous(), zg.contiguous(), self.o_norm.weight, self.o_norm.eps)
        else:
            o = (torch.sigmoid(zg).view(T, H, K) * self.o_norm(o.to(x.dtype))).reshape(T, H * K)
        return self.o_proj(o)

    def forward_fused(
        self, x: torch.Tensor, lens: list[int], state: KDALayerState | None
    ) -> tuple[torch.Tensor, KDALayerState] | None:
        """`forward` over packed sequences (lens, states or None) without autograd on fp32 CPU (prefill): one
        matmul for the six input projections, two for the gates' rank-K up-projections, ONE fused kernel for
        everything between them and the output projection (model/fused_cpu.cpp `kda_prefill`: short conv,
        SiLU, norms, gates, the recurrence per (sequence, head), head norm, output gate). None (the caller
        runs the torch path, the reference) unless it applies; ODYSSEY_KDA_CPU_BACKEND=chunk turns it off."""
        tensors = [x, self.q_proj.weight, self.conv1d.weight]
        tensors += [state.recurrent, state.conv] if state is not None else []
        kernels = fused_cpu.applies(*tensors)
        if kernels is None or os.environ.get("ODYSSEY_KDA_CPU_BACKEND", "recurrent") == "chunk":
            return None
        H, K = self.num_heads, self.head_dim
        proj = x @ self._decode_in_weight(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                          self.b_proj.weight, self.f_a_proj.weight, self.g_a_proj.weight)
        fa = 3 * H * K + H
        zf = small_linear(proj[:, fa:fa + K], self.f_b_proj)
        zg = small_linear(proj[:, fa + K:fa + 2 * K], self.g_b_proj)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        empty = x.new_empty(0)
        conv_w = self.conv1d.weight.view(self.conv1d.weight.shape[0], self.conv_size)
        o, conv, S = kernels.kda_prefill(
            proj, zf, zg, conv_w, state.conv.contiguous() if state else empty, cu, self.dt_bias, self.A_log,
            self.g_min, self.o_norm.weight, self.o_norm.eps, state.recurrent.contiguous() if state else empty,
            H, K, K)
        return small_linear(o, self.o_proj), KDALayerState(S, conv)

    def decode_step_fused(
        self, x: torch.Tensor, state: KDALayerState
    ) -> tuple[torch.Tensor, KDALayerState] | None:
        """The decode step (one token per sequence, x [N, D]) as one matmul for the six input projections,
        ONE fused CPU kernel for conv, norms, both gates (their rank-K up-projections included), recurrence
        (1) and the head norm (model/fused_cpu.cpp `kda_decode`), and the output projection. Returns None
        (the caller runs the torch path, the reference) unless every tensor is fp32 on CPU and no gradient is
        needed."""
        kernels = fused_cpu.applies(x, state.recurrent, state.conv, self.q_proj.weight, self.conv1d.weight)
        if kernels is None:
            return None
        w_in = self._decode_in_weight(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                      self.b_proj.weight, self.f_a_proj.weight, self.g_a_proj.weight)
        proj = x @ w_in  # [N, 3HK + H + 2K]
        conv_w = self.conv1d.weight.view(self.conv1d.weight.shape[0], self.conv_size)
        o, conv, S = kernels.kda_decode(proj, self.f_b_proj.weight, self.g_b_proj.weight, self.g_b_proj.bias,
                                        conv_w, state.conv.contiguous(), self.dt_bias, self.A_log, self.g_min,
                                        self.o_norm.weight, self.o_norm.eps, state.recurrent.contiguous())
        return small_linear(o, self.o_proj), KDALayerState(S, conv)


__all__ = [
    "MAX_TILE_LOG_DECAY",
    "TILE",
    "KDALayerState",
    "KDAttention",
    "chunk_kda",
    "fused_recurrent_kda_step",
    "initial_dt_bias",
    "kda_gate",
    "kda_sequence",
    "naive_chunk_kda",
    "naive_recurrent_kda",
    "unbounded_kda_gate",
]
