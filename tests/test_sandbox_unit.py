"""Sandbox logic that needs no Docker daemon: the exec channel's framing, the supervisor's process tree,
limits, recipe, mirror, reaper rules.

The Docker-backed behaviour of the same code is tested for real in tests/test_sandbox.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from sandbox.container import ExecResult, SandboxLimits, _parse_bytes
from sandbox.errors import SandboxCrashed, SandboxError, SandboxUnavailable
from sandbox.exec_channel import SupervisorChannel, encode_request
from sandbox.image import DEFAULT_IMAGE, cli_main, debian_mirror, image_version, recipe
from sandbox.reaper import SandboxInfo, owner_alive, process_start_ticks


def _mux(stream: int, data: bytes) -> bytes:
    """One chunk of Docker's multiplexed attach stream."""
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def _frame(kind: bytes, payload: bytes | dict) -> bytes:
    if isinstance(payload, dict):
        payload = json.dumps(payload).encode()
    return kind + len(payload).to_bytes(4, "big") + payload


def _serve(peer: socket.socket, stream: bytes, rng: random.Random, close: bool) -> threading.Thread:
    """Write `stream` to `peer` in random pieces (and read whatever the channel sends), then maybe close."""

    def run() -> None:
        pos = 0
        while pos < len(stream):
            n = rng.randint(1, 50)
            peer.sendall(stream[pos : pos + n])
            pos += n
        if close:
            peer.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("seed", range(20))
def test_channel_demultiplexes_frames_for_any_chunking(seed: int) -> None:
    """Oracle: the channel's stdout/stderr == the concatenated O/E payloads (each cut at `cap`), for random
    frame sizes, Docker chunk boundaries, interleaved supervisor diagnostics and socket read boundaries."""
    rng = random.Random(seed)
    cap = rng.choice([1, 50, 700, 10_000])
    frames = [_frame(b"A", {"pid": 3})]
    out, err = b"", b""
    for _ in range(rng.randint(0, 30)):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        kind = rng.choice([b"O", b"E"])
        frames.append(_frame(kind, data))
        out, err = (out + data, err) if kind == b"O" else (out, err + data)
    result = {"rc": 3, "timed_out": False, "capped": False, "oom_kills": 0, "elapsed_us": 1,
              "out_bytes": len(out), "err_bytes": len(err)}  # fmt: skip
    frames.append(_frame(b"X", result))
    stdout_bytes = b"".join(frames)
    muxed, pos = b"", 0
    while pos < len(stdout_bytes):  # Docker cuts stream 1 anywhere, and interleaves stream 2
        n = rng.randint(1, 400)
        muxed += _mux(1, stdout_bytes[pos : pos + n])
        pos += n
        # A diagnostic after the last stdout chunk may legitimately go unread: the channel returns once
        # the X frame is complete. Every diagnostic before that point must be kept.
        if pos < len(stdout_bytes) and rng.random() < 0.3:
            muxed += _mux(2, b"diagnostic ")
    a, b = socket.socketpair()
    chan = SupervisorChannel("exec-id", a, b"")
    t = _serve(b, muxed, rng, close=False)
    req = encode_request(["true"], {}, "/work", 5, cap, None, uid=1000, gid=1000)
    got = chan.run(req, time.monotonic() + 10, cap)
    t.join()
    assert got.kind == "done" and got.result == result
    assert bytes(got.stdout) == out[:cap] and bytes(got.stderr) == err[:cap]
    assert chan.diagnostics.count(b"diagnostic") == muxed.count(_mux(2, b"diagnostic "))
    a.close(), b.close()


def test_channel_outcomes_when_the_stream_ends_or_stalls() -> None:
    req = encode_request(["true"], {}, "/work", 1, 100, b"in", uid=1000, gid=1000)
    for stream, kind in ((b"", "not_accepted"), (_mux(1, _frame(b"A", {}) + _frame(b"O", b"x")), "lost")):
        a, b = socket.socketpair()
        _serve(b, stream, random.Random(0), close=True).join()
        got = SupervisorChannel("e", a, b"").run(req, time.monotonic() + 5, 100)
        assert got.kind == kind, (stream, got)
        a.close(), b.close()
    a, b = socket.socketpair()
    t0 = time.monotonic()
    got = SupervisorChannel("e", a, b"").run(req, time.monotonic() + 0.3, 100)
    assert got.kind == "deadline" and 0.25 < time.monotonic() - t0 < 3
    assert b.recv(1 << 16).startswith(b"R")  # the request (and its stdin) was sent meanwhile
    a.close(), b.close()


