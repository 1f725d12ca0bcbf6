"""Native vision: image patches embedded straight into the backbone's token stream (no ViT tower).

An image enters the model as pixels at its own resolution, already sized to a whole number of patches
(`image_grid` gives the size; `model/image.py` decodes and resizes). With patch size p and an h x w grid
of patches (image height h·p, width w·p), the image occupies

    n_tokens(h, w) = h·(w + 1) + 2                                                    (`image_token_count`)

consecutive tokens in the sequence (`image_token_ids`):

    <|image_start|>  (<|image_pad|> × w  <|image_row_break|>) × h  <|image_end|>

The start / row-break / end tokens are ordinary tokens (their embedding rows). Each `<|image_pad|>` at
row r, column c (token offset 1 + r·(w+1) + c from the start token, `pad_offsets`) gets its patch's
embedding instead of a token embedding:

    x_0[t] = W_p (2·P_rc − 1) + b_p + g ⊙ pos2d(r, c)                                [D]

    P_rc    = the patch's pixels in [0, 1], flattened channel-major: [3, p, p] -> [3p²]
    pos2d(r, c) = [sin(r ω), cos(r ω), sin(c ω), cos(c ω)],  ω_i = 10000^(−i/q), i < q = D/4
    W_p [D, 3p²], b_p [D]: the patch projection;  g [D]: a learned gain on the fixed 2-D code

and from there the patch tokens go through the same KDA / MLA / MoE layers as text. Order within an image
comes from the 2-D code and from the row-break tokens (the backbone itself has no positions).

The layout functions live in model/image_tokens.py (pure Python, re-exported here): they are its one
definition, which the tokenizer's chat helpers (model/tokenizer.py), the trajectory checks (rl/) and the
model all call.

Patches reach the model as `ImagePatches` (patches, grid positions and the index of the `<|image_pad|>`
token each one replaces in the packed input), so packing, chunked prefill and sessions only slice and
shift it; `ImagePatches.from_images` builds it from pixel tensors and their start-token positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.image_tokens import (  # noqa: F401  (re-exported: the layout is part of the vision API)
    IMAGE_END_ID,
    IMAGE_PAD_ID,
    IMAGE_ROW_BREAK_ID,
    IMAGE_START_ID,
    IMAGE_TOKEN_IDS,
    image_grid,
    image_token_count,
    image_token_ids,
)


def is_image_token(ids: torch.Tensor) -> torch.Tensor:
    """bool mask, shaped like ids: the token is one of the four image tokens."""
    return torch.isin(ids, torch.tensor(IMAGE_TOKEN_IDS, device=ids.device))


def pad_offsets(h: int, w: int) -> torch.Tensor:
    """int64 [h·w]: offset from the start token of the pad of patch (r, c), row-major: 1 + r·(w+1) + c."""
    r = torch.arange(h).repeat_interleave(w)
    c = torch.arange(w).repeat(h)
    return 1 + r * (w + 1) + c


def patchify(pixels: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pixels [3, h·p, w·p] in [0, 1] -> (patches [h·w, 3p²] row-major over the grid, grid_pos int64 [h·w, 2]
    (row, col)). A patch is flattened channel-major: index = ch·p² + y·p + x."""
    if pixels.dim() != 3 or pixels.shape[0] != 3:
        raise ValueError(f"image pixels must be [3, H, W] (RGB, channel first), got {tuple(pixels.shape)}")
    p = patch_size
    _, H, W = pixels.shape
    if H % p or W % p or H == 0 or W == 0:
        raise ValueError(f"image of {H}x{W} pixels is not a whole number of {p}x{p} patches; resize it with "
                         "model.image.prepare_image (or to image_grid(...) · patch_size)")
    h, w = H // p, W // p
    patches = pixels.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3 * p * p)
    r = torch.arange(h).repeat_interleave(w)
    c = torch.arange(w).repeat(h)
    return patches, torch.stack([r, c], dim=1)


