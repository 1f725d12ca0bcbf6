"""The image decoder against bytes the policy wrote (issue 40, section 5): only PNG and JPEG are opened, so
Pillow never runs Ghostscript on an EPS named `.png` nor decodes inside `Image.open` (ICO, ICNS wrapping a
13000x13000 PNG); sizes come from the header before any decode; a decoder past its timeout dies with its
whole process group; and `TeacherForcedEngine` passes its wrapped engine's `config` to the worker, so a
vision policy's worker gets a vision codec.

Every place that decodes untrusted image bytes is covered: `envs.tool_result.sanitize_image` in-process (the
dataset path, `envs.dataset_qa.row_image`) and in the killable child (`check_image`, tool images), and
`model.image.prepare_image` (env prompt images and the agent endpoint's image_url parts).
"""

from __future__ import annotations

import asyncio
import io
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

EPS = b"""%!PS-Adobe-3.0 EPSF-3.0
%%BoundingBox: 0 0 16 16
%%EndComments
newpath 0 0 moveto 16 16 lineto stroke
showpage
%%EOF
"""

FORMAT_ERROR = "not a format Pillow can decode as PNG or JPEG (send PNG or JPEG)"


def _chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(w: int, h: int, *, depth: int = 8, colour: int = 2, extra: bytes = b"") -> bytes:
    """A valid PNG of w x h zero pixels (colour type 2: RGB, 0: grey), `extra` chunks before IDAT."""
    channels = {0: 1, 2: 3}[colour]
    c = zlib.compressobj(9)
    row = b"\0" * (1 + -(-w * channels * depth // 8))
    idat = b"".join(c.compress(row) for _ in range(h)) + c.flush()
    header = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + extra + _chunk(b"IDAT", idat)
            + _chunk(b"IEND", b""))


def _ico(png: bytes) -> bytes:
    """An ICO file with one 256x256 entry whose data is `png` (Pillow's ICO plugin decodes it in `open`)."""
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22) + png


def _icns(png: bytes) -> bytes:
    """An ICNS file with one `ic10` (1024x1024) block whose data is `png` (decoded after the size check)."""
    block = b"ic10" + struct.pack(">I", 8 + len(png)) + png
    return b"icns" + struct.pack(">I", 8 + len(block)) + block


