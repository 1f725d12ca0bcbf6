r"""KDA on CPU: the recurrence itself, in C++, forward and backward (model/fused_cpu.cpp `kda_recurrent_*`).

    S' = Diag(e^{g_t}) S_{t-1},  d_t = v_t - S'^T k_t,  S_t = S' + beta_t k_t d_t^T,  o_t = S_t^T q_t   (1, 2)

exactly `naive_recurrent_kda` (model/kda_reference.py), token by token, one (sequence, head) chain per
task. Why this is the fast path on a CPU: a chain's state S [K, V] (4 KB at K = V = 32, 64 KB at 128) stays
in L1/L2 while the chain runs, and a token costs four passes over it (decay with S'^T k, rank-1 update with
S^T q), about 4 K V multiply-adds. The chunkwise form (model/kda_chunk.py) does about as much arithmetic per
token, but as batched small matmuls and elementwise passes over [chunk, chunk] and [chunk, K] tiles, which
on a CPU cost memory traffic and op dispatch; its parallelism across the chunks of one sequence pays on a
GPU (fla), not on two cores. Measured on the tiny preset (H = 4, K = V = 32): docs/performance.md.

Backward: the forward keeps the state at the start of every `_BLOCK` tokens of a chain; the backward
recomputes one block forward from its checkpoint (keeping S'_t and d_t, ~256 KB per chain at K = V = 32)
and runs the adjoint recurrence back through it:

    dS += q_t dO_t^T;  dq_t = S_t dO_t;  dbeta_t = k_t^T dS d_t;  dd = beta_t dS^T k_t;  dv_t = dd;
    dk_t = beta_t dS d_t - S' dd;  M = dS - k_t dd^T;  dg_t = rowsum(M * S');  dS <- Diag(e^{g_t}) M

Memory: the checkpoints, T / _BLOCK states per head (16 MB at 64K tokens, 4 heads, K = V = 32), instead of
the chunkwise form's per-chunk intermediates. No overflow can occur (no e^{+x} factor anywhere), so this path
needs no bound on the decay; the layer's gate keeps g in [g_min, 0) anyway.

Serves fp32 CPU tensors (`applies`); `model.kda.kda_sequence` picks it, else chunk_kda. The oracles are in
tests/test_kda.py (forward and every gradient against naive_recurrent_kda).
"""

from __future__ import annotations

import torch

from model import fused_cpu
from model.short_conv import seq_lens_from_cu

_BLOCK = 64  # tokens between two state checkpoints of a chain (the backward recomputes one block at a time)


def applies(*tensors: torch.Tensor | None) -> bool:
    """True when the C++ recurrence serves these tensors: all fp32 on CPU, the kernels built."""
    ts = [t for t in tensors if t is not None]
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts) and fused_cpu.load() is not None


class _Recurrence(torch.autograd.Function):
    """(q, k, v, g [T, H, K|V], beta [T, H], S0 [N, H, K, V] | None) -> (o [T, H, V], S [N, H, K, V])."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, cu: list[int]):
        kernels = fused_cpu.load()
        needs_grad = any(ctx.needs_input_grad[:6])
        empty = q.new_empty(0)
        o, S, ckpt = kernels.kda_recurrent_fwd(q, k, v, g, beta, cu, S0 if S0 is not None else empty,
                                               _BLOCK if needs_grad else 0)
        if needs_grad:
            ctx.save_for_backward(q, k, v, g, beta, ckpt)
            ctx.cu = cu
        return o, S

    @staticmethod
    def backward(ctx, dO, dS):
        q, k, v, g, beta, ckpt = ctx.saved_tensors
        empty = q.new_empty(0)
        dO = dO.contiguous() if dO is not None else torch.zeros_like(v)
        dq, dk, dv, dg, db, dS0 = fused_cpu.load().kda_recurrent_bwd(
            q, k, v, g, beta, ctx.cu, ckpt, _BLOCK, dO, dS.contiguous() if dS is not None else empty)
        return dq, dk, dv, dg, db, (dS0 if ctx.needs_input_grad[5] else None), None


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence (1) over B rows or packed sequences, chunk_kda's contract: q, k, g [B, T, H, K],
    v [B, T, H, V], beta [B, T, H]; with cu_seqlens int [N+1], B = 1 and N packed sequences; initial_state
    [N, H, K, V] or None (zeros). q is used as given. Returns o [B, T, H, V] and the final state
    [N, H, K, V], fp32. Differentiable with respect to every input."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        cu = list(range(0, B * T + 1, T)) if T else [0] * (B + 1)
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T, so B must be 1; got B={B}")
        lens = seq_lens_from_cu(cu_seqlens, T)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
    N = len(cu) - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N={N}, H={H}, K={K}, V={V}] (one per sequence), got "
                         f"{tuple(initial_state.shape)}")
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    S0 = initial_state.contiguous() if initial_state is not None else None
    o, S = _Recurrence.apply(*flat, S0, cu)
    return o.view(B, T, H, V), S
