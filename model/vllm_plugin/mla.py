"""Gated MLA (NoPE) for vLLM: MQA over the compressed latent through vLLM's paged `Attention`.

The absorbed form of `model.mla.GatedMLA` (its docstring has the algebra):

    q~ = W_uk^T q            [T, H, R]    one query per head, in the latent space (R = kv_lora_rank)
    c  = RMSNorm(W_dkv x)    [T, R]       the latent: the only thing written to the cache
    o~ = Attention(q~, K=c, V=c)          vLLM paged attention, 1 KV head of size R, scale Dh^-1/2,
                                           causal within each request, reads the request's cached latents
    y  = W_o [sigmoid(W_g x) * W_uv o~]

vLLM's paged KV cache has a K plane and a V plane, so the latent is stored twice (2R numbers per token and
layer, against 2 H Dh for decompressed K/V). Head size R: 64 (tiny), 128 (small), 512 (k3), all sizes the
CPU attention backend supports (it needs >= 32). NoPE: `positions` are not used.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention

from model.mla import GatedMLA


def mla_attention_name(layer_idx: int) -> str:
    """vLLM's name of the paged attention of MLA layer `layer_idx` (its KV cache key)."""
    return f"model.layers.{layer_idx}.mixer.attn"


class VllmGatedMLA(GatedMLA):
    """`GatedMLA` whose attention runs in vLLM. forward(x [T, D], cu_seqlens) -> (y [T, D], None)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=self.kv_lora_rank,
            scale=self.scale,  # Dh^-1/2 of the decompressed heads, unchanged by absorption
            num_kv_heads=1,
            cache_config=get_current_vllm_config().cache_config,
            prefix=mla_attention_name(layer_idx),
        )

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                past: list[torch.Tensor] | None = None,
                absorb: bool | None = None) -> tuple[torch.Tensor, None]:
        if past is not None or absorb is False:
            raise ValueError("VllmGatedMLA attends through vLLM's cache (absorbed form only); no past/absorb")
        T = x.shape[0]
        q_lat = self.absorb_query(self.project_q(x))  # [T, H, R]
        c = self.compress_kv(x)  # [T, R]
        o_lat = self.attn(q_lat.reshape(T, -1).contiguous(), c, c)  # [T, H*R]
        o = self.expand_output(o_lat.view(T, self.num_heads, self.kv_lora_rank))
        return self.gated_output(x, o.reshape(T, -1)), None
