"""`OdysseyHFCache`: the model's decode state as a transformers `Cache`, for `generate` and HF-style callers.

It holds an `OdysseyCache` (model/cache.py: per KDA layer the recurrent state S [B, H, K, V] fp32 and the
short-conv tail [B, 3HK, conv_size-1], per MLA layer the compressed latents c [L_b, R]), row b = batch
row b, and advances it in place as transformers' caches do (`forward` replaces `state` with the advanced
one; the packed runtime's immutable `OdysseyCache` is unchanged).

Two lengths, as in transformers' hybrid models with left padding:
- `get_seq_length()`: the number of [B, T] columns fed so far, padding included. `generate` slices its
  inputs with it (the next input is input_ids[:, past:]), and attention_mask covers these columns plus
  the new ones.
- `state.seq_lens` [B]: the real tokens each row holds. Padding columns are never fed to the model
  (model/padding.py), so a left-padded row's cache holds exactly its own tokens.

Beam search and other row shuffles (`reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`)
are `OdysseyCache.select`. A recurrent state cannot be rolled back, so `crop` (assisted generation) is
refused, as for transformers' own recurrent models (`_is_stateful`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from model.cache import OdysseyCache
from model.config import OdysseyConfig


class OdysseyHFCache(Cache):
    """transformers `Cache` over an `OdysseyCache`; state is None until the first forward (batch size)."""

    is_compileable = False

    def __init__(self, config: OdysseyConfig, state: OdysseyCache | None = None,
                 seen_columns: int = 0) -> None:
        # the per-layer tensors live in `state` (one OdysseyCache for all layers), not in Cache.layers
        super().__init__(layers=[])
        self.config = config
        self.state = state
        self.seen_columns = seen_columns

    def __repr__(self) -> str:
        rows = None if self.state is None else self.state.seq_lens.tolist()
        return f"OdysseyHFCache(columns={self.seen_columns}, tokens per row={rows})"

    def __len__(self) -> int:
        return self.config.num_hidden_layers

    def ensure_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> OdysseyCache:
        """The OdysseyCache for a forward of batch_size rows (an empty one on first use)."""
        if self.state is None:
            self.state = OdysseyCache.empty(self.config, batch_size, device=device, dtype=dtype)
        if self.state.n != batch_size:
            raise ValueError(f"the cache holds {self.state.n} rows but the input has {batch_size}; row b of "
                             "the cache is batch row b (reorder it with cache.batch_select_indices)")
        return self.state

    # ---- what generate and the Cache API read ----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the padded [B, T] layout fed so far (padding included), as transformers counts."""
        return self.seen_columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows without bound (KDA is constant-size, MLA latents grow)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_columns + query_length, 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.state is not None and self.seen_columns > 0

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.n

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [t == "kda" for t in self.config.layer_types]

    # ---- row operations --------------------------------------------------------------------------
    def _select(self, indices: torch.Tensor | list[int]) -> None:
        if self.state is not None:
            self.state = self.state.select(torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b becomes old row beam_idx[b] (beam search)."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self._select(torch.arange(self.state.n).repeat_interleave(repeats))

    def reset(self) -> None:
        self.state, self.seen_columns = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError("OdysseyHFCache cannot be cropped: the KDA layers keep a recurrent state that "
                         "cannot be rolled back (assisted / speculative generation is not supported; "
                         "generate without assistant_model, or re-run the prefix)")

    def activate_past_recording(self) -> None:
        """Nothing to record: the cache is never cropped."""
