r"""KDA's chunkwise-parallel fast path (`chunk_kda`): 16-token tiles, the WY / UT form, fused CPU kernels.

Equals the reference in model/kda_reference.py (recurrence (1), chunked form (3) there). Runs on any
device with torch; on CPU without autograd its elementwise work runs in fused C++ kernels, and on CUDA
the layer prefers fla-core's Triton kernels (model/kda_fla.py, chosen by `model.kda.chunk_kda`).
q is used as given (no K^-1/2 scaling inside).

Chunkwise form (WY / UT transform). Split the sequence into chunks of C tokens, start
state S_0, and let Gam_r = sum_{s<=r} g_s (cumulative log-decay inside the chunk, fp32). Then

    A_kk[s, j] = sum_d k_sd k_jd e^{Gam_sd - Gam_jd}   (j < s)        A_qk[r, s] = same with q_r (s <= r)
    (I + Diag(beta) A_kk) U = Diag(beta) (V - (K * e^Gam) S_0)        => U = u - w S_0,
        u = T V,  w = T (K * e^Gam),  T = (I + Diag(beta) A_kk)^{-1} Diag(beta)               (3)
    O   = (Q * e^Gam) S_0 + A_qk U
    S_C = Diag(e^{Gam_C}) S_0 + (K * e^{Gam_C - Gam})^T U

u, w and A_qk depend only on the chunk, so they are computed for many chunks at once; only the
state recurrence S_0 -> S_C loops over chunks. A_kk and A_qk are built from 16-token tiles as dense
matmuls, with one anchor per tile and no pairwise [16, 16, K] decay tensor. With r_a = Gam just before
tile a and r_{a+1} its end:

    A[a, a]  = ([q_a; k_a] * e^{Gam - r_a}) (k_a * e^{r_a - Gam})^T                       (+ causal mask)
    A[a, b]  = ([q_a; k_a] * e^{Gam - r_a}) (k_b * e^{r_{b+1} - Gam} * e^{r_a - r_{b+1}})^T     (b < a)

The row factor is in [e^-80, 1], the off-diagonal column factors are <= 1. Only the diagonal block
needs a factor above 1, e^{r_a - Gam_j} <= e^{-(sum of g over the tile)}. With g >= -5 that is
<= e^{80} ~ 5.5e34, inside the fp32/bf16 exponent range (max ~3.4e38; e^{-80} ~ 1.8e-35 stays normal).
T is applied by block forward substitution over the 16-tiles, with each diagonal 16-block inverted by
doubling (a few small matmuls). With the unbounded gate a tile can sum to -300, e^{300} = inf and the
dense tile overflows (tests/test_kda.py, the "control" test).

Without autograd, fp32 on CPU, the elementwise work of a block and the chunk loop run in fused C++
kernels (model/kda_cpu.cpp, `_wy_intra_chunk_fused`); the torch code here is their reference and the
autograd path. docs/kda.md has the details and the measurements.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from model import kda_cpu
from model.short_conv import seq_lens_from_cu

TILE = 16  # tokens per dense diagonal tile
MAX_TILE_LOG_DECAY = 80.0  # |sum of g over one tile| allowed: e^80 ~ 5.5e34 < 3.4e38 (fp32/bf16 max)
_LOG2E = math.log2(math.e)  # decay factors are formed as exp2(log2(e) * log-decay)
_LOG2_FLOOR = -100.0  # chunk-level decay factors below 2^-100 are set to 0 (`_decay`)
_CPU_BLOCK_ELEMS = 1 << 17  # on CPU, chunk_kda works on blocks of ~this many [.., C, K] elements (cache)


# --------------------------------------------------------------------------------------------- chunkwise
@dataclass
class _ChunkLayout:
    """Where each chunk of each sequence lives in the flat chunk axis.

    Sequences are sorted by chunk count (descending) and chunks are laid out step-major: all first
    chunks, then all second chunks, ... so chunk step j is the contiguous slice
    ``[offsets[j], offsets[j] + active[j])`` and covers sorted sequences ``[0, active[j])``.
    """

    src: torch.Tensor  # [M*C] token index per chunk slot (T = the zero padding row)
    dst: torch.Tensor  # [T] slot index per token
    order: torch.Tensor  # [N] sorted position -> sequence id
    active: list[int]  # sequences still running at chunk step j
    offsets: list[int]  # first flat chunk of step j
    padded: bool  # some sequence length is not a multiple of C
    identity: bool  # src is arange(T): chunking is a plain reshape


def _chunk_layout(lens: list[int], C: int, device: torch.device) -> _ChunkLayout:
    T = sum(lens)
    lens_t = torch.tensor(lens, device=device)
    nchunks = (lens_t + C - 1) // C
    order = torch.sort(nchunks, descending=True, stable=True).indices
    n_sorted = nchunks[order]
    max_c = int(n_sorted[0]) if len(lens) else 0
    running = n_sorted[None, :] > torch.arange(max_c, device=device)[:, None]  # [max_c, N]
    counts = running.sum(1)
    active = counts.tolist()  # sequences still running at chunk step j
    offsets = (counts.cumsum(0) - counts).tolist()
    step, rank = running.nonzero(as_tuple=True)  # row-major = step-major
    seq = order[rank]
    bos = torch.tensor([0, *lens], device=device).cumsum(0)[:-1]
    pos_in_seq = step[:, None] * C + torch.arange(C, device=device)  # [M, C]
    valid = pos_in_seq < lens_t[seq][:, None]
    tok = bos[seq][:, None] + pos_in_seq
    src = torch.where(valid, tok, T).flatten()
    dst = torch.empty(T, dtype=torch.long, device=device)
    dst[tok[valid]] = valid.flatten().nonzero().squeeze(1)
    padded = any(n % C for n in lens)
    identity = not padded and (len(lens) == 1 or max_c <= 1)
    return _ChunkLayout(src, dst, order, active, offsets, padded, identity)


@functools.lru_cache(maxsize=16)
def _tile_consts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """log2(e) * [T; -T] with T = tril(ones(16, 16)) (+- the tile-local cumulative sum in log2 units) and
    the mask of the entries of a diagonal block [A_qk rows; A_kk rows] [32, 16] that are zero (upper
    triangle: r < s for A_qk, j >= s for A_kk). Built outside inference mode: the result is cached, and a
    cached inference tensor could not be saved for a later backward."""
    with torch.inference_mode(False):
        tri = torch.ones(TILE, TILE, device=device).tril_()
        zero = ~torch.cat([tri, tri.tril(-1)]).bool()
        return torch.cat([tri, -tri]) * _LOG2E, zero


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^{-1} for strictly lower-triangular L [..., n, n] (n <= TILE), by doubling.

    L is nilpotent (L^n = 0), so (I + L)^{-1} = sum_i (-L)^i = (I - L)(I + L^2)(I + L^4)(I + L^8):
    six batched [n, n] matmuls for n = 16, instead of a LAPACK triangular solve per matrix.
    """
    n = L.shape[-1]
    N = -L.flatten(0, -3)
    P = N + torch.eye(n, dtype=L.dtype, device=L.device)
    for _ in range(max(0, math.ceil(math.log2(n)) - 1)):
        N = torch.bmm(N, N)
        P = torch.baddbmm(P, P, N)
    return P.view(L.shape)


