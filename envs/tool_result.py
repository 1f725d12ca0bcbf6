"""`ToolResult`: a tool's output with images, and the trusted-side check every tool image goes through.

    @tool
    async def look(self) -> ToolResult:
        return ToolResult("the expression:", [png_bytes])

A tool that returns a `ToolResult` gets a tool message whose content is a list of parts (the OpenAI / HF
convention the agent loop's `ChatCodec` prepares):

    [{"type": "text", "text": text}, {"type": "image", "image": png}, ...]

Image bytes are untrusted: a tool may read them from a file the policy's own code wrote in the sandbox.
Each is decoded by `sanitize_image` in a killable child process (`envs.child_process.call_in_child`,
`timeout_s`), never in the env's process: at most `max_bytes` encoded bytes, PNG or JPEG only
(`IMAGE_FORMATS`: Pillow is never asked to identify another format, so it never runs Ghostscript on EPS or
decodes inside `open` as its ICO and ICNS plugins do), at most `max_pixels` pixels read from the header
before any pixel is decoded (a decompression bomb is refused unread), a Pillow mode in
`model.image.ALLOWED_MODES`, the whole image decoded (truncation is caught). A decoder past the timeout is
killed with its whole process group (anything it spawned dies too). What comes back is a fresh RGB
PNG that this process re-encoded, so the policy's codec only ever decodes bytes we wrote. An image that
fails any check, a decoder that hangs past the timeout, or one that crashes the child becomes a text part
`error: image i: <what is wrong>` (and an entry in `info["tool_errors"]`): the episode goes on and is scored.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.child_process import ChildProcessDied, call_in_child
from envs.tool_call import echo, without_surrogates

MAX_IMAGE_BYTES = 8 << 20  # encoded size of one tool image
MAX_IMAGE_PIXELS = 4096 * 4096  # W·H from the header, before decoding
MAX_IMAGES = 8  # per tool result
IMAGE_TIMEOUT_S = 10.0  # decoding one image in the child


@dataclass(frozen=True)
class ToolResult:
    """A tool's output: `text` plus encoded `images` (PNG or JPEG bytes), shown after the text in order."""

    text: str = ""
    images: Sequence[bytes] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"ToolResult.text must be a str, got {type(self.text).__name__}")
        if isinstance(self.images, (bytes, bytearray)) or not isinstance(self.images, Sequence):
            raise TypeError("ToolResult.images must be a list of encoded images (bytes), e.g. [png_bytes]")
        bad = [type(b).__name__ for b in self.images if not isinstance(b, (bytes, bytearray))]
        if bad:
            raise TypeError(f"ToolResult.images must hold encoded image bytes, got {', '.join(bad)}; "
                            "encode a PIL image with img.save(buf, format='PNG') first")
        object.__setattr__(self, "images", tuple(bytes(b) for b in self.images))


@dataclass(frozen=True)
class ImageLimits:
    """Limits on the images of one tool result (defaults: the module constants)."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES
    timeout_s: float = IMAGE_TIMEOUT_S


#: Pillow modes a tool image may have: model.image.ALLOWED_MODES (equal, tests/test_hostile.py), repeated here
#: so the decoding child imports Pillow only (model.image imports torch: seconds per fresh child)
ALLOWED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")
#: the only formats Pillow may open (model.image.IMAGE_FORMATS, equal: tests/test_image_decoder_hostile.py).
#: Both read their size from the header in `Image.open` and decode nothing there; other plugins run
#: programs (EPS: Ghostscript) or decode in `open` (ICO, ICNS), before any check of ours
IMAGE_FORMATS = ("PNG", "JPEG")


class ToolImageError(ValueError):
    """A tool image that cannot be shown; the message (for the model) names the problem."""


def sanitize_image(data: bytes, max_pixels: int) -> tuple[bytes, int, int]:
    """Decode untrusted image bytes with limits and re-encode them: -> (RGB PNG bytes, width, height).

    Only IMAGE_FORMATS are opened (any other bytes are refused before a plugin reads them); the pixel count
    comes from the header and is checked before any pixel is decoded; the mode must be in ALLOWED_MODES;
    alpha is composited over white (as model.image.prepare_image does). Runs in the child process (Pillow
    only). Raises ToolImageError naming the problem."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise ToolImageError("image bytes are not a format Pillow can decode as PNG or JPEG (send PNG or "
                             "JPEG)") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad image, named
        raise ToolImageError(f"image bytes could not be read: {type(e).__name__}: {e}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise ToolImageError(f"image is {w}x{h} = {w * h} pixels, more than the {max_pixels} allowed; "
                             "send a smaller image")
    if img.mode not in ALLOWED_MODES:
        raise ToolImageError(f"image mode {img.mode!r} is not supported; convert it to RGB (allowed: "
                             f"{', '.join(ALLOWED_MODES)})")
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 - truncated / corrupt data
        raise ToolImageError(f"image data is corrupt or truncated: {type(e).__name__}: {e}") from None
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA")
    if img.mode in ("LA", "RGBA"):
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img.convert("RGBA"))
    img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue(), img.size[0], img.size[1]


