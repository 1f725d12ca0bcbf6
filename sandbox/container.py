"""`Sandbox`: one hardened Docker container; `exec` in it with a process-tree timeout and capped output.

Hardening (not optional; see docs/sandbox.md for the security model):
    network_mode="none"                       no network interfaces but loopback
    read_only=True + tmpfs /work, /tmp         root filesystem immutable; writable space size-limited, nosuid
    user: execs 1000:1000 (`agent`),           non-root; the keep-alive (pid 1 docker-init + sleep) runs as
          keep-alive 65534 (nobody)            nobody, so the agent can neither kill nor ptrace it
    cap_drop=["ALL"], no-new-privileges        no capabilities, setuid binaries cannot raise privileges
    pids_limit, mem_limit == memswap_limit,    fork bombs, memory bombs (no swap) and CPU hogs stay inside
    nano_cpus, ulimits fsize / nofile
    init=True (docker-init, i.e. tini, as pid 1) reaps orphaned zombies, which would eat the pids limit
    labels odyssey.sandbox / owner_pid / owner_host / owner_start / created / ttl_s   for the reaper

How `exec` works. Each call needs one process started with `docker exec` (the `runc exec` behind it
costs ~40-100 ms: most of a naive exec's latency). So the wrapper below is started *before* the call
(prespawn: right after the container starts and again at the start of every call) and waits on its
stdin for the request; the call then only writes the request and reads the result:

    bash -c WRAPPER       reads  ODYREQ nonce timeout cwd has_stdin env... argv...  (NUL-separated)
        acknowledges with \0ODYACK<nonce>\0 on stdout (a pre-started wrapper killed by the agent sends
        nothing, and the call retries once on a freshly started one: the command never ran twice)
        ODYSSEY_EXEC=nonce timeout -s KILL TIMEOUT argv...   own process group, SIGKILLed as a group
        on timeout: also SIGKILL every process whose environment carries ODYSSEY_EXEC=nonce (setsid escapees)
        ends stdout AND stderr with  \0ODY<nonce>:<rc>:<oom_kills>:<elapsed_us>\0

The host reads the multiplexed stream ([1 byte stream id, 3 pad, 4 byte big-endian length] frames) until
both end markers arrived, so a background process that keeps stdout open does not stall the call, and the
exit code comes with the stream. Output beyond `limits.output_bytes` per stream is read and discarded
(memory stays bounded; the `truncated` flag is set). A host-side deadline (timeout + 2 s) backs up the
in-container timeout. `oom_killed` comes from the container's memory cgroup `oom_kill` counter.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import secrets
import selectors
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import Ulimit
from docker.utils import parse_bytes

from sandbox.client import DAEMON_FIX, docker_client
from sandbox.errors import SandboxCrashed, SandboxError, SandboxUnavailable
from sandbox.image import AGENT_UID, DEFAULT_IMAGE, WORKDIR
from sandbox.reaper import process_start_ticks

HOST_GRACE_S = 2.0  # host-side deadline = timeout_s + this; the in-container `timeout` normally fires first
KEEPER_USER = "65534:65534"  # nobody:nogroup runs the container's keep-alive (docker-init + sleep)
AGENT_USER_SPEC = f"{AGENT_UID}:{AGENT_UID}"  # every exec runs as the agent


def _parse_bytes(size: int | str, name: str = "size") -> int:
    """'512m' -> 536870912 with `docker.utils.parse_bytes` (binary b/k/m/g units, an optional trailing b as
    in "512mb"); ints pass through. A ValueError naming `name` and the accepted forms otherwise."""
    try:
        if isinstance(size, bool) or not isinstance(size, (int, str)):
            raise TypeError(type(size).__name__)
        return int(parse_bytes(size.strip() if isinstance(size, str) else size))
    except (DockerException, TypeError, ValueError, IndexError) as err:
        raise ValueError(
            f"{name} must be a size: bytes as an int, or a number with a b/k/m/g suffix like '256m' or "
            f"'1.5g'; got {size!r}"
        ) from err


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox. Sizes accept ints (bytes) or strings like "512m"."""

    memory: int | str = "512m"  # RAM incl. tmpfs pages; swap disabled (memswap_limit == mem_limit)
    cpus: float = 1.0  # CPU quota (nano_cpus)
    pids: int = 256  # max processes/threads
    work_size: int | str = "256m"  # writable /work tmpfs
    tmp_size: int | str = "64m"  # writable /tmp tmpfs
    shm_size: int | str = "16m"  # /dev/shm
    fsize: int | str = "128m"  # RLIMIT_FSIZE: largest file a process may write
    nofile: int = 1024  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # per-stream cap on captured stdout / stderr
    ttl_s: float = 6 * 3600  # the reaper removes the container after this even if its owner lives

    def __post_init__(self) -> None:
        for name in ("memory", "work_size", "tmp_size", "shm_size", "fsize"):
            if _parse_bytes(getattr(self, name), f"SandboxLimits.{name}") <= 0:
                raise ValueError(
                    f"SandboxLimits.{name} must be a positive size like '256m', got {getattr(self, name)!r}"
                )
        if self.cpus <= 0 or self.pids < 16 or self.nofile < 64 or self.output_bytes < 1 or self.ttl_s <= 0:
            raise ValueError(
                f"invalid SandboxLimits {self}: need cpus > 0, pids >= 16, nofile >= 64, output_bytes >= 1, "
                "ttl_s > 0"
            )