@dataclass(frozen=True)
class ImagePatches:
    """The patches of the images in one (packed) input, one row per `<|image_pad|>` token they replace.

    patches [P, 3p²] float in [0, 1]; grid_pos int64 [P, 2] (row, col) in its image; token_index int64 [P]
    strictly increasing positions in the packed input_ids (each must hold `<|image_pad|>`).
    A `<|image_pad|>` token with no patch (e.g. one the model sampled) is embedded as an ordinary token.
    """

    patches: torch.Tensor
    grid_pos: torch.Tensor
    token_index: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.token_index.shape[0])

    @staticmethod
    def from_images(images: Sequence[torch.Tensor], starts: Sequence[int], patch_size: int) -> ImagePatches:
        """images [3, h_i·p, w_i·p] with their `<|image_start|>` token positions `starts` in the input."""
        if len(images) != len(starts):
            raise ValueError(f"{len(images)} images but {len(starts)} start positions; give one start "
                             "(the index of its <|image_start|> token) per image")
        ps, gs, ts = [], [], []
        for img, s in zip(images, starts):
            patches, grid = patchify(img.float() / 255 if img.dtype == torch.uint8 else img, patch_size)
            h, w = int(grid[-1, 0]) + 1, int(grid[-1, 1]) + 1
            ps.append(patches)
            gs.append(grid)
            ts.append(int(s) + pad_offsets(h, w))
        if not ps:
            return ImagePatches.empty(patch_size)
        return ImagePatches(torch.cat(ps), torch.cat(gs), torch.cat(ts))

    @staticmethod
    def empty(patch_size: int) -> ImagePatches:
        return ImagePatches(torch.zeros(0, 3 * patch_size * patch_size), torch.zeros(0, 2, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long))

    @staticmethod
    def concat(parts: Sequence[ImagePatches], offsets: Sequence[int]) -> ImagePatches:
        """Patches of several inputs packed one after another: part i's token indices shift by offsets[i]."""
        if not parts:
            raise ValueError("ImagePatches.concat needs at least one part")
        return ImagePatches(torch.cat([p.patches for p in parts]), torch.cat([p.grid_pos for p in parts]),
                            torch.cat([p.token_index + int(o) for p, o in zip(parts, offsets)]))

    def window(self, start: int, end: int) -> ImagePatches:
        """The patches whose tokens lie in [start, end), re-indexed relative to `start` (chunked prefill)."""
        keep = (self.token_index >= start) & (self.token_index < end)
        return ImagePatches(self.patches[keep], self.grid_pos[keep], self.token_index[keep] - start)

    def to(self, device: torch.device | str) -> ImagePatches:
        return ImagePatches(self.patches.to(device), self.grid_pos.to(device), self.token_index.to(device))


def sincos_2d(grid_pos: torch.Tensor, dim: int) -> torch.Tensor:
    """grid_pos int [P, 2] -> fp32 [P, dim]: [sin(r ω), cos(r ω), sin(c ω), cos(c ω)], ω_i = 10000^(−i/q),
    q = dim/4 (dim must be a multiple of 4)."""
    q = dim // 4
    omega = 10000.0 ** (-torch.arange(q, dtype=torch.float64, device=grid_pos.device) / q)
    r = grid_pos[:, :1].double() * omega
    c = grid_pos[:, 1:].double() * omega
    return torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=1).float()


class PatchEmbed(nn.Module):
    """Patch embedding: patches [P, 3p²] in [0, 1], grid_pos [P, 2] -> [P, D] (formula: module docstring)."""

    def __init__(self, patch_size: int, hidden_size: int) -> None:
        super().__init__()
        if hidden_size % 4:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of 4 for the 2-D sin-cos patch "
                             "position code (or set vision_patch_size=0 for a text-only model)")
        self.patch_size = patch_size
        self.weight = nn.Parameter(torch.empty(hidden_size, 3 * patch_size * patch_size))  # W_p
        self.bias = nn.Parameter(torch.zeros(hidden_size))  # b_p
        self.pos_gain = nn.Parameter(torch.empty(hidden_size))  # g

    def forward(self, patches: torch.Tensor, grid_pos: torch.Tensor) -> torch.Tensor:
        w = self.weight
        x = F.linear(patches.to(w.dtype) * 2 - 1, w, self.bias)
        return x + self.pos_gain * sincos_2d(grid_pos, w.shape[0]).to(w.dtype)
