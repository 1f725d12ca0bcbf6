"""Padded <-> packed: Hugging Face's [B, T] + attention_mask layout as the packed tokens the model runs on.

The model runs on packed sequences (input_ids [T'] + cu_seqlens [B+1], docs/model.md). A padded batch
is converted, not masked: the real tokens of row b (attention_mask 1), in order, are packed sequence b;
padding positions do not exist for the model. After the packed forward, per-token outputs are scattered
back to their [B, T] places and padding positions get zeros. So a padded batch gives exactly the packed
outputs, for left, right or any other padding, and a cache built from a left-padded prompt holds only
the row's real tokens.

    mask  [B, T] (1 = real)  ->  keep [B, T] bool, index int64 [n] (flat positions b*T + t of the real
                                 tokens, row-major), lens [B], cu_seqlens int32 [B+1]
    pack(x [B, T, ...]) -> [n, ...];   unpack(y [n, ...]) -> [B, T, ...] (zeros at padding)

Hugging Face's padding-free convention (`DataCollatorWithFlattening`: no attention_mask, position_ids that
restart at 0 at each sequence start) is `boundaries_from_position_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddedLayout:
    """Where the real tokens of a [B, T] batch are. See the module docstring for the fields."""

    keep: torch.Tensor
    index: torch.Tensor
    lens: list[int]
    cu_seqlens: torch.Tensor

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> PaddedLayout:
        """mask [B, T] (bool or 0/1 ints) -> layout. Any pattern is allowed: masked tokens are skipped."""
        if mask.dim() != 2:
            raise ValueError(f"attention_mask must be [batch, seq_len] (1 = real token, 0 = padding), got "
                             f"shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_floating_point or bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token); a 4-D or "
                                 "additive float mask is not supported (the model masks by packing)")
            mask = mask != 0
        B, T = mask.shape
        lens_t = mask.sum(1)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
        cu[1:] = lens_t.cumsum(0)
        index = mask.reshape(B * T).nonzero().squeeze(1)
        return cls(mask, index, lens_t.tolist(), cu)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.keep.shape[0]), int(self.keep.shape[1]))

    @property
    def all_real(self) -> bool:
        """True when no position is padding (pack and unpack are plain reshapes)."""
        return int(self.index.shape[0]) == self.keep.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> the real positions [n, ...] in row-major (packed) order."""
        B, T = self.shape
        flat = x.reshape(B * T, *x.shape[2:])
        return flat if self.all_real else flat.index_select(0, self.index)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """y [n, ...] (packed order) -> [B, T, ...] with zeros at padding positions."""
        B, T = self.shape
        if self.all_real:
            return y.reshape(B, T, *y.shape[1:])
        out = y.new_zeros(B * T, *y.shape[1:])
        out = out.index_copy(0, self.index, y)
        return out.reshape(B, T, *y.shape[1:])


def boundaries_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """position_ids [B, T] of an unpadded batch -> cu_seqlens int32 [N+1] of the flattened B*T tokens when
    some row restarts at 0 after its first token (several sequences per row, HF's padding-free layout),
    else None (one sequence per row). A sequence starts at each row start and at each position_ids == 0."""
    B, T = position_ids.shape
    if T == 0:
        return None
    starts = position_ids == 0
    starts[:, 0] = True
    if int(starts.sum()) == B:
        return None
    flat = starts.reshape(B * T).nonzero().squeeze(1)
    end = torch.tensor([B * T], dtype=flat.dtype, device=flat.device)
    return torch.cat([flat, end]).to(torch.int32)