def test_request_encoding_rejects_what_the_kernel_cannot_take() -> None:
    argv = ["bash", "-c", "echo 'a\nb'"]
    req = encode_request(argv, {"X": "1 2"}, "/work", 2.5, 99, b"in", uid=1000, gid=7)
    assert req[:1] == b"R" and req.endswith(b"in")
    n = int.from_bytes(req[1:5], "big")
    header = json.loads(req[5 : 5 + n])
    assert header == {"argv": ["bash", "-c", "echo 'a\nb'"], "env": {"X": "1 2"}, "cwd": "/work",
                      "timeout_s": 2.5, "cap": 99, "stdin_len": 2, "stop_at_cap": False, "uid": 1000,
                      "gid": 7}  # fmt: skip
    with pytest.raises(ValueError, match="NUL"):
        encode_request(["a\0b"], {}, "/work", 1, 1, None, uid=1, gid=1)
    with pytest.raises(ValueError, match="environment variable"):
        encode_request(["true"], {"": "x"}, "/work", 1, 1, None, uid=1, gid=1)
    with pytest.raises(ValueError, match="lone surrogates"):
        encode_request(["echo", "\ud800"], {}, "/work", 1, 1, None, uid=1, gid=1)
    file = {"op": "write", "path": "a/b", "mode": 0o600}
    req = encode_request(["write_file", "a/b"], {}, "/work", 1, 1, b"", uid=1, gid=1, file=file)
    assert json.loads(req[5 : 5 + int.from_bytes(req[1:5], "big")])["file"] == file
    for bad in ({"op": "delete", "path": "x"}, {"op": "read"}, {"op": "read", "path": 3}):
        with pytest.raises(ValueError, match="file must be"):
            encode_request(["x"], {}, "/work", 1, 1, None, uid=1, gid=1, file=bad)
    with pytest.raises(ValueError, match="NUL"):
        encode_request(["x"], {}, "/work", 1, 1, None, uid=1, gid=1, file={"op": "read", "path": "a\0b"})


