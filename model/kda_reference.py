r"""Kimi Delta Attention (KDA), the readable reference: the recurrence token by token, and a plain
chunked form. Slow and obviously correct; the oracles of the fast paths (model/kda_chunk.py on CPU,
model/kda_fla.py on CUDA) in tests/test_kda.py. Style of flash-linear-attention's `naive.py`.

Notation (DESIGN.md, "Model"; docs/kda.md). Per head, with state S in R^{K x V}:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t     (1)

alpha_t = exp(g_t) in (0, 1]^K is a per-channel decay, g_t its log ("log-decay"), beta_t in (0, 1)
the delta-rule step size. Expanding (1) with S' = Diag(alpha_t) S_{t-1} gives the delta form

    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T                                                     (2)

Chunked form (3), for one chunk of C tokens with start state S_0 and Gam_r = sum_{s<=r} g_s (the
cumulative log-decay inside the chunk):

    A_kk[s, j] = sum_d k_sd k_jd e^{Gam_sd - Gam_jd}   (j < s)        A_qk[r, s] = same with q_r (s <= r)
    (I + Diag(beta) A_kk) U = Diag(beta) (V - (K * e^Gam) S_0)       (U_s = beta_s (v_s - S'_s^T k_s))
    O   = (Q * e^Gam) S_0 + A_qk U
    S_C = Diag(e^{Gam_C}) S_0 + (K * e^{Gam_C - Gam})^T U

These functions are pure math: q is NOT scaled inside them (`KDAttention` multiplies q by K^-1/2).
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token oracle of recurrence (1), in fp32, using its delta form (2).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros). q is used as given (no K^-1/2 scaling).
    Returns o [B, T, H, V] (v's dtype) and the final state [B, H, K, V] fp32.
    """
    B, T, H, K = q.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    o = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # S' = Diag(alpha_t) S_{t-1}
        k_t = k[:, t]
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # v_t - S'^T k_t
        S = S + beta[:, t, :, None, None] * k_t[..., None] * delta[:, :, None, :]
        o.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # o_t = S_t^T q_t
    return torch.stack(o, 1).to(v.dtype) if T else v.new_zeros(B, 0, H, v.shape[-1]), S


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (3) written out plainly, in fp32: the pairwise decays e^{Gam_s - Gam_j} as one
    [C, C, K] tensor per chunk, a triangular solve for U, a Python loop over chunks. No tiles, no
    anchors, no WY inverse by doubling, no fused kernels: the fast path's algebra without its tricks.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros); any chunk_size >= 1 (T is zero-padded to a multiple:
    padding tokens have k = 0 and beta = 0, so they leave the state alone). q is used as given.
    Returns o [B, T, H, V] (v's dtype) and the final state [B, H, K, V] fp32.
    """
    B, T, H, K = q.shape
    V, C, dtype = v.shape[-1], chunk_size, v.dtype
    pad = (-T) % C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, n, C, ...] fp32, zero padded
        x = x.float().transpose(1, 2)
        x = torch.cat([x, x.new_zeros(B, H, pad, *x.shape[3:])], 2)
        return x.unflatten(2, (-1, C))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    gam = g.cumsum(3)  # Gam_r, inclusive, per chunk  [B, H, n, C, K]
    r = torch.arange(C, device=q.device)
    causal = r[:, None] >= r[None, :]  # s <= r
    # pairwise decays e^{Gam_r - Gam_s} for s <= r (<= 1); masked to 0 above the diagonal before exp
    diff = gam[..., :, None, :] - gam[..., None, :, :]  # [B, H, n, C (r), C (s), K]
    decay = diff.masked_fill(~causal[..., None], -torch.inf).exp()
    A_qk = torch.einsum("...rd,...sd,...rsd->...rs", q, k, decay)  # s <= r
    A_kk = torch.einsum("...rd,...sd,...rsd->...rs", k, k, decay).tril(-1)  # j < s
    eye = torch.eye(C, device=q.device)
    lhs = eye + beta[..., None] * A_kk  # I + Diag(beta) A_kk, unit lower triangular

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    outs = []
    for n in range(q.shape[2]):
        e_gam = gam[:, :, n].exp()  # e^{Gam_r}  [B, H, C, K]
        rhs = beta[:, :, n, :, None] * (v[:, :, n] - (k[:, :, n] * e_gam) @ S)
        U = torch.linalg.solve_triangular(lhs[:, :, n], rhs, upper=False, unitriangular=True)
        outs.append((q[:, :, n] * e_gam) @ S + A_qk[:, :, n] @ U)
        gam_C = gam[:, :, n, -1:]  # [B, H, 1, K]
        S = (
            gam_C.exp().transpose(-1, -2) * S
            + (k[:, :, n] * (gam_C - gam[:, :, n]).exp()).transpose(-1, -2) @ U
        )
    o = torch.cat(outs, 2)[:, :, :T] if outs else v.new_zeros(B, H, 0, V)
    return o.transpose(1, 2).to(dtype), S