def _decay(log2_factor: torch.Tensor) -> torch.Tensor:
    """2^x for a log2 decay factor x <= 0, set to exactly 0 below 2^-100 (~8e-31).

    Chunk-level decay factors reach e^-320. Below 2^-100 they are far under fp32 resolution of the O(1)
    terms they are added to, and keeping them would make denormal floats, which slow CPU arithmetic
    several-fold; 2^-inf = 0 exactly.
    """
    return F.threshold(log2_factor, _LOG2_FLOOR, -math.inf).exp2()


def _wy_intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per-chunk quantities of (3), for m chunks of nt = C / 16 tiles at once (the reference and autograd
    path; `_wy_intra_chunk_fused` is the same computation with fused CPU kernels).

    q, k: [m, H, nt, 16, K] (any strides); v: [m, H, nt, 16, V]; g: [m, nt, 16, H, K] (token layout,
    contiguous); beta: [m, H, nt, 16].
    Returns, fp32: the diagonal 16-blocks of [A_qk; A_kk] [m, H, nt, 32, 16] (masked), the row tiles of
    [A_qk; A_kk] left of their diagonal block (a list; tile a >= 1 is [m, H, 32, 16 a]), u [m, H, C, V],
    w [m, H, C, K], Q * e^Gam [m, H, C, K], (K * e^{Gam_C - Gam})^T [m, H, K, C] and e^{Gam_C} [m, H, K, 1].

    Decay factors are anchored per tile: with r_a = Gam just before tile a and r_{a+1} its end, only
    [T, K]-sized exponentials are formed (the pairwise [16, 16, K] decay tensor never is):
      left  = e^{Gam_s - r_a}      in [e^-80, 1]   rows of tile a (q and k)
      inv   = e^{r_a - Gam_j}      in [1, e^80]    columns of the diagonal block
      k_end = k e^{r_{a+1} - Gam}  in [e^-80, 1]|k| columns of tile b < a, rescaled by e^{r_a - r_{b+1}} <= 1
    so the diagonal blocks of all tiles are ONE batched matmul (then the causal mask) and the rest of row
    tile a is one more. Only the diagonal block needs a factor above 1, e^{r_a - Gam_j} <= e^{-(tile sum)}:
    the lower bound g >= -5 keeps it <= e^80. Chunk-level factors (e^{r_a}, e^{Gam_C - r_{a+1}},
    e^{r_a - r_{b+1}}, e^{Gam_C}) go through `_decay` (0 below 2^-100). Gam - r_a is a tile-local
    cumulative sum (a matmul with [tril; -tril]), in fp32 and in log2 units (exp2 is ~3x cheaper than exp
    on CPU). The tile matmuls run in q's dtype; the factors, the solve and everything after are fp32.
    """
    m, H, nt, _, K = k.shape
    dt = q.dtype
    cumsum_log2, zero_mask = _tile_consts(q.device)
    # +-(Gam_s - r_a) log2(e), fp32, as a [32, 16] x [16, H*K] matmul per tile in token layout; its exp2
    # gives the tile-local factors left = e^{Gam_s - r_a} and inv = e^{r_a - Gam_s}
    rel = (cumsum_log2 @ g.float().flatten(3)).unflatten(3, (H, K))  # [m, nt, 32, H, K]
    s = rel[:, :, TILE - 1].permute(0, 2, 1, 3)  # tile sums (log2) [m, H, nt, K], >= -80 log2(e) if bounded
    r_end = s.cumsum(2)  # r_{a+1}
    r = r_end - s  # r_a (0 for the first tile)
    left, inv = rel.exp2().permute(0, 3, 1, 2, 4).split(TILE, 3)  # [m, H, nt, 16, K] each
    qk = torch.stack([q, k], 3).float()  # [m, H, nt, 2, 16, K]: q rows then k rows of each tile
    x_l = qk * left[:, :, :, None]  # [q; k] e^{Gam_s - r_a}
    k_inv = qk[:, :, :, 1] * inv  # k_j e^{r_a - Gam_j}: up to e^80 under the bound; inf without it
    k_end = k_inv * s.exp2()[:, :, :, None]  # k_j e^{r_{a+1} - Gam_j}, in [e^-80, 1] |k_j|
    rows = x_l.to(dt).flatten(3, 4)  # [m, H, nt, 32, K]

    # diagonal 16-blocks of [A_qk; A_kk] for all tiles in one batched matmul, then the causal mask
    diag = (rows @ k_inv.to(dt).transpose(-1, -2)).float().masked_fill_(zero_mask, 0.0)  # [m, H, nt, 32, 16]
    # off-diagonal part of row tile a: columns k_end e^{r_a - r_{b+1}} (<= 1) of the tiles b < a
    fac = _decay((r[:, :, :, None] - r_end[:, :, None]).clamp_max(0.0))  # [m, H, nt (a), nt (b), K]
    off_cols = [(k_end[:, :, :a] * fac[:, :, a, :a, None]).flatten(2, 3).to(dt) for a in range(1, nt)]
    off_rows = [None] + [(rows[:, :, a] @ c.transpose(-1, -2)).float() for a, c in enumerate(off_cols, 1)]

    # block forward substitution for (I + B A_kk) [u | w] = B [V | K e^Gam], B = Diag(beta):
    # X_a = (I + B_a A_aa)^{-1} B_a (R_a - A_{a,<a} X_{<a})
    b = beta.float()
    G = _unit_lower_inverse(diag[..., TILE:, :] * b[..., None]) * b[..., None, :]  # [m, H, nt, 16, 16]
    e_r = _decay(r)[:, :, :, None]  # e^{Gam_s} = e^{r_a} e^{Gam_s - r_a}
    tile_major = (2, 0, 1, 3, 4)  # [m, H, nt, ...] -> [nt, m, H, ...]
    rhs = torch.cat([v.float().permute(tile_major), (x_l[:, :, :, 1] * e_r).permute(tile_major)], -1)
    u, w = _forward_substitution(G.permute(tile_major), rhs, off_rows, K)
    gam_C = r_end[:, :, -1:]  # Gam_C (log2 units)  [m, H, 1, K]
    k_dec = (k_end * _decay(gam_C - r_end)[:, :, :, None]).flatten(2, 3)  # K e^{Gam_C - Gam}
    q_e = (x_l[:, :, :, 0] * e_r).flatten(2, 3)  # Q e^Gam
    return diag, off_rows, u, w, q_e, k_dec.transpose(-1, -2), _decay(gam_C).transpose(-1, -2)


def _forward_substitution(
    G: torch.Tensor, rhs: torch.Tensor, off_rows: list, K: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve (I + B A_kk) [u | w] = B [V | K e^Gam] tile by tile: X_a = G_a (R_a - A_{a,<a} X_{<a}).

    Tile-major inputs: G [nt, m, H, 16, 16] = (I + B_a A_kk[a, a])^{-1} B_a (any strides); rhs
    [nt, m, H, 16, V + K]; off_rows[a]: row tile a of [A_qk; A_kk] left of its diagonal block,
    [m, H, 32, 16 a] (a >= 1). Returns u [m, H, C, V] and w [m, H, C, K]. One baddbmm per (a, c < a) block,
    the first into a new tensor and the rest in place (rhs itself is never written: autograd saves its
    tiles), and no growing concatenation of the solved tiles.
    """
    nt, m, H = G.shape[:3]
    X = []
    for a in range(nt):
        acc = rhs[a].flatten(0, 1)  # [m*H, 16, V + K]
        for c in range(a):
            block = off_rows[a][:, :, TILE:, c * TILE : (c + 1) * TILE].flatten(0, 1)
            if c == 0:
                acc = torch.baddbmm(acc, block, X[c], alpha=-1.0)
            else:
                acc.baddbmm_(block, X[c], alpha=-1.0)
        X.append(torch.bmm(G[a].flatten(0, 1), acc))
    return torch.cat(X, -2).unflatten(0, (m, H)).split([rhs.shape[-1] - K, K], -1)


