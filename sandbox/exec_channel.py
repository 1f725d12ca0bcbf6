"""The host end of a sandbox's exec supervisor (`sandbox/exec_helper.py`): start it, send one command, read
its frames until the result.

    chan = SupervisorChannel.start(api, container_id, deadline)   # docker exec -u 0 -w / python3 -I -S -c
    outcome = chan.run(encode_request(argv, ...), deadline, cap)  # -> ChannelOutcome
    chan.close()

The supervisor is started once per sandbox (`docker exec` costs ~40-100 ms of `runc exec`; a command over an
open channel costs a few ms) and serves the sandbox's commands one at a time. Its stdout is a stream only it
writes (frames: `type + u32 length + payload`, see exec_helper.py), carried by Docker's multiplexed attach
stream ([1 byte stream id, 3 pad, 4 byte big-endian length] chunks): stream 1 holds the frames, stream 2 the
supervisor's own diagnostics (a Python traceback if it ever crashes).

Outcomes of one `run`:
    done               the X frame arrived: the command's real exit status, flags and output
    not_accepted       the stream ended before the supervisor acknowledged the request: it never ran
                       (e.g. the supervisor was OOM-killed between commands); safe to retry once
    lost               the stream ended after the acknowledgement: the command may have run
    deadline           no result by the host-side deadline (the supervisor is starved or stuck)
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.client import DAEMON_FIX
from sandbox.errors import SandboxUnavailable

SUPERVISOR_SOURCE = (Path(__file__).resolve().parent / "exec_helper.py").read_text()
#: -I -S: no cwd or script dir on sys.path, no site/.pth/sitecustomize, PYTHON* variables ignored. The source
#: travels in the exec's environment (readable by root only), so `ps` shows one short line.
SUPERVISOR_ARGV = [
    "python3", "-I", "-S", "-c",
    "import os; exec(compile(os.environ['ODYSSEY_SUPERVISOR_SOURCE'], 'exec_helper.py', 'exec'))",
    "odyssey-exec-supervisor",
]  # fmt: skip
_FRAME = struct.Struct(">cI")
_DIAG_KEEP = 8192  # bytes of the supervisor's own stderr kept for error messages


class ExecStartFailed(Exception):
    """`POST /exec/{id}/start` answered with an HTTP error (container gone, runtime failure...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class SupervisorKilled(Exception):
    """The supervisor was SIGKILLed before it was ready: the kernel's OOM killer (the agent filled the
    sandbox's memory); not an infrastructure failure."""


def docker_socket_address() -> tuple[int, str | tuple[str, int]]:
    """(address family, address) of the daemon from DOCKER_HOST (unix:// or plain tcp://)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        return socket.AF_UNIX, host[len("unix://") :]
    if host.startswith("tcp://") and not os.environ.get("DOCKER_TLS_VERIFY"):
        hostport = host[len("tcp://") :].rstrip("/")
        name, _, port = hostport.rpartition(":")
        return socket.AF_INET, (name, int(port))
    raise SandboxUnavailable(
        f"DOCKER_HOST={host!r} is not supported by the sandbox exec stream (unix:// or plain tcp:// only): "
        "use the local socket, e.g. unset DOCKER_HOST"
    )


def hijack_exec(exec_id: str, api_version: str, deadline: float) -> tuple[socket.socket, bytes]:
    """POST /exec/{id}/start with `Upgrade: tcp` on a new connection -> (socket, bytes after headers)."""
    family, address = docker_socket_address()
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.5))
        sock.connect(address)
        body = b'{"Detach":false,"Tty":false}'
        head = (
            f"POST /v{api_version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
            f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise SandboxUnavailable(f"the Docker daemon closed the exec stream early; {DAEMON_FIX}")
            buf += chunk
        header, rest = buf.split(b"\r\n\r\n", 1)
        status = int(header.split(b" ", 2)[1])
        if status not in (101, 200):
            length = 0
            for line in header.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            try:
                message = json.loads(rest.decode() or "{}").get("message", rest.decode())
            except ValueError:
                message = rest.decode(errors="replace")
            raise ExecStartFailed(status, message)
        return sock, rest
    except BaseException:
        sock.close()
        raise


def encode_request(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    timeout_s: float,
    cap: int,
    stdin: bytes | None,
    *,
    uid: int,
    gid: int,
    stop_at_cap: bool = False,
    file: dict | None = None,
) -> bytes:
    """The R frame of one command, followed by its stdin. ValueError for text the kernel cannot take.

    file: {"op": "read", "path"} or {"op": "write", "path", "mode"}: the supervisor copies a regular file
    instead of running argv (see exec_helper.py), refusing FIFOs, sockets, devices and directories at once."""
    for key in env:
        if not key or "=" in key:
            raise ValueError(f"invalid environment variable name {key!r}")
    if file is not None and (
        file.get("op") not in ("read", "write")
        or not isinstance(file.get("path"), str)
    ):
        raise ValueError(f"file must be {{'op': 'read' or 'write', 'path': str}}, got {file!r}")
    fields = [*argv, cwd, *env, *env.values(), *([file["path"]] if file else [])]
    for f in fields:
        if "\0" in f:
            raise ValueError(f"command, env, cwd and path must not contain NUL bytes: {f[:80]!r}")
        try:
            f.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"command, env, cwd and path must be valid Unicode text (no lone surrogates): {f[:80]!r}"
            ) from None
    header = {
        "argv": argv,
        "env": env,
        "cwd": cwd,
        "timeout_s": max(float(timeout_s), 0.001),
        "cap": int(cap),
        "stdin_len": -1 if stdin is None else len(stdin),
        "stop_at_cap": bool(stop_at_cap),
        "uid": int(uid),
        "gid": int(gid),
    }
    if file is not None:
        header["file"] = file
    body = json.dumps(header).encode()
    return _FRAME.pack(b"R", len(body)) + body + (stdin or b"")


@dataclass
class ChannelOutcome:
    """What one `SupervisorChannel.run` observed (see the module docstring for `kind`)."""

    kind: str
    result: dict | None = None  # the X frame: rc, timed_out, capped, oom_kills, elapsed_us, out/err_bytes
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)


class SupervisorChannel:
    """An open stream to one sandbox's exec supervisor. Not thread-safe: one command at a time."""

    def __init__(self, exec_id: str, sock: socket.socket, first: bytes) -> None:
        self.exec_id, self.sock = exec_id, sock
        self.pid: int | None = None
        self._raw = bytearray(first)  # Docker-multiplexed bytes not yet demultiplexed
        self._frames = bytearray()  # stream-1 bytes not yet parsed into frames
        self.diagnostics = bytearray()  # stream 2: the supervisor's own stderr (last _DIAG_KEEP bytes)
        self.closed = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    def start(cls, api, container_id: str, deadline: float) -> SupervisorChannel:
        """`docker exec` the supervisor as root in `/` and wait for its hello frame.

        Raises the Docker SDK's errors from exec_create, `ExecStartFailed`, OSError, or SandboxUnavailable
        when the supervisor exits before it is ready (its stderr is in the message).
        """
        exec_id = api.exec_create(
            container_id,
            SUPERVISOR_ARGV,
            stdout=True,
            stderr=True,
            stdin=True,
            tty=False,
            user="0:0",
            workdir="/",
            environment={"ODYSSEY_SUPERVISOR_SOURCE": SUPERVISOR_SOURCE},
        )["Id"]
        sock, first = hijack_exec(exec_id, api.api_version, deadline)
        chan = cls(exec_id, sock, first)
        try:
            kind, payload = chan._next_frame(deadline)
        except BaseException:
            chan.close()
            raise
        if kind != b"H":
            chan.close()
            why = chan.diagnostics.decode(errors="replace").strip()[-2000:] or "no output"
            try:
                code = api.exec_inspect(exec_id).get("ExitCode")
            except Exception:
                code = None
            if code == 137 and not why.startswith("Traceback"):
                raise SupervisorKilled(f"the sandbox's exec supervisor was SIGKILLed while starting: {why}")
            raise SandboxUnavailable(f"the sandbox's exec supervisor did not start (exit {code}): {why}")
        chan.pid = int(json.loads(payload)["pid"])
        return chan

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    # ---- one command -----------------------------------------------------------------------------------
    def run(self, request: bytes, deadline: float, cap: int) -> ChannelOutcome:
        """Send `request` (from `encode_request`) and collect frames until the result (see ChannelOutcome).

        stdout/stderr are kept up to `cap` bytes each (the supervisor already caps them; this bounds host
        memory even if it did not).
        """
        out = ChannelOutcome("lost")
        accepted = False
        to_send: memoryview | None = memoryview(request)
        self.sock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        try:
            while True:
                for kind, payload in self._parsed_frames():
                    if kind == b"A":
                        accepted = True
                    elif kind == b"O":
                        out.stdout += payload[: max(cap - len(out.stdout), 0)]
                    elif kind == b"E":
                        out.stderr += payload[: max(cap - len(out.stderr), 0)]
                    elif kind == b"X":
                        out.kind, out.result = "done", json.loads(payload)
                        return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    out.kind = "deadline"
                    return out
                for _key, mask in sel.select(timeout=remaining):
                    if mask & selectors.EVENT_WRITE and to_send is not None:
                        try:
                            n = self.sock.send(to_send[:262144])
                        except BlockingIOError:
                            n = 0
                        except OSError:  # the supervisor is gone: the read side reports it
                            n, to_send = 0, to_send[:0]
                        to_send = to_send[n:]
                        if len(to_send) == 0:
                            to_send = None
                            sel.modify(self.sock, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ:
                        try:
                            chunk = self.sock.recv(262144)
                        except BlockingIOError:
                            continue
                        except OSError:
                            chunk = b""
                        if not chunk:
                            self.closed = True
                            out.kind = "lost" if accepted else "not_accepted"
                            return out
                        self._raw += chunk
        finally:
            sel.close()

    # ---- framing ---------------------------------------------------------------------------------------
    def _demux(self) -> None:
        """Move complete Docker chunks from _raw: stream 1 -> _frames, stream 2 -> diagnostics."""
        pos = 0
        raw = self._raw
        while len(raw) - pos >= 8:
            stream, size = raw[pos], int.from_bytes(raw[pos + 4 : pos + 8], "big")
            if len(raw) - pos - 8 < size:
                break
            data = raw[pos + 8 : pos + 8 + size]
            if stream == 1:
                self._frames += data
            elif stream == 2:
                self.diagnostics += data
                del self.diagnostics[:-_DIAG_KEEP]
            pos += 8 + size
        if pos:
            del raw[:pos]

    def _parsed_frames(self) -> list[tuple[bytes, bytes]]:
        self._demux()
        frames, buf, pos = [], self._frames, 0
        while len(buf) - pos >= _FRAME.size:
            kind, size = _FRAME.unpack_from(buf, pos)
            if len(buf) - pos - _FRAME.size < size:
                break
            frames.append((kind, bytes(buf[pos + _FRAME.size : pos + _FRAME.size + size])))
            pos += _FRAME.size + size
        if pos:
            del buf[:pos]
        return frames

    def _next_frame(self, deadline: float) -> tuple[bytes, bytes]:
        """Block (until `deadline`) for one frame; (b"", b"") when the stream ends first."""
        self.sock.setblocking(True)
        while True:
            frames = self._parsed_frames()
            if frames:
                if len(frames) > 1:  # keep the rest for later (cannot happen before the hello)
                    rest = b"".join(_FRAME.pack(k, len(p)) + p for k, p in frames[1:])
                    self._frames[:0] = rest
                return frames[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxUnavailable("the sandbox's exec supervisor did not answer in time")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return b"", b""
            self._raw += chunk
