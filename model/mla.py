"""Gated Multi-head Latent Attention, NoPE (DESIGN.md, "Gated MLA, NoPE").

x [T, D] packed (cu_seqlens [N+1]), H heads of width Dh, latent width R (kv_lora_rank):

    q   = W_uq RMSNorm(W_dq x)   (or W_q x when q_lora_rank = 0)        [T, H, Dh]
    c   = RMSNorm(W_dkv x)                                               [T, R]   <- the only thing cached
    k   = W_uk c,  v = W_uv c                                            [T, H, Dh]
    o   = softmax(q k^T / sqrt(Dh) + causal mask within each sequence) v [T, H, Dh]
    y   = W_o [ sigmoid(W_g x) * o ]                                     per-channel output gate, [T, D]

No positional encoding at all (NoPE): order comes from the causal mask and the KDA layers.

Two equal ways to compute o (tests/test_mla.py checks they agree):
- naive: decompress k, v from the latent, then standard multi-head attention (used for training/prefill);
- absorbed: fold W_uk into the query and W_uv into the output, i.e. MQA with one shared K = V = c head:
      q~_h = W_uk,h^T q_h  [R],   o~_h = softmax(q~_h . c_j / sqrt(Dh)) c_j  [R],   o_h = W_uv,h o~_h
  which never materialises per-head K/V (used when attending to a cached latent, i.e. decoding).

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
