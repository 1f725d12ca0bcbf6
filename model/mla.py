"""Gated Multi-head Latent Attention, NoPE (DESIGN.md, "Gated MLA, NoPE").

x [T, D] packed (cu_seqlens [N+1]), H heads of width Dh, latent width R (kv_lora_rank):

    q   = W_uq RMSNorm(W_dq x)   (or W_q x when q_lora_rank = 0)        [T, H, Dh]
    c   = RMSNorm(W_dkv x)                                               [T, R]   <- the only thing cached
    k   = W_uk c,  v = W_uv c                                            [T, H, Dh]
    o   = softmax(q k^T / sqrt(Dh) + causal mask within each sequence) v [T, H, Dh]
    y   = W_o [ sigmoid(W_g x) * o ]                                     per-channel output gate, [T, D]

No positional encoding at all (NoPE): order comes from the causal mask and the KDA layers.

Equal ways to compute o (tests/test_mla.py checks the first two agree):
- naive: decompress k, v from the latent, then standard multi-head attention (used for training/prefill);
- absorbed: fold W_uk into the query and W_uv into the output, i.e. MQA with one shared K = V = c head:
      q~_h = W_uk,h^T q_h  [R],   o~_h = softmax(q~_h . c_j / sqrt(Dh)) c_j  [R],   o_h = W_uv,h o~_h
  which never materialises per-head K/V (used when attending to a cached latent, i.e. decoding);
- blocked: the naive form over `PREFIX_BLOCK` latent rows at a time, merged by the online softmax, the
  backward recomputing one block at a time (`blocked_latent_attention`, context parallelism's attention over
  the earlier shards' latents; oracle the naive form: tests/test_mla_blocked_prefix.py).

Kernels: every attention call is a 4-D `scaled_dot_product_attention` [B, H, t, d], which on CPU takes the
flash kernel forward and backward (3-D inputs fall back to the math kernel, which builds the [t, L] score
matrix: 8x slower at 4K). Without a cache, consecutive sequences of equal length run as one batch with
`is_causal` (flash never builds a score matrix). With a cached prefix the causal mask is explicit and the
queries go in chunks whose [H, C, L] mask stays under `_SCORE_BUDGET` elements; with gradients (sequence
chunking, context parallelism) through `_ChunkedPrefixAttention`, whose backward recomputes one chunk at a
time, so the masks of all chunks (t * L elements) are never alive together. On CPU a prefix needs no mask
at all: `_FlashPrefixAttention` runs the prefix (all visible) and the new block (causal, aligned) as two
flash calls and merges them by log-sum-exp (~3x faster than the masked chunks forward and backward at
2K queries over 10K keys, measured once). A decode step (one new
token per sequence, absorbed) is ONE masked call over the padded latent buffer of `MLALatentCache`.

Cache: `MLALatentCache`, the N sequences' latents in one padded buffer [N, capacity, R] that a decode step
appends to in place (amortised O(1) per token instead of re-concatenating the whole row); indexing it gives
row n's latents [L_n, R], as the list of latents it replaces did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model import fused_cpu
from model.config import OdysseyConfig
from model.fused_weights import ConcatWeight, small_linear
from model.norm import RMSNorm
from model.short_conv import seq_lens_from_cu

_SCORE_BUDGET = 1 << 25  # max elements of one chunk's [H, C, L] attention mask (with a cached prefix)


def _prefix_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, s: int, scale: float
                  ) -> torch.Tensor:
    """Queries s.. of a chunk q [1, H, C, dk] at absolute positions prefix + s + i over keys k, v
    [1, H, prefix + s + C, d] (lower-right causal mask) -> [1, H, C, dv]."""
    C, kv_len = q.shape[2], k.shape[2]
    qpos = prefix + s + torch.arange(C, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]  # [C, kv_len], True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _ChunkedPrefixAttention(torch.autograd.Function):
    """`causal_attention` with a prefix, query chunk by query chunk, with a backward that recomputes each
    chunk. Autograd through the chunked forward would keep every chunk's [C, kv_len] mask (and what SDPA
    saves with it) until the backward, t * L elements in all; this keeps q, k, v and the output only, so the
    memory of the backward is one chunk's, whatever t. Same math (the backward is each chunk's autograd)."""

    @staticmethod
    def forward(ctx, qh, kh, vh, prefix: int, scale: float, chunk: int):
        ctx.save_for_backward(qh, kh, vh)
        ctx.prefix, ctx.scale, ctx.chunk = prefix, scale, chunk
        t = qh.shape[2]
        return torch.cat([_prefix_chunk(qh[:, :, s:min(t, s + chunk)], kh[:, :, :prefix + min(t, s + chunk)],
                                        vh[:, :, :prefix + min(t, s + chunk)], prefix, s, scale)
                          for s in range(0, t, chunk)], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qh, kh, vh = ctx.saved_tensors
        prefix, chunk, t = ctx.prefix, ctx.chunk, qh.shape[2]
        dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            with torch.enable_grad():
                q_c = qh[:, :, s:e].detach().requires_grad_()
                k_c = kh[:, :, :prefix + e].detach().requires_grad_()
                v_c = vh[:, :, :prefix + e].detach().requires_grad_()
                o = _prefix_chunk(q_c, k_c, v_c, prefix, s, ctx.scale)
                gq, gk, gv = torch.autograd.grad(o, (q_c, k_c, v_c), grad[:, :, s:e])
            dq[:, :, s:e] = gq
            dk[:, :, :prefix + e] += gk
            dv[:, :, :prefix + e] += gv
        return dq, dk, dv, None, None, None


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _FlashPrefixAttention(torch.autograd.Function):
    """`causal_attention` with a prefix on CPU as two flash calls, no mask: queries q [1, H, t, dk] at
    positions P.. over the prefix keys [0, P) (all visible) and over their own block [P, P + t) (causal, and
    aligned, so flash's `is_causal`), merged by their log-sum-exps:

        lse = logaddexp(lse_p, lse_o),   o = e^(lse_p - lse) o_p + e^(lse_o - lse) o_o.

    Backward: flash's backward of each part, given the MERGED output and lse. It recomputes
    P_ij = exp(s_ij - lse_i) and D_i = dO_i . o_i from them, which are the merged softmax restricted to the
    part's keys and the merged D, so the two parts' dK, dV are exact and their dQ add up. Memory: q, k, v,
    the output and lse; no [t, L] tensor. Oracle: the masked softmax (tests/test_mla.py)."""

    @staticmethod
    def forward(ctx, qh, kh, vh, prefix: int, scale: float):
        o_p, lse_p = _FLASH_CPU(qh, kh[:, :, :prefix], vh[:, :, :prefix], 0.0, False, scale=scale)
        o_o, lse_o = _FLASH_CPU(qh, kh[:, :, prefix:], vh[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_o)  # [1, H, t] fp32
        o = (torch.exp(lse_p - lse)[..., None] * o_p + torch.exp(lse_o - lse)[..., None] * o_o).to(qh.dtype)
        ctx.save_for_backward(qh, kh, vh, o, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return o

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qh, kh, vh, o, lse = ctx.saved_tensors
        P, scale, grad = ctx.prefix, ctx.scale, grad.contiguous()
        dq_p, dk_p, dv_p = _FLASH_CPU_BACKWARD(grad, qh, kh[:, :, :P], vh[:, :, :P], o, lse, 0.0, False,
                                               scale=scale)
        dq_o, dk_o, dv_o = _FLASH_CPU_BACKWARD(grad, qh, kh[:, :, P:], vh[:, :, P:], o, lse, 0.0, True,
                                               scale=scale)
        return dq_p + dq_o, torch.cat([dk_p, dk_o], 2), torch.cat([dv_p, dv_o], 2), None, None


def _use_flash_prefix(*tensors: torch.Tensor) -> bool:
    """The CPU flash path applies: the aten ops exist, tensors on CPU in a float type it takes, one head
    width for q, k and v (as in both of GatedMLA's forms)."""
    return (_FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None and _FLASH_ENABLED
            and len({t.shape[-1] for t in tensors}) == 1
            and all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float64)
                    for t in tensors))


