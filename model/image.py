"""Images in and out of the token stream: decode with limits, resize to the patch grid, content-address.

Every image the policy sees goes through `prepare_image` exactly once, where it enters a conversation (a
prompt or a tool observation):

    bytes / PIL image / uint8 array [H, W, 3]
      -> decode (PNG or JPEG only, `IMAGE_FORMATS`, through Pillow) with limits: at most `max_input_pixels`
         pixels before decoding (the header is read first, so a decompression bomb is refused unread), a
         known mode
      -> RGB (alpha composited over white; grey and palette expanded)
      -> resized to (h·p, w·p) with (h, w) = model.vision.image_grid(H, W, p, max_pixels) (bicubic)
      -> `PreparedImage`: pixels uint8 [3, h·p, w·p], the lossless PNG of exactly those pixels, its sha256

From then on the PNG is the image: the trajectory stores it (content-addressed by its sha256, which the
store checks), the learner decodes it back to the same pixels (`decode_prepared`, which verifies that it is
already at a patch-grid size), and both sides feed `pixels / 255` to the model. The resize never runs
twice, so rollout and learner see bit-identical pixels.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch

from model.image_tokens import image_grid, image_token_count

#: Pillow modes we decode (everything else is refused with a message naming it)
ALLOWED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")
DEFAULT_MAX_INPUT_PIXELS = 64 * 1024 * 1024  # before resizing: refuses decompression bombs unread
#: the only formats Pillow may open: both read their size from the header and decode nothing in `open`;
#: other plugins run programs (EPS: Ghostscript) or decode inside `open` (ICO, ICNS) before our checks
IMAGE_FORMATS = ("PNG", "JPEG")


class ImageError(ValueError):
    """An image that cannot enter a conversation: undecodable, too large, or of an unsupported mode."""


@dataclass(frozen=True)
class PreparedImage:
    """An image at its patch-grid size: pixels uint8 [3, h·p, w·p]; png: its lossless encoding; sha256: hex
    digest of png (its content address); grid (h, w)."""

    pixels: torch.Tensor
    png: bytes
    sha256: str
    grid: tuple[int, int]

    @property
    def n_tokens(self) -> int:
        return image_token_count(*self.grid)


def _open(data: bytes, max_input_pixels: int):  # -> PIL.Image.Image
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise ImageError("image bytes are not a format Pillow can decode as PNG or JPEG (send PNG or "
                         "JPEG)") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad image, named
        raise ImageError(f"image bytes could not be read: {type(e).__name__}: {e}") from None
    w, h = img.size
    if w * h > max_input_pixels:
        raise ImageError(
            f"image is {w}x{h} = {w * h} pixels, more than the {max_input_pixels} allowed before "
            "resizing; send a smaller image or raise max_input_pixels"
        )
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 - truncated / corrupt data
        raise ImageError(f"image data is corrupt or truncated: {type(e).__name__}: {e}") from None
    return img


def _to_rgb(img):  # PIL.Image.Image -> PIL.Image.Image (mode RGB)
    from PIL import Image

    if img.mode not in ALLOWED_MODES:
        raise ImageError(
            f"image mode {img.mode!r} is not supported; convert it to RGB (allowed: "
            f"{', '.join(ALLOWED_MODES)})"
        )
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA")
    if img.mode in ("LA", "RGBA"):
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img.convert("RGBA"))
    return img.convert("RGB")


def encode_png(pixels: torch.Tensor) -> bytes:
    """uint8 [3, H, W] -> lossless PNG bytes (deterministic for given pixels and Pillow version)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), "RGB").save(
        buf, format="PNG", optimize=False
    )
    return buf.getvalue()


def prepare_image(
    image: bytes | np.ndarray | object,
    patch_size: int,
    max_pixels: int,
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
) -> PreparedImage:
    """Decode (bytes), check, convert to RGB and resize an image to its patch grid (see the module docstring).

    image: encoded bytes (PNG or JPEG), a PIL image, or a uint8 array [H, W, 3] (RGB)."""
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        img = _open(bytes(image), max_input_pixels)
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageError(
                f"an image array must be uint8 [H, W, 3] (RGB), got {image.dtype} {list(image.shape)}"
            )
        if image.shape[0] * image.shape[1] > max_input_pixels:
            raise ImageError(
                f"image array of {image.shape[0]}x{image.shape[1]} pixels is larger than "
                f"max_input_pixels={max_input_pixels}"
            )
        img = Image.fromarray(image, "RGB")
    elif isinstance(image, Image.Image):
        if image.size[0] * image.size[1] > max_input_pixels:
            raise ImageError(
                f"image of {image.size[0]}x{image.size[1]} pixels is larger than "
                f"max_input_pixels={max_input_pixels}"
            )
        img = image
    else:
        raise ImageError(
            f"an image must be encoded bytes, a PIL image or a uint8 [H, W, 3] array, got "
            f"{type(image).__name__}"
        )
    img = _to_rgb(img)
    W, H = img.size
    h, w = image_grid(H, W, patch_size, max_pixels)
    size = (w * patch_size, h * patch_size)
    if img.size != size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    png = encode_png(pixels)
    return PreparedImage(pixels, png, hashlib.sha256(png).hexdigest(), (h, w))


def decode_prepared(
    png: bytes, patch_size: int, grid: tuple[int, int] | None = None, sha256: str | None = None
) -> torch.Tensor:
    """Stored PNG of a prepared image -> pixels uint8 [3, h·p, w·p], checking its digest, mode and size."""
    if sha256 is not None and hashlib.sha256(png).hexdigest() != sha256:
        raise ImageError(f"image bytes do not match their content address sha256={sha256[:16]}...")
    img = _open(png, DEFAULT_MAX_INPUT_PIXELS)
    if img.format != "PNG" or img.mode != "RGB":
        raise ImageError(
            f"a stored image must be an RGB PNG (written by prepare_image), got {img.format} {img.mode}"
        )
    W, H = img.size
    if H % patch_size or W % patch_size:
        raise ImageError(f"stored image is {W}x{H}, not a whole number of {patch_size}x{patch_size} patches")
    if grid is not None and (H // patch_size, W // patch_size) != tuple(grid):
        raise ImageError(
            f"stored image is a {H // patch_size}x{W // patch_size} patch grid, its record says "
            f"{grid[0]}x{grid[1]}"
        )
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()