def _pil(img, fmt: str, **kw) -> bytes:  # PIL.Image.Image -> encoded bytes
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    """A 13000x13000 RGB PNG of zeros (about 0.5 MB; 507 MB once decoded), the issue's bomb."""
    return _png(13000, 13000)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed orphan may wait for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _live_in_group(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose process group is `pgid`, read from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d))
    return out


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """`pids` still running after waiting up to `timeout_s` (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _spawn_and_hang(pidfile: str) -> None:
    """Run in the decoding child: start a grandchild (`sleep 600`), record its pid, hang past the timeout."""
    grandchild = subprocess.Popen(["sleep", "600"])
    Path(pidfile).write_text(str(grandchild.pid))
    time.sleep(600)


@pytest.fixture
def fake_gs(tmp_path, monkeypatch):
    """A stand-in `gs` first on PATH that appends its pid and arguments to a marker file (then answers
    `--version`, or sleeps 8 s as a hung Ghostscript would); the Pillow EPS plugin's cached probe is reset.
    Yields the marker path. Decoding children started before get this PATH only after a shutdown."""
    from PIL import EpsImagePlugin

    from envs import child_process

    marker = tmp_path / "gs_ran"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f'#!/bin/sh\necho "$$ $*" >> {marker}\n'
                  'if [ "$1" = "--version" ]; then echo 10.02.1; exit 0; fi\nexec sleep 8\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    child_process.shutdown()  # the next decoding child inherits the PATH above
    yield marker
    child_process.shutdown()  # and none outlives the test with it
    if marker.exists():  # the old decoder ran it: end what is still running (never on the fixed code)
        for line in marker.read_text().splitlines():
            pid = int(line.split()[0])
            if _running(pid):
                os.kill(pid, 9)


def test_the_two_decoders_accept_the_same_formats():
    """The child's format list is the model's (the child imports Pillow only, so it repeats it)."""
    from envs.tool_result import IMAGE_FORMATS
    from model.image import IMAGE_FORMATS as MODEL_FORMATS

    assert IMAGE_FORMATS == MODEL_FORMATS == ("PNG", "JPEG")


def test_an_eps_named_png_never_runs_ghostscript(fake_gs, tmp_path):
    """EPS bytes in a file named `.png`, through every decoder of untrusted bytes (in-process
    sanitize_image, the dataset's row_image, prepare_image, and check_image's child with a 3 s timeout):
    each is refused with the PNG-or-JPEG error and the stand-in `gs` on PATH never runs."""
    from envs.dataset import DatasetError
    from envs.dataset_qa import row_image
    from envs.tool_result import ImageLimits, ToolImageError, check_image, sanitize_image
    from model.image import ImageError, prepare_image

    named_png = tmp_path / "chart.png"
    named_png.write_bytes(EPS)
    with pytest.raises(ToolImageError, match="PNG or JPEG") as e:
        sanitize_image(named_png.read_bytes(), 4096 * 4096)
    assert FORMAT_ERROR in str(e.value)
    with pytest.raises(DatasetError, match="PNG or JPEG"):
        row_image(str(named_png), "row 0 image")
    with pytest.raises(ImageError, match="PNG or JPEG"):
        prepare_image(named_png.read_bytes(), 8, 64 * 64)
    with pytest.raises(ValueError, match="PNG or JPEG"):
        asyncio.run(check_image(named_png.read_bytes(), ImageLimits(timeout_s=3.0)))
    assert not fake_gs.exists(), f"gs ran: {fake_gs.read_text()}"


def test_a_decoder_past_its_timeout_dies_with_everything_it_spawned(tmp_path):
    """The decoding child leads its own process group; a call past its timeout kills the whole group: a
    grandchild it started (as Pillow starts `gs`) is gone too, not re-parented to init and running on."""
    from envs.child_process import _Child

    pidfile = tmp_path / "grandchild.pid"
    child = _Child()
    grandchild = None
    try:
        pid, timed_out = child.call(os.getpid, (), 60.0)  # warm: the next call's import is fast
        assert not timed_out and pid == child.proc.pid
        pgid, sid = os.getpgid(pid), os.getsid(pid)
        value, timed_out = child.call(_spawn_and_hang, (str(pidfile),), 5.0)
        assert (value, timed_out) == (None, True)
        grandchild = int(pidfile.read_text())
        assert not _wait_gone([grandchild]), f"the decoder's grandchild {grandchild} outlived the timeout"
        assert pgid == pid and sid == pid, "the decoder must lead its own session and group"
        assert not child.alive()
        deadline = time.monotonic() + 5.0
        while _live_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _live_in_group(pgid) == []  # nothing of the group runs (an unreaped zombie would not count)
    finally:
        if child.alive():
            child.kill()
        if grandchild is not None and _running(grandchild):  # the old decoder left it: end it here
            os.kill(grandchild, 9)


@pytest.mark.parametrize("wrap", ["ico", "icns"])
def test_an_icon_wrapped_bomb_is_refused_unread(wrap, bomb_png):
    """A 13000x13000 PNG inside an ICO (Pillow decodes it in `Image.open`) or an ICNS (claims 1024x1024 to
    the size check, then decodes the inner PNG): refused by the format check in < 1 s, by sanitize_image
    and by prepare_image alike."""
    from envs.tool_result import ToolImageError, sanitize_image
    from model.image import ImageError, prepare_image

    data = {"ico": _ico, "icns": _icns}[wrap](bomb_png)
    t0 = time.perf_counter()
    with pytest.raises(ToolImageError) as e:
        sanitize_image(data, 4096 * 4096)
    assert time.perf_counter() - t0 < 1.0
    assert FORMAT_ERROR in str(e.value)
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="PNG or JPEG"):
        prepare_image(data, 8, 64 * 64)
    assert time.perf_counter() - t0 < 1.0


def _peak_rss_mib(path: Path) -> tuple[float, str]:
    """(peak RSS in MiB, error text) of a fresh Python that runs sanitize_image on the bytes in `path`."""
    code = ("import resource, sys\nfrom envs.tool_result import ToolImageError, sanitize_image\n"
            "data = open(sys.argv[1], 'rb').read()\ntry:\n    sanitize_image(data, 4096 * 4096)\n"
            "    err = 'accepted'\nexcept ToolImageError as e:\n    err = str(e)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\nprint(err)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], check=True).stdout.splitlines()
    return float(out[0]), out[1]


def test_the_icon_wrapped_bomb_costs_the_decoder_no_more_memory_than_the_bare_bomb(bomb_png, tmp_path):
    """Peak RSS of a fresh decoding process: the ICO-wrapped bomb is refused within 32 MiB of the bare
    13000x13000 PNG's refusal from its header (before the fix: about 675 MiB more)."""
    bare, ico = tmp_path / "bare.png", tmp_path / "wrapped.png"
    bare.write_bytes(bomb_png)
    ico.write_bytes(_ico(bomb_png))
    bare_rss, bare_err = _peak_rss_mib(bare)
    ico_rss, ico_err = _peak_rss_mib(ico)
    assert "13000x13000 = 169000000 pixels, more than the 16777216 allowed" in bare_err
    assert FORMAT_ERROR in ico_err
    assert ico_rss < bare_rss + 32, (bare_rss, ico_rss)


