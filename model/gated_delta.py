r"""The gated delta rule (Gated DeltaNet of Qwen3-Next, Qwen3.5): naive oracle, chunkwise form, decode form.

Per head, with a scalar log-decay g_t <= 0 per token and head (not per channel, unlike KDA), state S [K, V]:

    S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t              (1)

transformers' convention (`torch_recurrent_gated_delta_rule` of models/qwen3_next, checked by
tests/test_hf_gated_delta.py): the decay applies to the old state first, then the delta update reads the
decayed state: S' = e^{g_t} S_{t-1}, S_t = S' + k_t beta_t (v_t - S'^T k_t)^T; the same as (1) since the
decay is a scalar. Its q and k are L2-normalised inside the kernel (`l2norm`: x rsqrt(sum x^2 + 1e-6)) and q
is scaled by K^-1/2; here q and k are used AS GIVEN: the caller normalises and scales (`l2norm`, as
model/hf_linear_attention.py does), so the kernels stay the bare recurrence.

Chunkwise form (WY / UT transform), chunks of C = 64 tokens, start state S_0, c_t = sum_{s<=t} g_s inside the
chunk (fp32), D[t, s] = e^{c_t - c_s} for s <= t (else 0; every factor <= 1, so nothing overflows whatever
the gate):

    A[t, s] = beta_t (k_t . k_s) D[t, s]  (s < t),     (I + A) [u | w] = [Diag(beta) V | Diag(beta e^c) K]
    U = u - w S_0                        (the chunk's delta-rule updates beta_t (v_t - S'_t^T k_t))
    O = Diag(e^c) Q S_0 + ((Q K^T) * D) U
    S_C = e^{c_C} S_0 + (K * e^{c_C - c})^T U                                                         (2)

Every decay factor e^x (D, e^c, e^{c_C - c}) below e^LOG_FLUSH = e^-60 is taken as 0 (`_decay`): a change
< 1e-26 that keeps subnormal floats, 10-20x slower in CPU matmuls, out of the forward and the backward.
u, w and (Q K^T) * D depend on the chunk alone and are computed for every chunk of every sequence at once;
only S_0 -> S_C loops over chunk steps. Packed sequences (cu_seqlens) each start from their own state
(zeros, or initial_state[n]) and return their own final state: nothing crosses a boundary. Chunks are laid
out step-major over all sequences (model/kda_chunk.py `_chunk_layout`), padded with zero tokens (k = 0,
beta = 0, g = 0: the state passes a pad unchanged).

Functions (fp32 inside, fp64 for fp64 inputs; autograd through torch ops; q, k [B, T, H, K], v [B, T, H, V],
g, beta [B, T, H]; with cu_seqlens int [N+1] B must be 1; initial_state [N, H, K, V] or None = zeros; returns
(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32)):
- `naive_recurrent_gated_delta`: the oracle, one sequence and one token at a time, (1) literally;
- `chunk_gated_delta`: the chunkwise form (2), the learner's path;
- `recurrent_gated_delta`: (1) vectorised over sequences, one step per token position: decode steps and
  short continuations (TorchEngine), where a 64-token chunk would be mostly padding;
- `gated_delta`: picks one of the last two by the longest sequence (`RECURRENT_MAX_LEN`).
"""

from __future__ import annotations

import torch

from model.kda_chunk import _chunk_layout
from model.short_conv import seq_lens_from_cu

CHUNK = 64
#: `gated_delta` runs the token-step form when no sequence is longer than this (decode steps, short
#: observations), else the chunkwise form
RECURRENT_MAX_LEN = 16


#: decay exponents below this flush to an exact 0 (`_decay`): e^-60 ~ 1e-26, far below fp32 rounding of any
#: O(1) output, while the subnormal floats that e^x for x < -87 and its products make run the CPU's matmuls
#: 10-20x slower (measured: the chunkwise form's batched matmuls, forward and backward, on a random
#: Qwen3-Next whose gates sum past -87 within a chunk)
LOG_FLUSH = -60.0


