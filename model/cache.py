"""`OdysseyCache`: the incremental-decoding state of `OdysseyForCausalLM` for N sequences (rows).

Per layer (``layer_types[l]``):
- "kda": a `KDALayerState` (recurrent S [N, H, K, V] fp32 + short-conv state [N, 3HK, conv_size-1]).
  Its size is constant in the sequence length.
- "mla": an `MLALatentCache`: the N rows' compressed latents c [L_n, R] (R = mla_kv_lora_rank) in one
  padded buffer; `cache.layers[l][n]` is row n's latents [L_n, R]. Nothing else of MLA is cached: K and V
  are re-derived from c (or never materialised, absorbed decoding). A decode step appends in place
  (copy-on-write, so an older cache stays valid), amortised O(1) per token.

AttnRes and the FFNs are per token and need no cache. Row n of the cache is sequence n of the packed
input (cu_seqlens order); a forward appends each sequence's new tokens to its row and returns a NEW
cache (the input cache is never modified, so one cache can be branched with `select`).

`cache_bytes` is the analytic size used by bench/model.py; tests check it against `nbytes()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import OdysseyConfig
from model.kda import KDALayerState
from model.mla import MLALatentCache

LayerCache = KDALayerState | MLALatentCache


@dataclass
class OdysseyCache:
    """layers[l]: KDALayerState (kda) or MLALatentCache of N rows (mla); seq_lens: int64 [N] tokens held."""

    layer_types: list[str]
    layers: list[LayerCache]
    seq_lens: torch.Tensor

    @classmethod
    def empty(cls, config: OdysseyConfig, n: int, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> OdysseyCache:
        """A cache of n fresh sequences. dtype: of the conv states and latents (KDA S is always fp32)."""
        if n < 0:
            raise ValueError(f"cache size must be >= 0 sequences, got {n}")
        layers: list[LayerCache] = []
        for t in config.layer_types:
            if t == "kda":
                layers.append(KDALayerState.zeros(config, n, device=device, dtype=dtype))
            else:
                layers.append(MLALatentCache.empty(n, config.mla_kv_lora_rank, device=device, dtype=dtype))
        return cls(list(config.layer_types), layers, torch.zeros(n, dtype=torch.long))

    @property
    def n(self) -> int:
        return int(self.seq_lens.shape[0])

    def __len__(self) -> int:
        return self.n

    def select(self, indices: torch.Tensor | list[int]) -> OdysseyCache:
        """Rows `indices`, in that order (drop finished sequences, reorder, or duplicate to branch)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        if idx.numel() and (int(idx.min()) < -self.n or int(idx.max()) >= self.n):
            raise IndexError(f"cache select: indices {idx.tolist()} out of range for {self.n} rows")
        layers: list[LayerCache] = [layer.select(idx) for layer in self.layers]
        return OdysseyCache(list(self.layer_types), layers, self.seq_lens[idx].clone())

    @staticmethod
    def concat(caches: list[OdysseyCache]) -> OdysseyCache:
        """Rows of all caches, in order (add new sequences to a running batch)."""
        if not caches:
            raise ValueError("OdysseyCache.concat needs at least one cache")
        types = caches[0].layer_types
        if any(c.layer_types != types for c in caches):
            raise ValueError("OdysseyCache.concat: caches come from models with different layer_types")
        layers: list[LayerCache] = []
        for l, t in enumerate(types):
            parts = [c.layers[l] for c in caches]
            layers.append(KDALayerState.concat(parts) if t == "kda" else MLALatentCache.concat(parts))
        return OdysseyCache(list(types), layers, torch.cat([c.seq_lens for c in caches]))

    def advanced(self, layers: list[LayerCache], new_tokens: list[int]) -> OdysseyCache:
        """The cache after a forward that appended new_tokens[n] tokens to row n."""
        return OdysseyCache(list(self.layer_types), layers,
                            self.seq_lens + torch.tensor(new_tokens, dtype=torch.long))

    def nbytes(self) -> int:
        """Bytes of the cached state: KDA states plus each row's latents (an MLA buffer may hold spare
        capacity on top, see `MLALatentCache.allocated_nbytes`)."""
        return sum(layer.nbytes() for layer in self.layers)


def cache_bytes(config: OdysseyConfig, n_tokens: int, latent_bytes: int = 2, conv_bytes: int = 2,
                state_bytes: int = 4) -> dict[str, int]:
    """Analytic decode-cache size of ONE sequence holding n_tokens.

    kda: per layer H*K*V*state_bytes (recurrent S, fp32) + 3HK*(conv_size-1)*conv_bytes, independent of
    n_tokens;
    mla: per layer n_tokens * R * latent_bytes. Returns {"kda", "mla", "total"} in bytes.
    """
    H, K = config.kda_num_heads, config.kda_head_dim
    n_kda, n_mla = len(config.kda_layer_indices), len(config.mla_layer_indices)
    kda = n_kda * (H * K * K * state_bytes + 3 * H * K * (config.kda_conv_size - 1) * conv_bytes)
    mla = n_mla * n_tokens * config.mla_kv_lora_rank * latent_bytes
    return {"kda": kda, "mla": mla, "total": kda + mla}


def gqa_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, n_tokens: int,
                    elem_bytes: int = 2) -> int:
    """Standard (GQA) KV cache of one sequence: each layer stores K and V [n_tokens, kv_heads, head_dim]."""
    return num_layers * 2 * num_kv_heads * head_dim * n_tokens * elem_bytes