def test_other_formats_and_header_lies_are_refused_before_decoding():
    """TIFF, GIF, BMP, WebP and ICO are not opened (the format error); a JPEG whose header says 5000x5000
    fails the pixel check and a PNG whose iCCP chunk inflates to 64 MiB fails Pillow's chunk limit, both in
    `Image.open`, before any pixel is decoded; each in < 1 s."""
    from PIL import Image

    from envs.tool_result import ToolImageError, sanitize_image

    small = Image.new("RGB", (16, 16), (200, 10, 10))
    jpeg = bytearray(_pil(small, "JPEG"))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5 : sof + 9] = struct.pack(">HH", 5000, 5000)  # height, width in SOF0
    iccp = _png(16, 16, extra=_chunk(b"iCCP", b"icc\0\0" + zlib.compress(b"\0" * (64 << 20), 9)))
    cases = {
        "tiff": (_pil(small, "TIFF"), FORMAT_ERROR),
        "gif": (_pil(small, "GIF"), FORMAT_ERROR),
        "bmp": (_pil(small, "BMP"), FORMAT_ERROR),
        "webp": (_pil(small, "WEBP"), FORMAT_ERROR),
        "ico": (_pil(small, "ICO"), FORMAT_ERROR),
        "jpeg_5000x5000": (bytes(jpeg), "5000x5000 = 25000000 pixels, more than the 16777216 allowed"),
        "iccp_bomb": (iccp, "Decompressed data too large"),
    }
    for name, (data, says) in cases.items():
        t0 = time.perf_counter()
        with pytest.raises(ToolImageError) as e:
            sanitize_image(data, 4096 * 4096)
        assert time.perf_counter() - t0 < 1.0, name
        assert says in str(e.value), (name, str(e.value))


def test_apng_progressive_jpeg_and_16_bit_png_decode_as_one_rgb_image():
    """Accepted PNG and JPEG variants: an animated PNG gives its first frame only, a progressive JPEG and a
    16-bit RGB PNG decode whole; each comes back as a fresh RGB PNG of its size."""
    import numpy as np
    from PIL import Image

    from envs.tool_result import sanitize_image

    red, *others = (Image.new("RGB", (32, 24), c) for c in [(255, 0, 0), (0, 0, 255), (0, 255, 0), (9, 9, 9)])
    apng = _pil(red, "PNG", save_all=True, append_images=others, duration=100)
    assert Image.open(io.BytesIO(apng)).n_frames == 4
    png, w, h = sanitize_image(apng, 4096 * 4096)
    first = np.asarray(Image.open(io.BytesIO(png)))
    assert (w, h) == (32, 24) and first.shape == (24, 32, 3) and (first == (255, 0, 0)).all()

    noise = np.random.default_rng(0).integers(0, 256, (40, 48, 3), np.uint8)
    progressive = _pil(Image.fromarray(noise), "JPEG", progressive=True, quality=95)
    assert Image.open(io.BytesIO(progressive)).info.get("progressive")
    png, w, h = sanitize_image(progressive, 4096 * 4096)
    assert (w, h) == (48, 40) and Image.open(io.BytesIO(png)).mode == "RGB"

    deep = _png(20, 10, depth=16)
    assert Image.open(io.BytesIO(deep)).mode == "RGB"
    png, w, h = sanitize_image(deep, 4096 * 4096)
    assert (w, h) == (20, 10) and not np.asarray(Image.open(io.BytesIO(png))).any()


def test_teacher_forced_engine_gives_a_vision_policys_worker_a_vision_codec():
    """A RolloutWorker built on TeacherForcedEngine(TorchEngine(vision model)) reads the wrapped engine's
    config (rl.rollout.worker.policy_vision): its codec has the model's patch size and pixel budget and
    prepares an image message; the engine's stats are the wrapped engine's too."""
    import torch
    from PIL import Image

    from model.config import OdysseyConfig
    from model.image import PreparedImage
    from model.modeling import OdysseyForCausalLM
    from model.tokenizer import load_tokenizer
    from rl.rollout.agent_loop import ChatCodec
    from rl.rollout.engine import TorchEngine
    from rl.rollout.scripted import TeacherForcedEngine
    from rl.rollout.worker import RolloutWorker, WorkerSettings, policy_vision

    torch.manual_seed(0)
    model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    p, max_pixels = model.config.vision_patch_size, model.config.vision_max_pixels
    assert p > 0 and max_pixels > 0
    inner = TorchEngine(model)
    tok = load_tokenizer()
    engine = TeacherForcedEngine(inner, ChatCodec(tok), lambda request: "4")
    assert engine.config is model.config and engine.stats is inner.stats
    assert policy_vision(engine) == (p, max_pixels)
    worker = RolloutWorker(WorkerSettings(shared_pool=False), engine=engine, tokenizer=tok)
    try:
        assert (worker.codec.patch_size, worker.codec.max_pixels) == (p, max_pixels)
        image = _pil(Image.new("RGB", (40, 24), (9, 9, 9)), "PNG")
        [msg] = worker.codec.prepare([{"role": "user", "content": [{"type": "image", "image": image}]}])
        assert isinstance(msg["content"][0]["image"], PreparedImage)
    finally:
        asyncio.run(worker.close())
    with pytest.raises(AttributeError):
        engine.no_such_attribute  # noqa: B018 - a missing attribute stays missing