async def check_image(data: bytes, limits: ImageLimits) -> tuple[bytes, int, int]:
    """`sanitize_image` in a killable child with `limits`; raises ValueError with the reason for the model."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"{len(data)} bytes, more than the {limits.max_bytes} allowed; send a smaller image")
    try:
        value, timed_out = await call_in_child(sanitize_image, data, limits.max_pixels,
                                               timeout_s=limits.timeout_s)
    except ToolImageError as e:
        raise ValueError(str(e)) from None
    except ChildProcessDied as e:
        raise ValueError(f"the image decoder crashed ({e}); send a plain PNG") from None
    if timed_out:
        raise ValueError(f"decoding took longer than {limits.timeout_s:g} s; send a plain PNG")
    return value


async def tool_result_content(
    result: ToolResult, limits: ImageLimits
) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The tool message content of `result`, its text for `info["tool_results"]`, and the image errors.

    content: [{"type": "text", "text"}, then per image {"type": "image", "image": png} or an error text part].
    The record text is the text followed by one line per image: `<image i: WxH sha256 <16 hex>>` or
    `error: image i: ...`."""
    text = without_surrogates(result.text)
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    record, errors = [text] if text else [], []
    for i, data in enumerate(result.images, 1):
        if i > limits.max_images:
            msg = (f"image {i}: only the first {limits.max_images} images of a tool result are shown; "
                   "return fewer images")
            errors.append(msg)
            parts.append({"type": "text", "text": f"error: {msg}"})
            record.append(f"error: {msg}")
            break
        try:
            png, w, h = await check_image(data, limits)
        except ValueError as e:
            msg = f"image {i}: {echo(str(e), 500)}"
            errors.append(msg)
            parts.append({"type": "text", "text": f"error: {msg}"})
            record.append(f"error: {msg}")
            continue
        parts.append({"type": "image", "image": png})
        record.append(f"<image {i}: {w}x{h} sha256 {hashlib.sha256(png).hexdigest()[:16]}>")
    return parts, "\n".join(record), errors


async def read_sandbox_image(sandbox: Any, path: str, limits: ImageLimits) -> bytes:
    """The bytes of an image file in the sandbox (one the policy's code may have written), at most
    `limits.max_bytes` (an endless file such as a symlink to /dev/zero fails as soon as it passes the limit).
    A missing, unreadable or oversized file, a FIFO, socket, device or directory (refused at once), or a read
    past `limits.timeout_s` (said to have timed out) is a `ToolError` naming it (an observation, not an infra
    error); the bytes are still untrusted: return them in a `ToolResult`, which checks them."""
    from envs.tools import ToolError

    try:
        return await sandbox.aread_file(path, max_bytes=limits.max_bytes, timeout_s=limits.timeout_s)
    except OSError as e:  # TimeoutError included: its message says the read timed out
        raise ToolError(f"cannot read image {echo(path, 200)!r}: {echo(str(e), 300)}") from None
