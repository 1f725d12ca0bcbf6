"""Sandbox logic that needs no Docker daemon: stream capping, limits, recipe, mirror, reaper rules.

The Docker-backed behaviour of the same code is tested for real in tests/test_sandbox.py.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest

from sandbox.container import ExecResult, SandboxLimits, _parse_bytes, _StreamCapture
from sandbox.errors import SandboxCrashed, SandboxError, SandboxUnavailable
from sandbox.image import DEFAULT_IMAGE, cli_main, debian_mirror, image_version, recipe
from sandbox.reaper import SandboxInfo, owner_alive, process_start_ticks


def _reference_capture(data: bytes, cap: int, prefix: bytes | None) -> tuple[bytes, bool, bool]:
    """Obvious reference: find the marker prefix in the whole stream, keep what precedes it, cut at cap."""
    i = data.find(prefix) if prefix is not None else -1
    body = data[:i] if i >= 0 else data
    return body[:cap], len(body) > cap, i >= 0


@pytest.mark.parametrize("seed", range(30))
def test_stream_capture_matches_reference_for_any_chunking(seed: int) -> None:
    """Oracle: _StreamCapture over random chunkings == a one-shot find on the whole stream (exact bytes)."""
    rng = random.Random(seed)
    nonce = f"{rng.getrandbits(64):016x}"
    body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 3000)))
    if seed % 3 == 0:
        body += b"\0ODY" + b"0" * 16 + b":"  # a decoy with the wrong nonce must pass through as output
    marker = f"\0ODY{nonce}:3:1:42\0".encode() if seed % 5 else None
    trailing = b"output of a background process after the marker" if marker else b""
    stream = body + (marker or b"") + trailing
    cap = rng.choice([1, 7, 100, 2000, 10_000])
    cut = sorted(rng.sample(range(len(stream) + 1), k=min(len(stream) + 1, rng.randint(0, 12))))
    cap_obj = _StreamCapture(cap, nonce)
    prev = 0
    for c in [*cut, len(stream)]:
        cap_obj.feed(stream[prev:c])
        prev = c
    cap_obj.finish()
    prefix = f"\0ODY{nonce}:".encode() if marker else None
    want_kept, want_trunc, want_done = _reference_capture(stream, cap, prefix)
    assert bytes(cap_obj.kept) == want_kept
    assert cap_obj.truncated == want_trunc
    assert cap_obj.done == want_done
    if marker:
        assert cap_obj.marker_fields == [3, 1, 42]


def test_stream_capture_memory_is_bounded_by_cap() -> None:
    cap = _StreamCapture(1000, "ab" * 8)
    chunk = b"x" * 65536
    for _ in range(200):  # 13 MB through a 1000-byte cap
        cap.feed(chunk)
    assert len(cap.kept) == 1000 and len(cap.pending) < 64 and cap.truncated
    assert cap.total + len(cap.pending) == 200 * 65536


def test_parse_bytes_and_limits_validation() -> None:
    assert _parse_bytes("512m") == 512 * 2**20
    assert _parse_bytes("1g") == 2**30 and _parse_bytes("64k") == 65536 and _parse_bytes(123) == 123
    assert _parse_bytes("1.5m") == int(1.5 * 2**20) and _parse_bytes("512MB") == _parse_bytes(" 512mb ")
    assert _parse_bytes("4096") == 4096
    for bad in ("12x", "m", "", "1.5q", None, True, 1.5):
        with pytest.raises(ValueError, match=r"SandboxLimits.work_size must be a (positive )?size.*'256m'"):
            SandboxLimits(work_size=bad)
    with pytest.raises(ValueError, match="pids >= 16"):
        SandboxLimits(pids=1)
    with pytest.raises(ValueError, match="SandboxLimits.memory"):
        SandboxLimits(memory="0m")


def test_exec_result_ok_flag() -> None:
    assert ExecResult(0, "", "").ok
    assert not ExecResult(1, "", "").ok
    assert not ExecResult(0, "", "", timed_out=True).ok


def test_error_hierarchy_marks_infrastructure_failures() -> None:
    assert issubclass(SandboxUnavailable, SandboxError) and issubclass(SandboxCrashed, SandboxError)
    err = SandboxCrashed("killed for memory", "oom")
    assert err.reason == "oom" and "memory" in str(err)


def test_image_version_is_a_hash_of_the_recipe() -> None:
    assert DEFAULT_IMAGE == f"odyssey-sandbox:{image_version()}"
    assert len(image_version()) == 10
    assert image_version(["git"]) != image_version() == image_version([])
    assert image_version(["git", "gcc"]) == image_version(["gcc", "git"])
    assert "python3" in recipe()["packages"]


def test_debian_mirror_reads_apt_sources(tmp_path) -> None:
    one = tmp_path / "sources.list"
    one.write_text(
        "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n"
    )
    assert debian_mirror([str(one)]) == "http://mirror.example/debian"
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://other.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://deb822.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert debian_mirror([str(deb822)]) == "http://deb822.example/debian"
    assert debian_mirror([str(tmp_path / "missing")]) == "http://deb.debian.org/debian"


def test_build_rejects_bad_package_names(capsys) -> None:
    assert cli_main(["build", "--extra-packages", "git;rm -rf /"]) == 1
    assert "invalid Debian package name" in capsys.readouterr().err


def test_owner_alive_detects_dead_and_recycled_pids() -> None:
    host = socket.gethostname()
    me = os.getpid()
    assert owner_alive(me, host, process_start_ticks(me)) is True
    assert owner_alive(me, host, "1") is False  # same pid, different start time: recycled
    assert owner_alive(me, "some-other-host") is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert owner_alive(child.pid, host) is False


def test_reapable_rules() -> None:
    import time

    base = dict(id="x", name="x", status="running", owner_pid=1, owner_host="h", owner_start="", ttl_s=100.0)
    assert SandboxInfo(**base, created=time.time(), owner_alive=False).reapable  # owner gone
    assert not SandboxInfo(**base, created=time.time(), owner_alive=True).reapable
    assert not SandboxInfo(**base, created=time.time(), owner_alive=None).reapable  # other host, young
    assert SandboxInfo(**base, created=time.time() - 101, owner_alive=None).reapable  # ttl passed
    assert SandboxInfo(**base, created=time.time() - 101, owner_alive=True).reapable


def test_daemon_down_is_unavailable_with_the_fix(monkeypatch) -> None:
    from sandbox import client

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/odyssey-test.sock")
    client.reset_client()
    try:
        with pytest.raises(SandboxUnavailable, match="dockerd"):
            client.docker_client()
    finally:
        monkeypatch.delenv("DOCKER_HOST")
        client.reset_client()


def test_exec_request_encoding() -> None:
    from sandbox.container import _request

    req = _request("ab" * 8, 2.5, "/work", ["bash", "-c", "echo 'a\nb'"], {"X": "1 2"}, True)
    assert req.endswith(b"\0")
    fields = req[:-1].split(b"\0")
    assert fields == [
        b"ODYREQ",
        b"ab" * 8,
        b"2.500",
        b"/work",
        b"1",
        b"1",
        b"X=1 2",
        b"3",
        b"bash",
        b"-c",
        b"echo 'a\nb'",
    ]
    with pytest.raises(ValueError, match="NUL"):
        _request("n", 1, "/work", ["a\0b"], {}, False)
    with pytest.raises(ValueError, match="environment variable"):
        _request("n", 1, "/work", ["true"], {"": "x"}, False)