def _wy_intra_chunk_fused(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`_wy_intra_chunk` with its elementwise work in the fused CPU kernels (model/kda_cpu.cpp); fp32, no
    autograd. Same math and same returns; here the inputs are the block's tokens in token layout:
    q, k, g [m, C, H, K], v [m, C, H, V], beta [m, C, H] (contiguous fp32).
    """
    m, C, H, K = q.shape
    nt = C // TILE
    rows, k_inv, cols, rhs, q_e, k_dec, d_end = kernels.tile_factors(q, k, v, g)
    diag = rows @ k_inv.transpose(-1, -2)  # [m, H, nt, 32, 16], masked in place by tile_inverse
    G = kernels.tile_inverse(diag, beta)
    off_rows = [None] + [  # row tile a, columns of the tiles b < a: rows 8 a (a - 1) .. 8 a (a + 1) of cols
        rows[:, :, a] @ cols[:, :, 8 * a * (a - 1) : 8 * a * (a + 1)].transpose(-1, -2) for a in range(1, nt)
    ]
    u, w = _forward_substitution(G, rhs, off_rows, K)
    return diag, off_rows, u, w, q_e, k_dec.transpose(-1, -2), d_end


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None,
) -> list[int]:
    """Check the `chunk_kda` contract (shapes, chunk size, packing); return the N sequence lengths.
    Every backend (this file, model/kda_fla.py) checks its inputs with it, so the errors are the same."""
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "chunk_kda expects q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}"
        )
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if not (isinstance(chunk_size, int) and chunk_size > 0 and chunk_size % TILE == 0):
        raise ValueError(f"chunk_size must be a positive multiple of {TILE} (default 64), got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        lens = [T] * B
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T, so B must be 1; got B={B}")
        lens = seq_lens_from_cu(cu_seqlens, T)
    N = len(lens)
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N={N}, H={H}, K={K}, V={V}] (one per sequence), got "
            f"{tuple(initial_state.shape)}"
        )
    return lens


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
    """Chunkwise-parallel KDA (WY/UT form (3)); equals `naive_recurrent_kda`.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0, >= -5 per token from
    `kda_gate`); beta: [B, T, H]. q is used as given (no scaling).
    Without cu_seqlens: B sequences of length T, initial_state [B, H, K, V] or None, final state
    [B, H, K, V]. With cu_seqlens (int [N+1], B must be 1): N packed sequences of any lengths; the
    state resets at every boundary, initial_state and final state are [N, H, K, V].
    chunk_size: 16, 32 or 64 (any multiple of the 16-token tile works; 64 is the default).
    check_decay_bound: raise if a 16-token tile sums to g < -80 (the dense diagonal tiles would
    overflow) or g > 0; costs one device sync.
    Returns o [B, T, H, V] (v's dtype), final state fp32. Differentiable by autograd.
    """
    lens = check_inputs(q, k, v, g, beta, initial_state, chunk_size, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, C = len(lens), chunk_size
    lay = _chunk_layout(lens, C, q.device)
    M = len(lay.src) // C

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B*T (+1 zero padding row), H, ...]
        x = x.reshape(B * T, *x.shape[2:])
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]) if lay.padded else x

    tokens = [flat(t) for t in (q, k, v, g, beta)]
    S = q.new_zeros(N, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    S = S[lay.order].flatten(0, 1)  # [N*H, K, V]
    # Chunk steps are processed in blocks so that, on CPU, a block's intermediates stay in cache; on an
    # accelerator one block holds every chunk. Within a block all chunks are vectorised; the recurrence
    # S_0 -> S_C is the only loop over chunk steps (two batched matmul-adds per step).
    max_c, nt = len(lay.active), C // TILE
    per_block = max_c if q.device.type != "cpu" else max(1, _CPU_BLOCK_ELEMS // (N * H * C * max(K, V)))
    fused = _fused_kernels(q, k, v, g, beta, initial_state)
    # bound check: one pass over g; the exact 16-token tile sums are only needed if a token is below -5
    check_tiles = check_decay_bound and M > 0 and _tokens_outside_bound(g)
    outs = []
    for j0 in range(0, max_c, per_block):
        j1 = min(j0 + per_block, max_c)
        c0 = lay.offsets[j0]
        c1 = lay.offsets[j1] if j1 < max_c else M
        slots = slice(c0 * C, c1 * C)
        qb, kb, vb, gb, bb = (  # [m, nt, 16, H, ...]: this block's chunks, zero padded
            (t[slots] if lay.identity else t[lay.src[slots]]).unflatten(0, (c1 - c0, nt, TILE))
            for t in tokens
        )
        if check_tiles:
            _check_tiles(gb)
        if fused is not None:  # token layout [m, C, H, ...]
            diag, off_rows, *rest = _wy_intra_chunk_fused(
                fused, *(x.flatten(1, 2).contiguous() for x in (qb, kb, vb, gb, bb))
            )
        else:
            tiles = [x.permute(0, 3, 1, 2, 4) for x in (qb, kb, vb)] + [gb]  # [m, H, nt, 16, ...] views
            diag, off_rows, *rest = _wy_intra_chunk(*tiles, bb.permute(0, 3, 1, 2))
        u, w, q_e, k_decT, d_end = (x.flatten(0, 1) for x in rest)  # [m*H, ...]
        sizes = [n * H for n in lay.active[j0:j1]]  # chunk step j of the block = the next n_j * H rows
        if fused is not None:
            S_starts, U, S = fused.state_recurrence(u, w, k_decT, d_end, S, sizes)
        else:
            starts, Us = [], []
            for n_act, u_j, w_j, kd_j, d_j in zip(
                lay.active[j0:j1], *(x.split(sizes) for x in (u, w, k_decT, d_end))
            ):
                S0 = S[: n_act * H]
                U = torch.baddbmm(u_j, w_j, S0, alpha=-1.0)  # U = u - w S_0  [n*H, C, V]
                S_new = torch.baddbmm(d_j * S0, kd_j, U)  # S_C = Diag(e^Gam_C) S_0 + (K e^{Gam_C - Gam})^T U
                starts.append(S0)
                Us.append(U)
                S = S_new if n_act == N else torch.cat([S_new, S[n_act * H :]])
            S_starts, U = torch.cat(starts), torch.cat(Us)  # [m*H, K, V], [m*H, C, V]
        # O = (Q e^Gam) S_0 + A_qk U: the diagonal blocks of A_qk for all tiles in one batched matmul, then
        # the off-diagonal part of each row tile
        o = torch.bmm(q_e, S_starts)  # [m*H, C, V]
        o.view(-1, TILE, V).baddbmm_(diag[..., :TILE, :].reshape(-1, TILE, TILE), U.view(-1, TILE, V))
        for a in range(1, nt):
            o[:, a * TILE : (a + 1) * TILE] += off_rows[a][:, :, :TILE].flatten(0, 1) @ U[:, : a * TILE]
        o = o.unflatten(0, (c1 - c0, H))  # [m, H, C, V]
        outs.append(o.transpose(1, 2))  # [m, C, H, V]
    final = S.unflatten(0, (N, H))[torch.argsort(lay.order)]
    if not M:
        return v.new_zeros(B, T, H, V), final
    o = torch.cat(outs).reshape(M * C, H, V)
    if not lay.identity:
        o = o[lay.dst]  # back to token order
    return o.reshape(B, T, H, V).to(v.dtype), final


def _fused_kernels(*tensors: torch.Tensor | None) -> Any:
    """The fused CPU kernels (model/kda_cpu.py) if they apply: every tensor fp32 on CPU and no autograd
    graph to build. Otherwise None, and chunk_kda runs the torch reference `_wy_intra_chunk`."""
    ts = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in ts):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None
    return kda_cpu.load()


def _tokens_outside_bound(g: torch.Tensor) -> bool:
    """One pass over the log-decay g: raise if some g > 0; True if some token is below -80 / 16 = -5,
    in which case `_check_tiles` must check the 16-token sums exactly (kda_gate never produces that)."""
    lo, hi = (float(x) for x in torch.aminmax(g.detach()))
    if hi > 0:
        _raise_decay_bound(None, hi)
    return lo < -MAX_TILE_LOG_DECAY / TILE


def _check_tiles(g: torch.Tensor) -> None:
    """Raise unless every 16-token tile of the log-decay g [m, nt, 16, H, K] sums to >= -80."""
    lo = float(g.float().sum(2).min())
    if lo < -MAX_TILE_LOG_DECAY - 1e-3:
        _raise_decay_bound(lo, None)


def _raise_decay_bound(min_tile_sum: float | None, max_g: float | None) -> None:
    got = f"min tile sum {min_tile_sum:.1f}" if min_tile_sum is not None else f"max g {max_g:.3g} > 0"
    raise ValueError(
        f"chunk_kda: g must be a log-decay in [-5, 0] per token (16-token tile sum >= "
        f"-{MAX_TILE_LOG_DECAY:.0f}); got {got}. The dense diagonal tiles would overflow. Produce g with "
        "kda_gate(), or pass check_decay_bound=False to run anyway."
    )
