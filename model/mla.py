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

Long inputs: attention is computed in query chunks sized so one chunk's score tensor [H, C, L] stays
under `_SCORE_BUDGET` elements; a [T, T] score matrix is never built for long T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import OdysseyConfig
from model.norm import RMSNorm

_SCORE_BUDGET = 1 << 25  # max elements of one chunk's [H, C, L] attention scores (128 MiB in fp32)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float,
                     score_budget: int = _SCORE_BUDGET) -> torch.Tensor:
    """Causal attention of t new queries over prefix + t keys of ONE sequence.

    q [t, H, dk], k [L, Hk, dk], v [L, Hk, dv] with L = prefix + t and Hk in {1, H} (1 = MQA).
    Query i (absolute position prefix + i) attends keys 0 .. prefix + i.  Returns [t, H, dv].
    """
    t, H, _ = q.shape
    L = k.shape[0]
    if L != prefix + t:
        raise ValueError(f"causal_attention: keys ({L}) must be prefix ({prefix}) + queries ({t})")
    if t == 0:
        return q.new_zeros(0, H, v.shape[-1])
    qh = q.transpose(0, 1)  # [H, t, dk]
    kh = k.transpose(0, 1).expand(H, L, k.shape[-1])  # [H, L, dk] (a view when Hk = 1)
    vh = v.transpose(0, 1).expand(H, L, v.shape[-1])
    chunk = max(1, min(t, score_budget // max(1, H * L)))
    if prefix == 0 and chunk >= t:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o.transpose(0, 1)
    outs = []
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        kv_len = prefix + e
        qpos = prefix + torch.arange(s, e, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]  # [C, kv_len], True = attend
        outs.append(F.scaled_dot_product_attention(qh[:, s:e], kh[:, :kv_len], vh[:, :kv_len],
                                                   attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=1).transpose(0, 1)


class GatedMLA(nn.Module):
    """Gated MLA layer. forward(x [T, D], cu_seqlens [N+1], past) -> (y [T, D], present | None).

    past / present: the decode cache of this layer, a list of N latents [L_n, R] (one per sequence).
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

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> q [T, H, Dh]."""
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora_rank > 0 else self.q_proj(x)
        return q.view(x.shape[0], self.num_heads, self.head_dim)

    def compress_kv(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> c = RMSNorm(W_dkv x) [T, R]."""
        return self.kv_a_norm(self.kv_a_proj(x))

    def attend_naive(self, q: torch.Tensor, c: torch.Tensor, prefix: int) -> torch.Tensor:
        """Decompress K, V from c [L, R] and run MHA. q [t, H, Dh] -> o [t, H, Dh]."""
        L = c.shape[0]
        k = self.k_b_proj(c).view(L, self.num_heads, self.head_dim)
        v = self.v_b_proj(c).view(L, self.num_heads, self.head_dim)
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

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        past: list[torch.Tensor] | None = None,
        absorb: bool | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """x [T, D], cu_seqlens int [N+1], past: N latents [P_n, R] or None.

        absorb: None = absorbed path iff there is cached context (decoding), else naive.
        Returns y [T, D] and, when `past` is given, present = [cat(past_n, c_n)] (N latents); else None.
        """
        T = x.shape[0]
        cu = cu_seqlens.tolist()
        N = len(cu) - 1
        if past is not None and len(past) != N:
            raise ValueError(f"MLA layer {self.layer_idx}: cache has {len(past)} rows but cu_seqlens "
                             f"describes {N} sequences; select/concat the cache to match the batch")
        q = self.project_q(x)
        c = self.compress_kv(x)
        if absorb is None:
            absorb = past is not None and any(p.shape[0] > 0 for p in past)
        attend = self.attend_absorbed if absorb else self.attend_naive
        outs, present = [], [] if past is not None else None
        for n in range(N):
            s, e = cu[n], cu[n + 1]
            c_n = c[s:e]
            prefix = 0
            if past is not None:
                prefix = past[n].shape[0]
                c_n = torch.cat([past[n].to(c.dtype), c_n]) if prefix else c_n
                present.append(c_n)
            outs.append(attend(q[s:e], c_n, prefix))
        o = torch.cat(outs).reshape(T, self.num_heads * self.head_dim)
        return self.gated_output(x, o), present

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}")