@dataclass
class ExecResult:
    """Outcome of one command. A non-zero exit code is the tool's failure, not an infrastructure error.

    exit_code: the command's status (126/127: not executable/not found; 128+N: killed by signal N;
    137 with timed_out: killed by the timeout). stdout/stderr: UTF-8 (invalid bytes replaced), each at most
    `limits.output_bytes` bytes; truncated: either stream exceeded it. oom_killed: a process of the command
    was killed by the sandbox's memory limit. duration_s: host wall-clock time of the call.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# ------------------------------------------------------------------------------------------------------
# The in-container exec wrapper. It is started (by `docker exec`, stdin attached) before the command is
# known, and reads the request from stdin as NUL-terminated fields:
#     ODYREQ nonce timeout cwd has_stdin n_env env... n_argv argv...
# then acknowledges with \0ODYACK<nonce>\0 on stdout, runs the command, and ends both streams with the
# end marker. Everything after the request on stdin is the command's stdin (when has_stdin is 1).
_WRAPPER = r"""# odyssey-exec-wrapper
IFS= read -r -d '' x || exit 0; [ "$x" = ODYREQ ] || exit 0
IFS= read -r -d '' n; IFS= read -r -d '' t; IFS= read -r -d '' cwd; IFS= read -r -d '' si
IFS= read -r -d '' c; envs=(); for ((i = 0; i < c; i++)); do IFS= read -r -d '' x; envs+=("$x"); done
IFS= read -r -d '' c; argv=(); for ((i = 0; i < c; i++)); do IFS= read -r -d '' x; argv+=("$x"); done
[ ${#envs[@]} -gt 0 ] && argv=(env -- "${envs[@]}" "${argv[@]}")
printf '\0ODYACK%s\0' "$n"
ev=; for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
  if [ -r "$f" ]; then ev=$f; break; fi; done
o0=0; if [ -n "$ev" ]; then while read -r k v; do [ "$k" = oom_kill ] && o0=$v; done < "$ev"; fi
s=${EPOCHREALTIME/./}
if ! cd -- "$cwd"; then rc=126
else
  [ "$si" = 1 ] || exec 0</dev/null
  exec 3>&2 2>/dev/null  # bash's own "Killed" job report goes to /dev/null, the command's stderr to fd 3
  ODYSSEY_EXEC=$n timeout -s KILL "$t" "${argv[@]}" 2>&3 3>&-
  rc=$?
  exec 2>&3 3>&-
fi
e=${EPOCHREALTIME/./}
if [ "$rc" -eq 137 ]; then
  for _ in 1 2 3 4 5; do
    ps=$(grep -lzx "ODYSSEY_EXEC=$n" /proc/[0-9]*/environ 2>/dev/null); [ -n "$ps" ] || break
    for p in $ps; do p=${p#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; done
  done
fi
o1=$o0; if [ -n "$ev" ]; then while read -r k v; do [ "$k" = oom_kill ] && o1=$v; done < "$ev"; fi
printf -v m 'ODY%s:%d:%d:%d' "$n" "$rc" $((o1 - o0)) $((e - s))
printf '\0%s\0' "$m"; printf '\0%s\0' "$m" >&2
"""

# kill every process of one exec (used when the host-side deadline passes)
_SWEEP = r"""for _ in 1 2 3 4 5
do ps=$(grep -lzx "ODYSSEY_EXEC=$1" /proc/[0-9]*/environ 2>/dev/null); [ -n "$ps" ] || break
for p in $ps; do p=${p#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; done; done"""


def _request(
    nonce: str, timeout_s: float, cwd: str, argv: list[str], env: dict[str, str], has_stdin: bool
) -> bytes:
    """The wrapper's request: NUL-terminated fields (argv and env cannot contain NUL: execve forbids it)."""
    envs = [f"{k}={v}" for k, v in env.items()]
    fields = ["ODYREQ", nonce, f"{max(timeout_s, 0.001):.3f}", cwd, "1" if has_stdin else "0"]
    fields += [str(len(envs)), *envs, str(len(argv)), *argv]
    bad = [f for f in fields if "\0" in f]
    if bad:
        raise ValueError(f"command, env and cwd must not contain NUL bytes: {bad[0][:80]!r}")
    for key in env:
        if not key or "=" in key:
            raise ValueError(f"invalid environment variable name {key!r}")
    return b"".join(f.encode() + b"\0" for f in fields)


class _StreamCapture:
    """Collects one output stream up to `cap` bytes, counting (and dropping) the rest, until the end marker.

    Marker: b"\\0ODY" + nonce + b":" + b"rc:oom:us" + b"\\0". Bytes are held back only while they could be
    the beginning of the marker, so memory is O(cap + marker length) whatever the command prints.
    """

    def __init__(self, cap: int, nonce: str) -> None:
        self.cap, self.pre = cap, b"\0ODY" + nonce.encode() + b":"
        self.kept, self.pending, self.total = bytearray(), bytearray(), 0
        self.done = False
        self.marker_fields: list[int] | None = None

    def _commit(self, data: bytes | bytearray) -> None:
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.total += len(data)

    def feed(self, data: bytes | memoryview) -> None:
        if self.done:
            return
        self.pending += data
        idx = self.pending.find(self.pre)
        if idx < 0:
            keep = len(self.pre) - 1  # a marker may start in the last bytes
            if len(self.pending) > keep:
                self._commit(self.pending[: len(self.pending) - keep])
                del self.pending[: len(self.pending) - keep]
            return
        if idx:
            self._commit(self.pending[:idx])
            del self.pending[:idx]
        end = self.pending.find(b"\0", len(self.pre))
        if end < 0:
            return  # the rest of the marker is still on its way
        try:
            self.marker_fields = [int(x) for x in self.pending[len(self.pre) : end].split(b":")]
        except ValueError:  # not our marker after all (cannot happen without the nonce, but be exact)
            self._commit(self.pending[:1])
            del self.pending[:1]
            return self.feed(b"")
        self.done = True

    def finish(self) -> None:
        """EOF without marker: everything held back is output."""
        if not self.done:
            self._commit(self.pending)
            self.pending.clear()

    @property
    def truncated(self) -> bool:
        return self.total > self.cap


def _docker_socket_address() -> tuple[int, str | tuple[str, int]]:
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


def _hijack_exec(exec_id: str, api_version: str, deadline: float) -> tuple[socket.socket, bytes]:
    """POST /exec/{id}/start with `Upgrade: tcp` on a new connection -> (socket, bytes after headers)."""
    family, address = _docker_socket_address()
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
            raise _ExecStartFailed(status, message)
        return sock, rest
    except BaseException:
        sock.close()
        raise


@dataclass
class _Channel:
    """A started exec wrapper waiting for its request: the exec id and its hijacked connection."""

    exec_id: str
    sock: socket.socket
    first: bytes  # stream bytes that arrived with the HTTP response headers

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _close_channel_future(fut) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


class _ExecStartFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# one thread pool for every async twin: asyncio's default executor has only cpu+4 workers,
# and many episodes each block a thread for the length of a command.
_EXECUTOR = ThreadPoolExecutor(
    max_workers=int(os.environ.get("ODYSSEY_SANDBOX_THREADS", "128")), thread_name_prefix="sandbox"
)
_LIVE: set[Sandbox] = set()  # every open sandbox of this process, removed at interpreter exit


def owner_labels(ttl_s: float) -> dict[str, str]:
    """Labels naming this process as the owner (the reaper's input)."""
    pid = os.getpid()
    return {
        "odyssey.sandbox": "1",
        "odyssey.owner_pid": str(pid),
        "odyssey.owner_host": socket.gethostname(),
        "odyssey.owner_start": process_start_ticks(pid),
        "odyssey.created": f"{time.time():.3f}",
        "odyssey.ttl_s": f"{ttl_s:g}",
    }


class Sandbox:
    """One hardened container; created and started by the constructor, removed by `close()`.

    prespawn: keep one exec wrapper started ahead of the next call (default), which takes `runc exec`
    out of the call's latency when the caller pauses between calls (as an agent waiting for its model
    does). False: every call starts its own `docker exec`.

    Thread-compatible, not thread-safe: one caller (one episode) at a time. Async twins run the blocking
    calls on a shared thread pool so many sandboxes progress concurrently under one event loop.
    """

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        limits: SandboxLimits | None = None,
        *,
        labels: dict[str, str] | None = None,
        name: str | None = None,
        prespawn: bool = True,
    ) -> None:
        self.image, self.limits = image, limits or SandboxLimits()
        self.closed = False
        self.prespawn = prespawn
        self._spare: Future | None = None
        self.created_at = time.monotonic()
        lim = self.limits
        client = docker_client()
        self._api = client.api
        self.name = name or f"odyssey-sbx-{os.getpid()}-{secrets.token_hex(4)}"
        tmpfs_opts = "rw,exec,nosuid,nodev"
        try:
            self._cid: str = self._api.create_container(
                image,
                command=["sleep", "infinity"],
                name=self.name,
                user=KEEPER_USER,  # pid 1 and its sleep run as nobody: the agent (1000) cannot kill them
                working_dir=WORKDIR,
                hostname="sandbox",
                labels={**owner_labels(lim.ttl_s), **(labels or {})},
                host_config=self._api.create_host_config(
                    init=True,
                    network_mode="none",
                    read_only=True,
                    tmpfs={
                        WORKDIR: f"{tmpfs_opts},size={_parse_bytes(lim.work_size)},mode=0755,"
                        f"uid={AGENT_UID},gid={AGENT_UID}",
                        "/tmp": f"{tmpfs_opts},size={_parse_bytes(lim.tmp_size)},mode=1777",
                    },
                    shm_size=_parse_bytes(lim.shm_size),
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges:true"],
                    pids_limit=lim.pids,
                    mem_limit=_parse_bytes(lim.memory),
                    memswap_limit=_parse_bytes(lim.memory),
                    nano_cpus=int(lim.cpus * 1e9),
                    ulimits=[
                        Ulimit(name="fsize", soft=_parse_bytes(lim.fsize), hard=_parse_bytes(lim.fsize)),
                        Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                        Ulimit(name="core", soft=0, hard=0),
                    ],
                    oom_score_adj=500,  # under host memory pressure, sandboxes go before the trainer
                ),
            )["Id"]
        except ImageNotFound as err:
            raise SandboxUnavailable(
                f"sandbox image {image} is missing: run `make setup` (or `odyssey sandbox build`"
                f"{'' if image == DEFAULT_IMAGE else ' --tag ' + image})"
            ) from err
        except (APIError, DockerException) as err:
            raise SandboxUnavailable(
                f"cannot create a sandbox container from {image}: {err}; {DAEMON_FIX}"
            ) from err
        _LIVE.add(self)
        try:
            self._api.start(self._cid)
        except (APIError, DockerException) as err:
            self.close()
            raise SandboxUnavailable(
                f"cannot start sandbox container {self.name}: {err}; {DAEMON_FIX}"
            ) from err
        self._start_spare()

    @property
    def id(self) -> str:
        return self._cid

    def __repr__(self) -> str:
        return f"Sandbox({self.name}, image={self.image}{', closed' if self.closed else ''})"

    # ---- state ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Docker's State dict (Running, OOMKilled, ExitCode, Status, ...); {"Status": "removed"} if gone."""
        try:
            return self._api.inspect_container(self._cid)["State"]
        except NotFound:
            return {"Status": "removed", "Running": False}
        except (APIError, DockerException) as err:
            raise SandboxUnavailable(f"cannot inspect sandbox {self.name}: {err}; {DAEMON_FIX}") from err

    def is_alive(self) -> bool:
        """Cheap health check: the container exists and runs."""
        return not self.closed and bool(self.state().get("Running"))

    def _crash_error(self, state: dict | None = None) -> SandboxCrashed:
        st = state if state is not None else self.state()
        if st.get("Status") == "removed":
            return SandboxCrashed(
                f"sandbox {self.name} was removed while in use (reaper or `docker rm`)", "removed"
            )
        if st.get("OOMKilled"):
            return SandboxCrashed(
                f"sandbox {self.name} was killed for memory (limit {self.limits.memory}); raise "
                "SandboxLimits.memory if the task needs more",
                "oom",
            )
        return SandboxCrashed(
            f"sandbox {self.name} is not running (status {st.get('Status')}, exit code {st.get('ExitCode')}, "
            f"error {st.get('Error') or 'none'})",
            "exited",
        )

    def _ensure_open(self) -> None:
        if self.closed:
            raise SandboxError(f"{self!r} is closed; lease a new sandbox")

    # ---- exec ----------------------------------------------------------------------------------------
    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float = 10,
        stdin: bytes | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `cmd` (a string goes to `bash -c`; a list is an argv) as the agent user, in /work by default.

        The whole process tree is SIGKILLed after `timeout_s` (timed_out=True, exit_code=137). Background
        processes that outlive the command are left running (they are part of the sandbox's state).
        Raises `SandboxCrashed` when the container died and `SandboxUnavailable` when the daemon is gone.
        """
        out, err, res = self._exec_bytes(
            cmd, timeout_s, stdin, env=env, cwd=cwd, cap=self.limits.output_bytes
        )
        res.stdout = out.decode("utf-8", errors="replace")
        res.stderr = err.decode("utf-8", errors="replace")
        return res

    def _exec_bytes(
        self,
        cmd: str | list[str],
        timeout_s: float,
        stdin: bytes | None,
        *,
        env: dict[str, str] | None,
        cwd: str | None,
        cap: int,
    ) -> tuple[bytes, bytes, ExecResult]:
        self._ensure_open()
        if not (timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if isinstance(cmd, str):
            argv = ["bash", "-c", cmd]
        elif isinstance(cmd, list | tuple) and cmd and all(isinstance(a, str) for a in cmd):
            argv = list(cmd)
        else:
            raise ValueError(f"cmd must be a non-empty str or list of str, got {cmd!r}")
        nonce = secrets.token_hex(8)
        payload = _request(nonce, timeout_s, cwd or WORKDIR, argv, env or {}, stdin is not None) + (
            stdin or b""
        )
        t0 = time.monotonic()
        deadline = t0 + timeout_s + HOST_GRACE_S
        chan = self._take_spare(deadline)
        self._start_spare()  # the next call's wrapper starts while this command runs
        for _attempt in range(2):
            fresh = chan is None
            if chan is None:
                chan = self._open_channel(deadline)
            outc, errc = _StreamCapture(cap, nonce), _StreamCapture(cap, nonce)
            try:
                outcome = self._pump(chan.sock, chan.first, payload, nonce, outc, errc, deadline)
            finally:
                chan.close()
            if outcome != "dead" or fresh:
                break
            chan = None  # the pre-started wrapper was gone (e.g. the agent killed it): once more, fresh
        duration = time.monotonic() - t0
        outc.finish(), errc.finish()
        fields = outc.marker_fields or errc.marker_fields
        timed_out, oom = outcome == "timeout", False
        if fields is not None:
            rc, oom_kills, elapsed_us = fields
            oom = oom_kills > 0
            timed_out = timed_out or (rc == 137 and elapsed_us >= timeout_s * 1e6 * 0.999)
        else:  # no marker: the deadline passed, the wrapper was killed, or the container died
            state = self.state()
            if not state.get("Running"):
                raise self._crash_error(state)
            if timed_out:
                self._sweep(nonce)
                rc = 137
            else:
                try:
                    rc = self._api.exec_inspect(chan.exec_id).get("ExitCode")
                except (APIError, DockerException):
                    rc = None
                rc = -1 if rc is None else int(rc)
        res = ExecResult(rc, "", "", timed_out, outc.truncated or errc.truncated, duration, oom)
        return bytes(outc.kept), bytes(errc.kept), res

    # ---- exec channels: a started wrapper waiting for its request --------------------------------------
    def _open_channel(self, deadline: float) -> _Channel:
        """`docker exec` the wrapper (stdin attached) and hijack its stream; it waits for a request."""
        try:
            exec_id = self._api.exec_create(
                self._cid,
                ["bash", "-c", _WRAPPER, "odyssey"],
                stdout=True,
                stderr=True,
                stdin=True,
                tty=False,
                user=AGENT_USER_SPEC,
            )["Id"]
        except NotFound as err:
            raise self._crash_error({"Status": "removed"}) from err
        except APIError as err:
            if err.status_code == 409:  # container not running / paused
                raise self._crash_error() from err
            raise SandboxUnavailable(f"exec in {self.name} failed: {err}; {DAEMON_FIX}") from err
        except (DockerException, OSError) as err:
            raise SandboxUnavailable(f"lost the Docker daemon: {err}; {DAEMON_FIX}") from err
        try:
            sock, first = _hijack_exec(exec_id, self._api.api_version, deadline)
        except _ExecStartFailed as fail:
            if fail.status in (404, 409):
                raise self._crash_error() from fail
            raise SandboxUnavailable(f"exec in {self.name} failed to start: {fail}; {DAEMON_FIX}") from fail
        except OSError as err:
            raise SandboxUnavailable(f"lost the Docker daemon during exec: {err}; {DAEMON_FIX}") from err
        return _Channel(exec_id, sock, first)

    def _start_spare(self) -> None:
        """Pre-start the next call's wrapper in the background (hides `runc exec` from the call's latency)."""
        if self.prespawn and not self.closed and self._spare is None:
            self._spare = run_in_sandbox_thread(lambda: self._open_channel(time.monotonic() + 60))

    def _take_spare(self, deadline: float) -> _Channel | None:
        fut, self._spare = self._spare, None
        if fut is None:
            return None
        try:
            return fut.result(timeout=max(deadline - time.monotonic(), 0.1))
        except Exception:  # failed (dead container: the fresh path reports it) or too slow
            fut.add_done_callback(_close_channel_future)
            return None

    @staticmethod
    def _pump(
        sock: socket.socket,
        first: bytes,
        payload: bytes,
        nonce: str,
        outc: _StreamCapture,
        errc: _StreamCapture,
        deadline: float,
    ) -> str:
        """Send the request (+stdin), demultiplex output until both end markers, EOF or the deadline.

        Returns "done" (both markers), "eof" (stream ended without them), "dead" (ended before the
        wrapper acknowledged the request: it never ran it) or "timeout".
        """
        ack = b"\0ODYACK" + nonce.encode() + b"\0"
        pre_ack: bytearray | None = bytearray()  # first stdout bytes, until they are known to be the ack
        acked = False
        sock.setblocking(False)
        sel = selectors.DefaultSelector()
        to_send: memoryview | None = memoryview(payload)
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        buf = bytearray(first)
        try:
            while True:
                pos = 0  # demultiplex every complete frame in buf
                while len(buf) - pos >= 8:
                    stream, size = buf[pos], int.from_bytes(buf[pos + 4 : pos + 8], "big")
                    if len(buf) - pos - 8 < size:
                        break
                    data = memoryview(buf)[pos + 8 : pos + 8 + size]
                    if stream == 1 and pre_ack is not None:
                        pre_ack += data
                        if len(pre_ack) >= len(ack) or not ack.startswith(bytes(pre_ack)):
                            acked = pre_ack.startswith(ack)
                            outc.feed(pre_ack[len(ack) :] if acked else pre_ack)  # not acked: a runtime error
                            pre_ack = None
                    elif stream == 1:
                        outc.feed(data)
                    elif stream == 2:
                        errc.feed(data)
                    del data
                    pos += 8 + size
                if pos:
                    del buf[:pos]
                if outc.done and errc.done:
                    return "done"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                for _key, mask in sel.select(timeout=remaining):
                    if mask & selectors.EVENT_WRITE and to_send is not None:
                        try:
                            n = sock.send(to_send[:262144])
                        except BlockingIOError:
                            n = 0
                        except OSError:  # the wrapper is gone, or the command stopped reading stdin
                            n, to_send = 0, to_send[:0]
                        to_send = to_send[n:]
                        if len(to_send) == 0:
                            try:
                                sock.shutdown(socket.SHUT_WR)  # EOF on the command's stdin
                            except OSError:
                                pass
                            to_send = None
                            sel.modify(sock, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ:
                        try:
                            chunk = sock.recv(262144)
                        except BlockingIOError:
                            continue
                        except OSError:
                            chunk = b""
                        if not chunk:
                            if pre_ack is not None:
                                outc.feed(pre_ack)
                            return "eof" if acked else "dead"
                        buf += chunk
        finally:
            sel.close()

    def _sweep(self, nonce: str) -> None:
        """Host-side fallback: SIGKILL every process of exec `nonce` (best effort)."""
        try:
            exec_id = self._api.exec_create(
                self._cid, ["bash", "-c", _SWEEP, "odyssey", nonce], user=AGENT_USER_SPEC
            )["Id"]
            self._api.exec_start(exec_id)
        except (APIError, DockerException, OSError):
            pass

    # ---- files ---------------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Write `data` (any bytes) to `path` (relative paths are under /work), creating parent dirs.

        Raises PermissionError (read-only location), OSError (e.g. /work full) — tool-level failures.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"write_file needs bytes, got {type(data).__name__}; encode text first")
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"' + (
            f' && chmod {mode:o} -- "$1"' if mode is not None else ""
        )
        _, err, res = self._exec_bytes(
            ["bash", "-c", script, "write_file", path], 60, bytes(data), env=None, cwd=None, cap=1 << 16
        )
        if res.exit_code != 0:
            raise _file_error("write_file", path, err, res)

    def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """Return the bytes of `path` (at most `max_bytes`; larger files raise OSError)."""
        out, err, res = self._exec_bytes(["cat", "--", path], 60, None, env=None, cwd=None, cap=max_bytes)
        if res.exit_code != 0:
            raise _file_error("read_file", path, err, res)
        if res.truncated:
            raise OSError(f"read_file({path!r}): file is larger than max_bytes={max_bytes}")
        return out

    # ---- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the container (force). Idempotent; never raises for an already-gone container."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.add_done_callback(_close_channel_future)
        try:
            self._api.remove_container(self._cid, force=True, v=True)
        except NotFound:
            pass
        except APIError as err:
            if err.status_code != 409 or "already in progress" not in str(err):
                raise SandboxUnavailable(f"cannot remove sandbox {self.name}: {err}; {DAEMON_FIX}") from err
        except (DockerException, OSError) as err:  # daemon gone: the reaper removes it later
            raise SandboxUnavailable(f"cannot remove sandbox {self.name}: {err}; {DAEMON_FIX}") from err

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- async twins ---------------------------------------------------------------------------------
    @classmethod
    async def acreate(cls, image: str = DEFAULT_IMAGE, limits: SandboxLimits | None = None, **kw) -> Sandbox:
        return await _in_thread(lambda: cls(image, limits, **kw))

    async def aexec(
        self,
        cmd: str | list[str],
        timeout_s: float = 10,
        stdin: bytes | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        return await _in_thread(lambda: self.exec(cmd, timeout_s, stdin, env=env, cwd=cwd))

    async def awrite_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        await _in_thread(lambda: self.write_file(path, data, mode))

    async def aread_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        return await _in_thread(lambda: self.read_file(path, max_bytes))

    async def aclose(self) -> None:
        await _in_thread(self.close)


def _file_error(op: str, path: str, err: bytes, res: ExecResult) -> OSError:
    text = err.decode(errors="replace").strip()
    msg = f"{op}({path!r}) failed (exit {res.exit_code}): {text or 'no message'}"
    if "No such file" in text:
        return FileNotFoundError(msg)
    if "Permission denied" in text or "Read-only file system" in text:
        return PermissionError(msg)
    return OSError(msg)


async def _in_thread(fn):
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn)


def run_in_sandbox_thread(fn):
    """Submit `fn` to the sandbox thread pool (used by the pool); returns a concurrent Future."""
    return _EXECUTOR.submit(fn)


@atexit.register
def _remove_live_sandboxes() -> None:
    """Interpreter exit without close(): remove what this process still owns (SIGKILL is the reaper's job)."""
    for sb in list(_LIVE):
        try:
            sb.close()
        except Exception:
            pass