_FLASH_ENABLED = True  # tests turn it off to check the masked path against the same reference


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float,
                     score_budget: int = _SCORE_BUDGET) -> torch.Tensor:
    """Causal attention of t new queries over prefix + t keys of ONE sequence.

    q [t, H, dk], k [L, Hk, dk], v [L, Hk, dv] with L = prefix + t and Hk in {1, H} (1 = MQA).
    Query i (absolute position prefix + i) attends keys 0 .. prefix + i.  Returns [t, H, dv].
    With a prefix: on CPU two flash calls merged by log-sum-exp (`_FlashPrefixAttention`); elsewhere the
    queries go in chunks of C (C * L <= score_budget / H) under an explicit mask, with gradients through
    `_ChunkedPrefixAttention` (the backward recomputes one chunk at a time).
    """
    t, H, _ = q.shape
    L = k.shape[0]
    if L != prefix + t:
        raise ValueError(f"causal_attention: keys ({L}) must be prefix ({prefix}) + queries ({t})")
    if t == 0:
        return q.new_zeros(0, H, v.shape[-1])
    qh = q.transpose(0, 1)[None]  # [1, H, t, dk]: 4-D, so that SDPA takes the flash kernel
    kh = k.transpose(0, 1)[None].expand(1, H, L, k.shape[-1])  # a view when Hk = 1
    vh = v.transpose(0, 1)[None].expand(1, H, L, v.shape[-1])
    if prefix == 0:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)
    if _use_flash_prefix(q, k, v):
        return _FlashPrefixAttention.apply(qh, kh, vh, prefix, scale)[0].transpose(0, 1)
    chunk = max(1, min(t, score_budget // max(1, H * L)))
    return _ChunkedPrefixAttention.apply(qh, kh, vh, prefix, scale, chunk)[0].transpose(0, 1)


PREFIX_BLOCK = 4096  # latent rows decompressed at a time by `blocked_latent_attention`


def _block_scores(q: torch.Tensor, k: torch.Tensor, qs: int, ks: int, prefix: int, scale: float
                  ) -> torch.Tensor:
    """Scores of queries qs.. (q [C, H, dk], absolute positions prefix + qs + i) over keys ks.. (k [B, H, dk])
    -> [H, C, B] fp32, -inf where the key is in the query's future (key ks + j > prefix + qs + i)."""
    s = torch.einsum("chd,bhd->hcb", q.float(), k.float()) * scale
    C, B = q.shape[0], k.shape[0]
    if ks + B - 1 > prefix + qs:  # some key of the block is after some query of the chunk
        kpos = ks + torch.arange(B, device=q.device)
        qpos = prefix + qs + torch.arange(C, device=q.device)
        future = kpos[None, :] > qpos[:, None]  # [C, B]
        s = s.masked_fill(future, float("-inf"))
    return s


def _block_segments(ks: int, ke: int, prefix: int, t: int, flash: bool) -> list[tuple[int, int, str]]:
    """How query rows [lo, hi) meet key block [ks, ke) (query i sees key j iff j <= prefix + i; rows before
    the first returned see none of the block): "tiles" (fp32 masked tiles), or, with the CPU flash kernel,
    "full" (every row sees the whole block: no mask) and "causal" (a block of the queries' own keys,
    ks - prefix = lo: row lo + i sees keys ks .. ks + i, flash's aligned is_causal)."""
    p0, f = min(max(ks - prefix, 0), t), min(max(ke - 1 - prefix, 0), t)  # [p0, f): the diagonal
    if not flash:
        return [(p0, t, "tiles")]
    if ks >= prefix:  # then p0 = ks - prefix and ke <= prefix + t
        segs = [(p0, ke - prefix, "causal")]
        return segs + [(ke - prefix, t, "full")] if ke - prefix < t else segs
    segs = [(p0, f, "tiles")] if p0 < f else []
    return segs + [(f, t, "full")] if f < t else segs


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, H, d] -> [1, H, n, d], the layout of the CPU flash kernels."""
    return x.transpose(0, 1)[None]


def _tiles_forward(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, lo: int, hi: int, ks: int,
                   prefix: int, scale: float, chunk: int, m: torch.Tensor, den: torch.Tensor,
                   acc: torch.Tensor) -> None:
    """Merge key block kb, vb [B, H, d] (keys ks..) into the accumulators of query rows [lo, hi) in fp32
    masked tiles of `chunk` rows (online softmax; m, den [t, H], acc [t, H, dv], updated in place)."""
    for qs in range(lo, hi, chunk):
        qe = min(hi, qs + chunk)
        s = _block_scores(q[qs:qe], kb, qs, ks, prefix, scale)  # [H, C, B]
        m_old = m[qs:qe].T  # [H, C]
        m_new = torch.maximum(m_old, s.amax(-1))  # finite: key 0 is visible to every query, block 0 first
        p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(m_old - m_new)
        den[qs:qe] = (den[qs:qe].T * alpha + p.sum(-1)).T
        acc[qs:qe] = (acc[qs:qe].permute(1, 0, 2) * alpha[..., None]
                      + torch.einsum("hcb,bhd->hcd", p, vb.float())).permute(1, 0, 2)
        m[qs:qe] = m_new.T


def _tiles_backward(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, lo: int, hi: int, ks: int,
                    prefix: int, scale: float, chunk: int, g: torch.Tensor, lse: torch.Tensor,
                    D: torch.Tensor, dq: torch.Tensor, dkb: torch.Tensor, dvb: torch.Tensor) -> None:
    """The flash backward of query rows [lo, hi) over key block kf, vf [B, H, d] (fp32) in masked tiles:
    adds to dq [t, H, dk] and the block's dkb, dvb (fp32, in place). g: dO [t, H, dv] fp32, lse, D [t, H]."""
    for qs in range(lo, hi, chunk):
        qe = min(hi, qs + chunk)
        p = torch.exp(_block_scores(q[qs:qe], kf, qs, ks, prefix, scale) - lse[qs:qe].T[..., None])
        gc = g[qs:qe]  # [C, H, dv]
        dvb += torch.einsum("hcb,chd->bhd", p, gc)
        ds = p * (torch.einsum("chd,bhd->hcb", gc, vf) - D[qs:qe].T[..., None])
        dq[qs:qe] += scale * torch.einsum("hcb,bhd->chd", ds, kf)
        dkb += scale * torch.einsum("hcb,chd->bhd", ds, q[qs:qe].float())


class _BlockedLatentAttention(torch.autograd.Function):
    """`blocked_latent_attention` with autograd: the forward keeps per-query accumulators only; the backward
    recomputes each block's K, V from its latent rows and each (query chunk, block) score tile from the saved
    output o and log-sum-exp (flash attention's backward):

        P = exp(s - lse),  D_i = dO_i . o_i,  dS = P * (dO V^T - D),  dQ += scale dS K,  dK = scale dS^T Q,
        dV = P^T dO,   dc_b = dK_b W_uk + dV_b W_uv,   dW_uk += dK_b^T c_b,   dW_uv += dV_b^T c_b.

    On CPU the query rows that see a whole block, and a block of the queries' own keys (aligned causal), run
    as one flash call each (`_block_segments`; (o_b, lse_b) merged into the accumulators; backward: flash's
    backward given the MERGED o and lse, exact as in `_FlashPrefixAttention`); the rest, and every row off
    CPU, as fp32 masked tiles [H, C, B]. Saved: q, c, the two decompression weights, o, lse; no decompressed
    K or V."""

    @staticmethod
    def forward(ctx, q, c, w_uk, w_uv, prefix: int, scale: float, block: int, chunk: int):
        t, H, dk = q.shape
        dv = w_uv.shape[0] // H
        acc = q.new_zeros(t, H, dv, dtype=torch.float32)
        m = q.new_full((t, H), float("-inf"), dtype=torch.float32)
        den = q.new_zeros(t, H, dtype=torch.float32)
        for ks in range(0, c.shape[0], block):
            cb = c[ks:ks + block]
            kb, vb = (cb @ w_uk.T).view(-1, H, dk), (cb @ w_uv.T).view(-1, H, dv)
            flash = _use_flash_prefix(q, kb, vb)
            for lo, hi, kind in _block_segments(ks, ks + cb.shape[0], prefix, t, flash):
                if kind == "tiles":
                    _tiles_forward(q, kb, vb, lo, hi, ks, prefix, scale, chunk, m, den, acc)
                    continue
                o_b, lse_b = _FLASH_CPU(_heads_first(q[lo:hi]), _heads_first(kb), _heads_first(vb), 0.0,
                                        kind == "causal", scale=scale)
                lse_b = lse_b[0].T.float()  # [rows, H]
                m_new = torch.maximum(m[lo:hi], lse_b)
                alpha, beta = torch.exp(m[lo:hi] - m_new), torch.exp(lse_b - m_new)
                den[lo:hi] = den[lo:hi] * alpha + beta
                acc[lo:hi] = acc[lo:hi] * alpha[..., None] + o_b[0].transpose(0, 1).float() * beta[..., None]
                m[lo:hi] = m_new
        o = (acc / den[..., None]).to(q.dtype)  # saved as returned: the gated output keeps it anyway
        lse = m + torch.log(den)
        ctx.save_for_backward(q, c, w_uk, w_uv, o, lse)
        ctx.prefix, ctx.scale, ctx.block, ctx.chunk = prefix, scale, block, chunk
        return o

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, c, w_uk, w_uv, o, lse = ctx.saved_tensors
        prefix, scale, block, chunk = ctx.prefix, ctx.scale, ctx.block, ctx.chunk
        t, H, dk = q.shape
        dv = w_uv.shape[0] // H
        grad = grad.contiguous()
        g = grad.float()
        D = (g * o.float()).sum(-1)  # [t, H]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dc = torch.zeros_like(c, dtype=torch.float32)
        dw_uk = torch.zeros_like(w_uk, dtype=torch.float32)
        dw_uv = torch.zeros_like(w_uv, dtype=torch.float32)
        for ks in range(0, c.shape[0], block):
            cb = c[ks:ks + block]
            kb, vb = (cb @ w_uk.T).view(-1, H, dk), (cb @ w_uv.T).view(-1, H, dv)
            kf, vf = kb.float(), vb.float()
            dkb, dvb = torch.zeros_like(kf), torch.zeros_like(vf)
            flash = _use_flash_prefix(q, kb, vb, grad)
            for lo, hi, kind in _block_segments(ks, ks + cb.shape[0], prefix, t, flash):
                if kind == "tiles":
                    _tiles_backward(q, kf, vf, lo, hi, ks, prefix, scale, chunk, g, lse, D, dq, dkb, dvb)
                    continue
                gq, gk, gv = _FLASH_CPU_BACKWARD(
                    _heads_first(grad[lo:hi]).contiguous(), _heads_first(q[lo:hi]), _heads_first(kb),
                    _heads_first(vb), _heads_first(o[lo:hi]), lse[lo:hi].T[None].contiguous(), 0.0,
                    kind == "causal", scale=scale)
                dq[lo:hi] += gq[0].transpose(0, 1).float()
                dkb += gk[0].transpose(0, 1).float()
                dvb += gv[0].transpose(0, 1).float()
            dkf, dvf, cf = dkb.reshape(-1, H * dk), dvb.reshape(-1, H * dv), cb.float()
            dc[ks:ks + block] = dkf @ w_uk.float() + dvf @ w_uv.float()
            dw_uk += dkf.T @ cf
            dw_uv += dvf.T @ cf
        return (dq.to(q.dtype), dc.to(c.dtype), dw_uk.to(w_uk.dtype), dw_uv.to(w_uv.dtype),
                None, None, None, None)


def blocked_latent_attention(q: torch.Tensor, c: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                             prefix: int, scale: float, block: int = PREFIX_BLOCK,
                             score_budget: int = _SCORE_BUDGET) -> torch.Tensor:
    """Causal MLA of t queries over L = prefix + t latents of ONE sequence, never decompressing more than
    `block` latent rows at a time. The same result as `GatedMLA.attend_naive` (its reference).

    q [t, H, dk], c [L, R] (the prefix's latents, then the queries' own), w_uk [H dk, R], w_uv [H dv, R]
    (k = c W_uk^T, v = c W_uv^T per row). Query i (absolute position prefix + i) attends keys 0 .. prefix + i
    with scores s_ij = scale q_i . k_j. Returns o [t, H, dv].

    Keys go in blocks b of B = `block` latent rows, each decompressed to K_b, V_b [B, H, d] on the fly;
    queries in chunks of C with H C B <= score_budget. The blocks merge by the online softmax rule (per
    query and head; m = running max, l = running sum, a = running unnormalised output):

        m' = max(m, max_j s_bj),   l' = e^(m - m') l + sum_j e^(s_bj - m'),
        a' = e^(m - m') a + sum_j e^(s_bj - m') v_j,   o = a / l,   lse = m + log l,

    which equals the log-sum-exp merge of the blocks' partial softmaxes (a flash call's (o_b, lse_b) enters
    as m_b = lse_b, l_b = 1, a_b = o_b). The accumulators are fp32. On CPU the rows that see a whole block
    and the aligned causal blocks of the queries' own keys take the flash kernel; the rest (and everything
    off CPU) fp32 masked tiles. Memory, forward and backward: q, c, the weights, o and lse [t, H] plus ONE
    block's K, V [B, H, dk + dv] and one score tile [H, C, B]; never the whole prefix's K, V
    (`_BlockedLatentAttention`).
    """
    t, H, dk = q.shape
    L = c.shape[0]
    if L != prefix + t:
        raise ValueError(f"blocked_latent_attention: latents ({L}) must be prefix ({prefix}) + queries ({t})")
    if block < 1:
        raise ValueError(f"blocked_latent_attention: block must be >= 1 latent row, got {block}")
    if w_uk.shape != (H * dk, c.shape[1]) or w_uv.shape[1] != c.shape[1] or w_uv.shape[0] % H:
        raise ValueError(f"blocked_latent_attention: weights {tuple(w_uk.shape)}, {tuple(w_uv.shape)} do not "
                         f"fit q [{t}, {H}, {dk}] and latents [{L}, {c.shape[1]}]")
    if t == 0:
        return q.new_zeros(0, H, w_uv.shape[0] // H)
    chunk = max(1, min(t, score_budget // max(1, H * min(block, L))))
    return _BlockedLatentAttention.apply(q, c, w_uk, w_uv, prefix, scale, block, chunk)


def latent_decode_attention(q_lat: torch.Tensor, latents: torch.Tensor, lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """One decode step of absorbed MLA for N sequences: MQA of each sequence's query over its own latents.

    q_lat [N, H, R] (W_uk^T q), latents [N, L, R] (row n valid up to lens[n], the new token included;
    positions >= lens[n] are ignored), lens int [N] >= 1. Returns o~ [N, H, R]:
    o~_nh = sum_{j < lens_n} softmax_j(q~_nh . c_nj * scale) c_nj.
    """
    N, H, R = q_lat.shape
    L = latents.shape[1]
    kv = latents[:, None].expand(N, H, L, R)
    mask = (torch.arange(L, device=latents.device) < lens.to(latents.device)[:, None])[:, None, None]
    o = F.scaled_dot_product_attention(q_lat[:, :, None], kv, kv, attn_mask=mask, scale=scale)
    return o[:, :, 0]


class _Tail:
    """Shared by the MLALatentCache views of one buffer: filled[n] = positions of row n written so far."""

    __slots__ = ("filled",)

    def __init__(self, filled: list[int]) -> None:
        self.filled = filled


class MLALatentCache(Sequence):
    """The MLA decode cache of N sequences: latents c in one buffer [N, capacity, R]; row n holds lens[n].

    It is a sequence of N tensors: `cache[n]` is row n's latents [L_n, R] (a view), as the list of latents
    it replaces. `appended(c, new_lens)` returns the cache with new latents added; when the buffer has room
    and no other cache built on this buffer has appended to the same rows (copy-on-write), the new latents
    are written in place, so token-by-token decoding costs O(1) per token (capacity doubles when full).
    The old cache stays valid either way: it only ever reads its own lens[n] positions.
    """

    def __init__(self, buffer: torch.Tensor, lens: list[int], tail: _Tail | None = None) -> None:
        if buffer.dim() != 3 or buffer.shape[0] != len(lens):
            raise ValueError(f"MLALatentCache: buffer must be [N={len(lens)}, capacity, R], got "
                             f"{tuple(buffer.shape)}")
        self.buffer = buffer
        self.lens = list(lens)
        self._tail = tail if tail is not None else _Tail(list(lens))
        self._lens_t: torch.Tensor | None = None

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def empty(cls, n: int, rank: int, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> MLALatentCache:
        return cls(torch.zeros(n, 0, rank, device=device, dtype=dtype), [0] * n)

    @classmethod
    def from_latents(cls, latents: Sequence[torch.Tensor]) -> MLALatentCache:
        """From a list of N latents [L_n, R] (the former cache format); copies them into one buffer."""
        if isinstance(latents, MLALatentCache):
            return latents
        if not latents:
            raise ValueError("MLALatentCache.from_latents needs at least one row (or use .empty(0, R))")
        lens = [int(c.shape[0]) for c in latents]
        R = latents[0].shape[-1]
        buf = latents[0].new_zeros(len(latents), max(lens), R)
        for n, c in enumerate(latents):
            buf[n, : lens[n]] = c
        return cls(buf, lens)

    # ---- sequence protocol ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, n):
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(len(self)))]
        return self.buffer[n, : self.lens[n]]

    @property
    def lens_tensor(self) -> torch.Tensor:
        """lens as int64 [N] on the buffer's device (built once per cache)."""
        if self._lens_t is None:
            self._lens_t = torch.tensor(self.lens, dtype=torch.long, device=self.buffer.device)
        return self._lens_t

    @property
    def rank(self) -> int:
        return int(self.buffer.shape[-1])

    def nbytes(self) -> int:
        """Bytes of the cached latents (sum of L_n x R); the buffer may hold spare capacity on top."""
        return sum(self.lens) * self.rank * self.buffer.element_size()

    def allocated_nbytes(self) -> int:
        """Bytes of the whole buffer, spare capacity included."""
        return self.buffer.numel() * self.buffer.element_size()

    # ---- row operations (always copies) ---------------------------------------------------------
    def select(self, idx: torch.Tensor | list[int]) -> MLALatentCache:
        """Rows idx, in that order (copied into a buffer of exactly their longest length)."""
        N = len(self.lens)
        rows = [r + N if r < 0 else r for r in torch.as_tensor(idx, dtype=torch.long).reshape(-1).tolist()]
        lens = [self.lens[i] for i in rows]
        width = max(lens, default=0)
        ix = torch.tensor(rows, dtype=torch.long, device=self.buffer.device)
        return MLALatentCache(self.buffer[:, :width].index_select(0, ix), lens)

    @staticmethod
    def concat(caches: list[MLALatentCache]) -> MLALatentCache:
        """Rows of all caches, in order (copied into one buffer)."""
        width = max((max(c.lens, default=0) for c in caches), default=0)
        parts = [F.pad(c.buffer[:, :width], (0, 0, 0, width - min(width, c.buffer.shape[1]))) for c in caches]
        return MLALatentCache(torch.cat(parts), [n for c in caches for n in c.lens])

    # ---- append ---------------------------------------------------------------------------------
    def appended(self, c: torch.Tensor, new: list[int]) -> MLALatentCache:
        """The cache with new[n] latents appended to row n; c [sum(new), R] packed in row order."""
        N = len(self.lens)
        if len(new) != N:
            raise ValueError(f"MLALatentCache.appended: {len(new)} row lengths for a cache of {N} rows")
        lens = [a + b for a, b in zip(self.lens, new)]
        need = max(lens, default=0)
        buf = self.buffer
        grad = torch.is_grad_enabled() and (c.requires_grad or buf.requires_grad)
        in_place = (
            not grad
            and buf.dtype == c.dtype
            and need <= buf.shape[1]
            and (torch.is_inference_mode_enabled() or not buf.is_inference())
            and all(self._tail.filled[n] == self.lens[n] for n in range(N) if new[n])
        )
        if in_place:
            tail = self._tail
        else:  # a new buffer: grow geometrically so that a token-by-token decode copies O(log L) times
            cap = need if grad or buf.shape[1] == 0 else max(need, 2 * buf.shape[1])
            width = max(self.lens, default=0)
            old = buf[:, :width].to(c.dtype)
            buf = torch.cat([old, old.new_zeros(N, cap - width, buf.shape[-1])], 1) if cap > width else old
            tail = _Tail(list(self.lens))
        if c.shape[0]:
            if all(t == 1 for t in new):
                rows = torch.arange(N, device=buf.device)
                pos = self.lens_tensor if self.buffer.device == buf.device else None
                pos = pos if pos is not None else torch.tensor(self.lens, device=buf.device)
            else:
                rows = torch.repeat_interleave(torch.arange(N, device=buf.device),
                                               torch.tensor(new, device=buf.device))
                starts = [a - s for a, s in zip(self.lens, _cumsum_excl(new))]  # row end minus offset in c
                starts = torch.tensor(starts, device=buf.device)
                pos = starts[rows] + torch.arange(c.shape[0], device=buf.device)
            if grad:
                buf = buf.index_put((rows, pos), c)
            else:
                buf.index_put_((rows, pos), c)
        for n in range(N):
            if new[n]:
                tail.filled[n] = lens[n]
        out = MLALatentCache(buf, lens, tail)
        return out


def _cumsum_excl(xs: list[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        out.append(s)
        s += x
    return out


class GatedMLA(nn.Module):
    """Gated MLA layer. forward(x [T, D], cu_seqlens [N+1], past) -> (y [T, D], present | None).

    past / present: the decode cache of this layer, an `MLALatentCache` of N rows (a list of N latents
    [L_n, R] is accepted as past too).
    """

    def __init__(self, config: OdysseyConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D = config.hidden_size
        self.num_heads, self.head_dim = config.mla_num_heads, config.mla_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.mla_kv_lora_rank, config.mla_q_lora_rank
        HD = self.num_heads * self.head_dim
        if self.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, HD, bias=False)
        else:
            self.q_proj = nn.Linear(D, HD, bias=False)
        self.kv_a_proj = nn.Linear(D, self.kv_lora_rank, bias=False)  # W_dkv
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.k_b_proj = nn.Linear(self.kv_lora_rank, HD, bias=False)  # W_uk
        self.v_b_proj = nn.Linear(self.kv_lora_rank, HD, bias=False)  # W_uv
        self.g_proj = nn.Linear(D, HD, bias=False)  # W_g, per-channel output gate
        self.o_proj = nn.Linear(HD, D, bias=False)
        self.scale = self.head_dim ** -0.5
        self._decode_in_weight = ConcatWeight()  # [W_q (or W_dq); W_dkv; W_g]: `decode_step_fused`

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> q [T, H, Dh]."""
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora_rank > 0 else self.q_proj(x)
        return q.view(x.shape[0], self.num_heads, self.head_dim)

    def compress_kv(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> c = RMSNorm(W_dkv x) [T, R]."""
        return self.kv_a_norm(self.kv_a_proj(x))

    def decompress_kv(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [L, R] -> k, v [L, H, Dh]."""
        L = c.shape[0]
        k = self.k_b_proj(c).view(L, self.num_heads, self.head_dim)
        v = self.v_b_proj(c).view(L, self.num_heads, self.head_dim)
        return k, v

    def attend_naive(self, q: torch.Tensor, c: torch.Tensor, prefix: int) -> torch.Tensor:
        """Decompress K, V from c [L, R] and run MHA. q [t, H, Dh] -> o [t, H, Dh]."""
        k, v = self.decompress_kv(c)
        return causal_attention(q, k, v, prefix, self.scale)

    def attend_blocked(self, q: torch.Tensor, c: torch.Tensor, prefix: int, block: int = PREFIX_BLOCK
                       ) -> torch.Tensor:
        """`attend_naive` decompressing at most `block` latent rows at a time (`blocked_latent_attention`):
        q [t, H, Dh], c [prefix + t, R] -> o [t, H, Dh]. Context parallelism's continuing piece."""
        return blocked_latent_attention(q, c, self.k_b_proj.weight, self.v_b_proj.weight, prefix, self.scale,
                                        block)

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """q~_h = W_uk,h^T q_h: q [t, H, Dh] -> [t, H, R] (the query of MQA over the latent)."""
        w_uk = self.k_b_proj.weight.view(self.num_heads, self.head_dim, self.kv_lora_rank)  # [H, Dh, R]
        return torch.einsum("thd,hdr->thr", q, w_uk.to(q.dtype))

    def expand_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_h = W_uv,h o~_h: the latent attention output [t, H, R] -> [t, H, Dh]."""
        w_uv = self.v_b_proj.weight.view(self.num_heads, self.head_dim, self.kv_lora_rank)
        return torch.einsum("thr,hdr->thd", o_lat, w_uv.to(o_lat.dtype))

    def attend_absorbed(self, q: torch.Tensor, c: torch.Tensor, prefix: int) -> torch.Tensor:
        """MQA over the latent: q~ = W_uk^T q, o = W_uv softmax(q~ c^T / sqrt(Dh)) c.

        q [t, H, Dh], c [L, R] -> o [t, H, Dh].
        """
        kv = c.unsqueeze(1)  # [L, 1, R]: one shared head
        o_lat = causal_attention(self.absorb_query(q), kv, kv, prefix, self.scale)  # [t, H, R]
        return self.expand_output(o_lat)

    def gated_output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """y = W_o [sigmoid(W_g x) * o]: x [T, D], o [T, H*Dh] -> [T, D]."""
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * o)

    def attend_fresh(self, q: torch.Tensor, c: torch.Tensor, lens: list[int], absorb: bool) -> torch.Tensor:
        """Causal attention of packed sequences without a cache: q [T, H, Dh], c [T, R] -> o [T, H, Dh].

        Each run of consecutive sequences of equal length is one batched SDPA call [n, H, L, d] with
        is_causal (flash kernel, no score matrix).
        """
        T, H = q.shape[:2]
        if absorb:
            q, k = self.absorb_query(q), c[:, None].expand(T, H, c.shape[-1])
            v = k
        else:
            k, v = self.decompress_kv(c)
        outs, s, i = [], 0, 0
        while i < len(lens):
            L, j = lens[i], i
            while j < len(lens) and lens[j] == L:
                j += 1
            n, e = j - i, s + (j - i) * L
            if L:
                qh, kh, vh = (t[s:e].view(n, L, H, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
                outs.append(o.transpose(1, 2).reshape(n * L, H, o.shape[-1]))
            s, i = e, j
        o = torch.cat(outs) if len(outs) > 1 else outs[0] if outs else q.new_zeros(0, H, v.shape[-1])
        return self.expand_output(o) if absorb else o

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        past: MLALatentCache | list[torch.Tensor] | None = None,
        absorb: bool | None = None,
    ) -> tuple[torch.Tensor, MLALatentCache | None]:
        """x [T, D], cu_seqlens int [N+1], past: N sequences' MLALatentCache (or latents [P_n, R]) or None.

        absorb: None = absorbed path iff there is cached context (decoding), else naive.
        Returns y [T, D] and, when `past` is given, present = past with each sequence's c appended; else None.
        """
        T = x.shape[0]
        lens = seq_lens_from_cu(cu_seqlens, T)
        N = len(lens)
        if past is not None and len(past) != N:
            raise ValueError(f"MLA layer {self.layer_idx}: cache has {len(past)} rows but cu_seqlens "
                             f"describes {N} sequences; select/concat the cache to match the batch")
        q = self.project_q(x)
        c = self.compress_kv(x)
        if past is None:
            o = self.attend_fresh(q, c, lens, bool(absorb))
            return self.gated_output(x, o.reshape(T, -1)), None
        past = MLALatentCache.from_latents(past) if not isinstance(past, MLALatentCache) else past
        if absorb is None:
            absorb = any(past.lens)
        if absorb and N and all(n == 1 for n in lens):
            fused = self.decode_step_fused(x, past)
            if fused is not None:
                return fused
        present = past.appended(c, lens)
        if absorb and N and all(n == 1 for n in lens):  # decode step: one masked call over the buffer
            width = max(present.lens)
            o_lat = latent_decode_attention(self.absorb_query(q), present.buffer[:, :width],
                                            present.lens_tensor, self.scale)
            o = self.expand_output(o_lat)
        else:
            attend = self.attend_absorbed if absorb else self.attend_naive
            outs, s = [], 0
            for n in range(N):
                e = s + lens[n]
                if e > s:
                    outs.append(attend(q[s:e], present[n], past.lens[n]))
                s = e
            o = torch.cat(outs) if outs else q.new_zeros(0, self.num_heads, self.head_dim)
        return self.gated_output(x, o.reshape(T, -1)), present

    def decode_step_fused(
        self, x: torch.Tensor, past: MLALatentCache
    ) -> tuple[torch.Tensor, MLALatentCache] | None:
        """The absorbed decode step (one token per sequence, x [N, D]): ONE matmul for the q, latent and gate
        projections, ONE fused CPU kernel for the latent norm, q~ = W_uk^T q, the softmax over the cached
        latents and the new one, W_uv o~ and the gate (model/fused_cpu.cpp `mla_decode`), the output
        projection; the same math as `forward`. None (the caller runs `forward`'s path) unless x and the
        weights are fp32 on CPU and no gradient is needed, or if there is no cached latent to attend to."""
        if not isinstance(past, MLALatentCache) or not any(past.lens):
            return None
        kernels = fused_cpu.applies(x, self.kv_a_proj.weight, past.buffer)
        if kernels is None:
            return None
        N, R = x.shape[0], self.kv_lora_rank
        q_w = self.q_a_proj.weight if self.q_lora_rank > 0 else self.q_proj.weight
        proj = x @ self._decode_in_weight(q_w, self.kv_a_proj.weight, self.g_proj.weight)
        nq = q_w.shape[0]
        q = proj[:, :nq]
        if self.q_lora_rank > 0:
            q = small_linear(self.q_a_norm(q), self.q_b_proj)
        buffer = past.buffer if past.buffer.is_contiguous() else past.buffer.contiguous()
        o, c = kernels.mla_decode(q, proj[:, nq:nq + R], proj[:, nq + R:], self.kv_a_norm.weight,
                                  self.kv_a_norm.eps, self.k_b_proj.weight, self.v_b_proj.weight, buffer,
                                  past.lens, self.num_heads, self.scale)
        return small_linear(o, self.o_proj), past.appended(c, [1] * N)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}")