def _decay(x: torch.Tensor) -> torch.Tensor:
    """e^x for decay exponents x <= 0, with e^x = 0 (gradient 0) where x < LOG_FLUSH: no subnormals."""
    return x.masked_fill(x < LOG_FLUSH, float("-inf")).exp()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum x^2 + eps) over the last dim: transformers' / fla's l2norm of the gated delta rule."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Check shapes and packing (module docstring); return the N sequence lengths."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError("the gated delta rule expects q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"g and beta must be [B, T, H] = {tuple(q.shape[:3])} (one scalar per token and "
                         f"head); got g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    B, T, H, K = q.shape
    if cu_seqlens is None:
        lens = [T] * B
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T, so B must be 1; got B={B}")
        lens = seq_lens_from_cu(cu_seqlens, T)
    want = (len(lens), H, K, v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(f"initial_state must be [N, H, K, V] = {list(want)} (one per sequence), got "
                         f"{tuple(initial_state.shape)}")
    return lens


def _acc(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs (the tests' rounding-free truth)."""
    return torch.promote_types(x.dtype, torch.float32)


def _flat(q, k, v, g, beta, lens: list[int]):
    """[B, T, ...] -> the packed [T_total, ...] tensors in `_acc` (B sequences of T = B packed sequences)."""
    return [x.reshape(sum(lens), *x.shape[2:]).to(_acc(q)) for x in (q, k, v, g, beta)]


def _state0(initial_state: torch.Tensor | None, n: int, H: int, K: int, V: int,
            like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(n, H, K, V, dtype=_acc(like))
    return initial_state.to(_acc(like))


def naive_recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: recurrence (1), one sequence at a time, one token at a time (shapes: module docstring)."""
    lens = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gf, bf = _flat(q, k, v, g, beta, lens)
    S0 = _state0(initial_state, len(lens), H, K, V, q)
    outs, finals, start = [], [], 0
    for n, L in enumerate(lens):
        S = S0[n]  # [H, K, V]
        for t in range(start, start + L):
            kt, bt = kf[t], bf[t][:, None, None]  # [H, K], [H, 1, 1]
            S = gf[t].exp()[:, None, None] * S
            S = S - bt * kt[:, :, None] * torch.einsum("hk,hkv->hv", kt, S)[:, None, :] \
                + bt * kt[:, :, None] * vf[t][:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, qf[t]))
        finals.append(S)
        start += L
    o = torch.stack(outs) if outs else vf.new_zeros(0, H, V)
    return o.reshape(B, T, H, V).to(q.dtype), torch.stack(finals)


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                          cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence (1) for all sequences at once, one step per token position (the t-th token of every
    sequence together; a sequence shorter than the longest is padded with k = 0, beta = 0, g = 0, which
    leave its state unchanged). Cost ~ N * max length steps of [H, K, V] work: for decode steps and short
    continuations. Shapes: module docstring."""
    lens = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, Lmax = len(lens), max(lens, default=0)
    qf, kf, vf, gf, bf = _flat(q, k, v, g, beta, lens)
    dev = q.device
    uniform = all(n == Lmax for n in lens)  # e.g. a decode step (one token per sequence): no padding
    valid = None
    if uniform:
        qp, kp, vp, gp, bp = (x.view(N, Lmax, *x.shape[1:]) for x in (qf, kf, vf, gf, bf))
    else:
        lens_t = torch.tensor(lens, device=dev)
        bos = torch.cumsum(lens_t, 0) - lens_t
        pos = torch.arange(Lmax, device=dev)
        valid = pos[None] < lens_t[:, None]  # [N, Lmax]
        src = torch.where(valid, bos[:, None] + pos[None], T * B)  # the appended zero row for padding
        qp, kp, vp, gp, bp = (torch.cat([x, x.new_zeros(1, *x.shape[1:])])[src]  # [N, Lmax, ...]
                              for x in (qf, kf, vf, gf, bf))
    S = _state0(initial_state, N, H, K, V, q)
    outs = []
    for t in range(Lmax):
        kt, bt = kp[:, t], bp[:, t][..., None]  # [N, H, K], [N, H, 1]
        S = gp[:, t].exp()[..., None, None] * S
        delta = bt * (vp[:, t] - torch.einsum("nhk,nhkv->nhv", kt, S))  # [N, H, V]
        S = S + kt[..., None] * delta[..., None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, qp[:, t]))
    if not outs:
        o = vf.new_zeros(0, H, V)
    else:  # [T_total, H, V], packed order
        o = torch.stack(outs, 1)
        o = o.reshape(N * Lmax, H, V) if valid is None else o[valid]
    return o.reshape(B, T, H, V).to(q.dtype), S


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise form (2) (module docstring); equals `naive_recurrent_gated_delta`. Shapes: module
    docstring; chunk_size any positive int (64 by default)."""
    lens = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int (default {CHUNK}), got {chunk_size!r}")
    B, T, H, K = q.shape
    V, C, N = v.shape[-1], chunk_size, len(lens)
    qf, kf, vf, gf, bf = _flat(q, k, v, g, beta, lens)
    S = _state0(initial_state, N, H, K, V, q)
    if sum(lens) == 0:
        return q.new_zeros(B, T, H, V), S
    lay = _chunk_layout(lens, C, q.device)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T_total, H, ...] -> [M, H, C, ...], contiguous
        if lay.padded:  # src points the padding slots at an appended zero token
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[lay.src]
        elif not lay.identity:  # a permutation (chunks step-major over the sequences)
            x = x[lay.src]
        return x.reshape(-1, C, *x.shape[1:]).transpose(1, 2).contiguous()  # batched matmuls' fast path

    qc, kc, vc, gc, bc = (chunks(x) for x in (qf, kf, vf, gf, bf))  # [M, H, C, K|V], g, beta [M, H, C]
    c = gc.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = _decay((c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")))  # [M, H, C, C]
    A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * D).tril(-1)  # strictly lower: I + A unit lower
    ec = _decay(c)
    rhs = torch.cat([bc[..., None] * vc, (bc * ec)[..., None] * kc], -1)
    u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([V, K], -1)
    Aqk = (qc @ kc.transpose(-1, -2)) * D
    q_dec = qc * ec[..., None]
    k_decT = (kc * _decay(c[..., -1:] - c)[..., None]).transpose(-1, -2).contiguous()  # [M, H, K, C]
    end = ec[..., -1, None, None]  # [M, H, 1, 1]
    # the chunk steps' pieces as views (split: one backward concatenation, not a zero-filled full-size
    # gradient per slice and step)
    steps = [x.split(lay.active) for x in (u, w, q_dec, Aqk, k_decT, end)]
    Sa = S[lay.order]  # sequences sorted by chunk count: step j runs the first active[j]
    outs, done = [], []  # done: the states of sequences that ran out of chunks, latest first at the end
    for n_act, (u_j, w_j, q_j, a_j, k_j, e_j) in zip(lay.active, zip(*steps)):
        if n_act < Sa.shape[0]:
            done.append(Sa[n_act:])
            Sa = Sa[:n_act]
        U = u_j - w_j @ Sa
        outs.append(q_j @ Sa + a_j @ U)
        Sa = e_j * Sa + k_j @ U
    o = torch.cat(outs).transpose(1, 2).reshape(-1, H, V)  # [M C, H, V] step-major
    o = o if lay.identity else o[lay.dst]  # [T_total, H, V]
    final = torch.cat([Sa, *reversed(done)])[torch.argsort(lay.order)]
    return o.reshape(B, T, H, V).to(q.dtype), final


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (1) by the cheaper exact form: `recurrent_gated_delta` when no sequence is longer
    than RECURRENT_MAX_LEN tokens, else `chunk_gated_delta`. Shapes: module docstring."""
    lens = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if max(lens, default=0) <= RECURRENT_MAX_LEN:
        return recurrent_gated_delta(q, k, v, g, beta, initial_state, cu_seqlens)
    return chunk_gated_delta(q, k, v, g, beta, initial_state, cu_seqlens)


__all__ = ["CHUNK", "RECURRENT_MAX_LEN", "check_inputs", "chunk_gated_delta", "gated_delta", "l2norm",
           "naive_recurrent_gated_delta", "recurrent_gated_delta"]
