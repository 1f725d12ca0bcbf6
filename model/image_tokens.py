"""The token layout of an image: one definition, shared by the tokenizer, the trajectory checks and the model.

Pure Python (no torch), so the trajectory store can check image spans without loading the model. An image
resized to an h x w grid of p x p patches (`image_grid`) occupies `image_token_count(h, w) = h·(w+1) + 2`
tokens (`image_token_ids`):

    <|image_start|>  (<|image_pad|> × w  <|image_row_break|>) × h  <|image_end|>

model/vision.py embeds the patches over the <|image_pad|> tokens (formulas there and in docs/vision.md).
"""

from __future__ import annotations

import math

#: ids of the image tokens in the shipped tokenizer (model/tokenizer.py: the four former reserved slots)
IMAGE_START_ID, IMAGE_PAD_ID, IMAGE_ROW_BREAK_ID, IMAGE_END_ID = 12, 13, 14, 15
IMAGE_TOKEN_IDS = (IMAGE_START_ID, IMAGE_PAD_ID, IMAGE_ROW_BREAK_ID, IMAGE_END_ID)


def image_grid(height: int, width: int, patch_size: int, max_pixels: int) -> tuple[int, int]:
    """The patch grid (h, w) an image of height × width pixels is resized to.

    s = min(1, √(max_pixels / (height·width)));  h = clamp(⌊height·s / p⌋, 1, N);  w = clamp(⌊width·s / p⌋,
    1, ⌊N / h⌋) with N = ⌊max_pixels / p²⌋ patches, so (h·p)·(w·p) <= max_pixels always (also for extreme
    aspect ratios) and the aspect ratio is kept up to flooring. Images smaller than one patch become 1 x 1.
    """
    for name, v in (("height", height), ("width", width), ("patch_size", patch_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"image {name} must be a positive int, got {v!r}")
    n_max = max_pixels // (patch_size * patch_size)
    if n_max < 1:
        raise ValueError(f"max_pixels={max_pixels} is smaller than one {patch_size}x{patch_size} patch; "
                         f"raise vision_max_pixels to at least {patch_size * patch_size}")
    s = min(1.0, math.sqrt(max_pixels / (height * width)))
    h = min(max(1, int(height * s) // patch_size), n_max)
    w = min(max(1, int(width * s) // patch_size), n_max // h)
    return h, w


def image_token_count(h: int, w: int) -> int:
    """Tokens of one image with an h x w patch grid: start + h rows of (w pads + row break) + end."""
    return h * (w + 1) + 2


def image_token_ids(h: int, w: int) -> list[int]:
    """The token ids of one image block (see the module docstring), length `image_token_count(h, w)`."""
    return [IMAGE_START_ID] + ([IMAGE_PAD_ID] * w + [IMAGE_ROW_BREAK_ID]) * h + [IMAGE_END_ID]