def test_supervisor_file_ops_refuse_special_files_without_blocking(tmp_path) -> None:
    """exec_helper's file copy on the host: it opens without blocking and checks what it opened, so a FIFO
    (with or without a peer), a socket, a device and a directory are refused at once, naming what they are;
    regular files are read and written (parent directories made, mode set)."""
    import stat

    from sandbox import exec_helper

    fifo, sock_path, d = tmp_path / "fifo", tmp_path / "sock", tmp_path / "dir"
    os.mkfifo(fifo)
    d.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        t0 = time.monotonic()
        for path, flags, what in (
            (fifo, os.O_RDONLY, "FIFO"), (fifo, os.O_WRONLY, "FIFO"), (sock_path, os.O_RDONLY, "socket"),
            (sock_path, os.O_WRONLY, "socket"), ("/dev/null", os.O_WRONLY, "character device"),
            ("/dev/zero", os.O_RDONLY, "character device"), (d, os.O_RDONLY, "directory"),
        ):  # fmt: skip
            with pytest.raises(OSError, match=f"is a {what}.*, not a regular file"):
                exec_helper._open_regular(str(path), flags)
        peer = os.open(fifo, os.O_RDWR)  # a FIFO with both ends open is refused too
        with pytest.raises(OSError, match="is a FIFO"):
            exec_helper._open_regular(str(fifo), os.O_WRONLY)
        os.close(peer)
        assert time.monotonic() - t0 < 1
    finally:
        sock.close()

    def run(op: dict, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
        script = (
            "import json, sys\nfrom sandbox import exec_helper\n"
            "sys.exit(exec_helper._file_op(json.loads(sys.argv[1])))"
        )
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = [sys.executable, "-c", script, json.dumps(op)]
        p = subprocess.run(argv, input=stdin, capture_output=True, cwd=root, timeout=30)
        return p.returncode, p.stdout, p.stderr

    target = tmp_path / "new" / "dir" / "f.bin"
    assert run({"op": "write", "path": str(target), "mode": 0o640}, b"\0data")[0] == 0
    assert target.read_bytes() == b"\0data" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert run({"op": "write", "path": str(target), "mode": None}, b"x") == (0, b"", b"")
    assert run({"op": "read", "path": str(target)}) == (0, b"x", b"")
    rc, _, err = run({"op": "read", "path": str(fifo)})
    assert rc == 1 and b"is a FIFO (named pipe), not a regular file" in err and b"use exec" in err
    rc, _, err = run({"op": "read", "path": str(tmp_path / "missing")})
    assert rc == 1 and b"No such file or directory" in err
    assert run({"op": "read", "path": "/dev/null"}) == (0, b"", b"")  # devices are read, without blocking
    master, slave = os.openpty()
    try:
        t0 = time.monotonic()
        rc, _, err = run({"op": "read", "path": os.ttyname(slave)})  # a terminal nobody writes to
        assert rc == 1 and b"nothing to read now" in err and time.monotonic() - t0 < 10
    finally:
        os.close(master), os.close(slave)


def test_supervisor_finds_a_whole_process_tree_and_reads_wait_statuses() -> None:
    """exec_helper's pure parts on the host: descendants() sees double-forked, setsid'ed processes below a
    root (skipping zombies); the keeper's report and wait statuses decode to exit codes."""
    from sandbox import exec_helper

    script = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(30)\n"
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while len(exec_helper.descendants(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = exec_helper.descendants(proc.pid)
        assert len(kids) == 1 and exec_helper.descendants(os.getpid()).count(proc.pid) == 1
    finally:
        proc.kill()
        proc.wait()
        for k in kids:
            os.kill(k, 9)
    assert exec_helper._parse_status(b"status 768\n") == (768, None)
    assert exec_helper._parse_status(b"forkerr 11\n") == (None, 11)
    assert exec_helper._parse_status(b"stat") == (None, None)
    assert exec_helper._parse_status(b"status 12") == (None, None)  # a line is complete at its newline
    assert exec_helper._returncode(3 << 8) == 3 and exec_helper._returncode(9) == 137


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
    # memory the OOM killer cannot free (tmpfs data and inodes, System V shared memory) must leave room
    with pytest.raises(ValueError, match=r"21504 inodes x 2560 bytes .* = 405 MiB.*raise memory or lower"):
        SandboxLimits(memory="256m")


def test_limits_cap_the_inodes_of_every_tmpfs_and_count_their_memory() -> None:
    """Each writable tmpfs gets an inode cap (one per 16 KiB of its size unless given), and the inodes'
    kernel memory counts against the memory limit with the data: data + SysV + inodes + IPC + reserve."""
    from sandbox.container import INODE_BYTES, IPC_MISC_BYTES, PROCESS_RESERVE

    assert SandboxLimits().inode_caps() == {"/work": 16384, "/tmp": 4096, "/dev/shm": 1024}
    small = dict(work_size="16m", tmp_size="8m", shm_size="4m")
    assert SandboxLimits(memory="96m", **small).inode_caps() == {"/work": 1024, "/tmp": 512, "/dev/shm": 256}
    assert SandboxLimits(work_inodes=100, shm_inodes=16).inode_caps() == {"/work": 100, "/tmp": 4096,
                                                                          "/dev/shm": 16}  # fmt: skip
    assert SandboxLimits(memory="1g", shm_size="64k").inode_caps()["/dev/shm"] == 16  # at least a few files
    pinned = (16 + 8 + 4 + 4 << 20) + (1024 + 512 + 256) * INODE_BYTES + IPC_MISC_BYTES
    assert SandboxLimits(memory="96m", **small).pinned_bytes() == pinned
    SandboxLimits(memory=pinned + PROCESS_RESERVE, **small)  # exactly fits
    with pytest.raises(ValueError, match="1792 inodes x 2560 bytes"):
        SandboxLimits(memory=pinned + PROCESS_RESERVE - 1, **small)
    with pytest.raises(ValueError, match="raise memory or lower those sizes"):  # many inodes need memory too
        SandboxLimits(memory="96m", work_inodes=30000, **small)
    for bad in (0, 15, -1, 2.5, "100", True):
        with pytest.raises(ValueError, match=r"SandboxLimits.tmp_inodes must be an int >= 16"):
            SandboxLimits(tmp_inodes=bad)


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
