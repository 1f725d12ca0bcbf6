"""`Sandbox`: one hardened Docker container; `exec` in it with a process-tree timeout and capped output.

Hardening (not optional; see docs/sandbox.md for the security model and the threat model):
    network_mode="none"                       no network interfaces but loopback
    read_only=True + tmpfs /work, /tmp,        root filesystem immutable; writable space size- and inode-
      /dev/shm                                 limited (SandboxLimits' memory arithmetic), nosuid
    user: commands 1000:1000 (`agent`),        non-root; the keep-alive (pid 1 docker-init + sleep) and the
          keep-alive and supervisor root       exec supervisor run as root: the agent can neither signal,
                                               ptrace nor open the descriptors of either
    cap_drop=["ALL"] + SETUID/SETGID/SETPCAP   the supervisor's only capabilities, to start commands as the
    no-new-privileges                          agent; agent processes hold none (bounding set empty) for good
    pids_limit, mem_limit == memswap_limit,    fork bombs, memory bombs (no swap) and CPU hogs stay inside
    nano_cpus, ulimits fsize / nofile
    init=True (docker-init, i.e. tini, as pid 1) reaps orphaned zombies, which would eat the pids limit
    labels odyssey.sandbox / owner_pid / owner_host / owner_start / created / ttl_s   for the reaper

How `exec` works. A `docker exec` costs ~40-100 ms of `runc exec`, so each sandbox runs one exec supervisor
(`sandbox/exec_helper.py`, started as root right after the container starts) and every command is one
request on its private stream (`sandbox/exec_channel.py`): the supervisor forks a keeper (sub-reaper of the
command's process tree) that starts the command as the agent, relays stdin/stdout/stderr through fresh
pipes, and reports the exit status the keeper observed with waitpid. Nothing the agent runs can write to
that stream or learn anything secret (there is none), so exit codes and output boundaries cannot be forged.
Output beyond `limits.output_bytes` per stream is counted and discarded (`truncated`); on timeout the whole
tree, including `setsid`, double-fork and ptrace-stopped escapees, is SIGKILLed; a host-side deadline
(timeout + 2 s) backs it up. `read_file`/`write_file` are `file` requests the supervisor carries out itself,
refusing FIFOs, sockets and directories without blocking.
`oom_killed` comes from the container's memory cgroup `oom_kill` counter.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import secrets
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import Ulimit
from docker.utils import parse_bytes

from sandbox.client import DAEMON_FIX, docker_client
from sandbox.errors import SandboxCrashed, SandboxError, SandboxUnavailable
from sandbox.exec_channel import ExecStartFailed, SupervisorChannel, SupervisorKilled, encode_request
from sandbox.image import AGENT_UID, DEFAULT_IMAGE, WORKDIR
from sandbox.oom_counter import OomCounter
from sandbox.reaper import process_start_ticks

FILE_TIMEOUT_S = 30.0  # default time limit of read_file / write_file (special files fail at once)
HOST_GRACE_S = 2.0  # host-side deadline = timeout_s + this; the supervisor's own timeout normally fires first
KEEPER_USER = "0:0"  # root runs the keep-alive (docker-init + sleep) and the exec supervisor, never the agent
#: the container's only capabilities, held by the supervisor alone: to start each command as the agent with an
#: empty bounding set (agent processes hold none: setresuid clears them, no-new-privileges stops regaining)
SUPERVISOR_CAPS = ["SETUID", "SETGID", "SETPCAP"]
AGENT_USER_SPEC = f"{AGENT_UID}:{AGENT_UID}"  # every command runs as the agent
_NO_ROOM = (
    "the sandbox's process limit or memory is exhausted (a fork bomb? files in /work and /tmp count against "
    "the memory limit); processes must exit or files be removed first"
)

_OOM_NOTE = (
    b"\n[odyssey: the sandbox ran out of memory during this command and the kernel's OOM killer ended the "
    b"exec supervisor; the command's result is lost. Files in /work, /tmp and /dev/shm and shared memory "
    b"count against the memory limit: remove them or end the processes holding memory]\n"
)


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


#: memory left for processes (the exec supervisor and the agent's commands) when every tmpfs, every inode and
#: every System V shared-memory segment is full: the agent cannot fill the sandbox with memory the OOM killer
#: cannot free
PROCESS_RESERVE = 32 << 20
#: kernel memory one tmpfs inode slot can pin at most, measured (see `SandboxLimits`): ~1.5 KiB for an empty
#: file with a 255-byte name, ~2.1 KiB for the xattrs one slot of "inode space" can hold; 2.5 KiB with margin
INODE_BYTES = 2560
#: default inode cap of a tmpfs: one inode per this many bytes of its size
BYTES_PER_INODE = 16 << 10
#: the smallest inode cap a tmpfs may have (a handful of files and directories)
MIN_INODES = 16
#: the other kernel objects that outlive their creator, bounded by `ipc_sysctls`: 8 POSIX queues of at most
#: 10 x 8 KiB, 8 System V queues of 16 KiB, 1000 semaphores (well under 1 MiB in all)
IPC_MISC_BYTES = 1 << 20
#: the writable tmpfs mounts: mount point -> (size field, inode cap field) of SandboxLimits
TMPFS_MOUNTS = {
    WORKDIR: ("work_size", "work_inodes"),
    "/tmp": ("tmp_size", "tmp_inodes"),
    "/dev/shm": ("shm_size", "shm_inodes"),
}


def ipc_sysctls(limits: SandboxLimits) -> dict[str, str]:
    """The sandbox IPC namespace's limits. System V objects outlive the process that made them, so each
    kind is bounded: shared memory to `shm_size` in all (and removed when its last user detaches or
    exits: shm_rmid_forced), message queues to 8 x 16 KiB, semaphores to 1000, POSIX queues to 8."""
    shm = _parse_bytes(limits.shm_size)
    return {
        "kernel.shm_rmid_forced": "1",
        "kernel.shmmax": str(shm),
        "kernel.shmall": str(max(shm // 4096, 1)),  # pages
        "kernel.shmmni": "64",
        "kernel.msgmni": "8",
        "kernel.msgmnb": "16384",
        "kernel.msgmax": "8192",
        "kernel.sem": "250 1000 32 16",  # per set, in all, per semop, sets
        "fs.mqueue.queues_max": "8",
    }


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox. Sizes accept ints (bytes) or strings like "512m".

    Memory the OOM killer cannot free, because it outlives every process of the agent, must leave
    `PROCESS_RESERVE` (32 MiB) of `memory` to processes, so that whatever the agent leaves behind, the exec
    supervisor and a normal command still run. Checked here, with this arithmetic (`pinned_bytes`):

        data      work_size + tmp_size + shm_size     the tmpfs pages of /work, /tmp and /dev/shm
      + SysV      shm_size                            System V shared memory (kernel.shmall)
      + inodes    (work_inodes + tmp_inodes + shm_inodes) x INODE_BYTES
      + IPC       IPC_MISC_BYTES (1 MiB)              POSIX and System V queues, semaphores
      + PROCESS_RESERVE                              <= memory

    Inode memory is kernel memory (inode, dentry, name, xattrs) charged to the sandbox's memory cgroup but
    not to any tmpfs `size`, so each tmpfs also gets `nr_inodes`: `*_inodes`, by default one inode per 16 KiB
    of its size (`BYTES_PER_INODE`). Measured on Linux 6.18 (cgroup v1, memory.usage_in_bytes, 50,000
    items): an empty file costs 0.96 KiB with a short name, 1.2 KiB with a 200-byte name, 1.48 KiB with a
    255-byte name; a directory 1.2 KiB. tmpfs also charges user xattrs to an "inode space" of 1 KiB per
    inode of `nr_inodes` (each inode takes 1 KiB of it), and xattrs of 1000-byte values pin 2.1 KiB of
    memory per KiB of that space (kmalloc rounds 1040 bytes up to 2048). So one inode slot pins at most
    ~2.1 KiB; `INODE_BYTES` counts 2.5 KiB. Hard links take an inode slot each. /dev/mqueue holds at most 8
    queues; the root filesystem, /dev and the files Docker binds into /etc are read-only to the agent.

    Defaults (512m): 256 + 64 + 16 (data) + 16 (SysV) + (16384 + 4096 + 1024) x 2.5 KiB = 52.5 (inodes)
    + 1 (IPC) + 32 (reserve) = 437.5 MiB <= 512 MiB. The test limits (256m, /work 64m, /tmp 16m):
    64 + 16 + 16 + 16 + (4096 + 1024 + 1024) x 2.5 KiB = 15 + 1 + 32 = 160 MiB <= 256 MiB. Before the
    caps, 65,536 inodes per tmpfs (and an unbounded /dev/shm) could pin ~95 MiB each beyond the sizes,
    enough to OOM-kill every later command at 256m and at 512m.
    """

    memory: int | str = "512m"  # RAM incl. tmpfs pages and inodes; swap disabled (memswap_limit == mem_limit)
    cpus: float = 1.0  # CPU quota (nano_cpus)
    pids: int = 256  # max processes/threads
    work_size: int | str = "256m"  # writable /work tmpfs
    tmp_size: int | str = "64m"  # writable /tmp tmpfs
    shm_size: int | str = "16m"  # /dev/shm tmpfs, and System V shared memory in all
    fsize: int | str = "128m"  # RLIMIT_FSIZE: largest file a process may write
    nofile: int = 1024  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # per-stream cap on captured stdout / stderr
    ttl_s: float = 6 * 3600  # the reaper removes the container after this even if its owner lives
    work_inodes: int | None = None  # files + directories + links in /work; None: work_size / 16 KiB
    tmp_inodes: int | None = None  # in /tmp; None: tmp_size / 16 KiB
    shm_inodes: int | None = None  # in /dev/shm; None: shm_size / 16 KiB

    def __post_init__(self) -> None:
        for name in ("memory", "work_size", "tmp_size", "shm_size", "fsize"):
            if _parse_bytes(getattr(self, name), f"SandboxLimits.{name}") <= 0:
                raise ValueError(
                    f"SandboxLimits.{name} must be a positive size like '256m', got {getattr(self, name)!r}"
                )
        for _size, field_name in TMPFS_MOUNTS.values():
            n = getattr(self, field_name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < MIN_INODES):
                raise ValueError(
                    f"SandboxLimits.{field_name} must be an int >= {MIN_INODES} (files, directories and "
                    f"links in that mount) or None for one per {BYTES_PER_INODE >> 10} KiB of its size; "
                    f"got {n!r}"
                )
        pinned = self.pinned_bytes()
        if pinned + PROCESS_RESERVE > _parse_bytes(self.memory):
            inodes = sum(self.inode_caps().values())
            raise ValueError(
                f"SandboxLimits: work_size + tmp_size + 2 x shm_size (/dev/shm and System V shared memory) + "
                f"{inodes} inodes x {INODE_BYTES} bytes + {IPC_MISC_BYTES >> 20} MiB of IPC = "
                f"{pinned >> 20} MiB, which leaves less than {PROCESS_RESERVE >> 20} MiB of memory "
                f"({self.memory!r}) to processes once the agent fills them; raise memory or lower those "
                "sizes (or the *_inodes caps)"
            )
        if self.cpus <= 0 or self.pids < 16 or self.nofile < 64 or self.output_bytes < 1 or self.ttl_s <= 0:
            raise ValueError(
                f"invalid SandboxLimits {self}: need cpus > 0, pids >= 16, nofile >= 64, output_bytes >= 1, "
                "ttl_s > 0"
            )

    def inode_caps(self) -> dict[str, int]:
        """The `nr_inodes` of each writable tmpfs: {"/work": n, "/tmp": n, "/dev/shm": n}."""
        caps = {}
        for mount, (size, field_name) in TMPFS_MOUNTS.items():
            n = getattr(self, field_name)
            caps[mount] = n if n is not None else max(_parse_bytes(getattr(self, size)) // BYTES_PER_INODE,
                                                      MIN_INODES)  # fmt: skip
        return caps

    def pinned_bytes(self) -> int:
        """The most memory the agent can leave behind beyond the OOM killer's reach (see the class doc)."""
        data = sum(_parse_bytes(getattr(self, size)) for size, _n in TMPFS_MOUNTS.values())
        inodes = sum(self.inode_caps().values()) * INODE_BYTES
        return data + _parse_bytes(self.shm_size) + inodes + IPC_MISC_BYTES


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

    prespawn: start the sandbox's exec supervisor in the background as soon as the container runs
    (default), so the first call does not wait for `runc exec` + Python start-up; False: the first call
    starts it. Either way later calls reuse it (a command costs a few ms, not a `docker exec`).

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
        self._chan: SupervisorChannel | None = None
        self._chan_future: Future | None = None
        self.created_at = time.monotonic()
        lim = self.limits
        client = docker_client()
        self._api = client.api
        self.name = name or f"odyssey-sbx-{os.getpid()}-{secrets.token_hex(4)}"
        inodes = lim.inode_caps()
        try:
            self._cid: str = self._api.create_container(
                image,
                command=["sleep", "infinity"],
                name=self.name,
                user=KEEPER_USER,  # pid 1 and its sleep run as root: the agent (1000) cannot signal them
                working_dir=WORKDIR,
                hostname="sandbox",
                labels={**owner_labels(lim.ttl_s), **(labels or {})},
                host_config=self._api.create_host_config(
                    init=True,
                    network_mode="none",
                    read_only=True,
                    tmpfs={  # every writable mount: a size and an inode cap (SandboxLimits' arithmetic)
                        WORKDIR: f"rw,exec,nosuid,nodev,nr_inodes={inodes[WORKDIR]},"
                        f"size={_parse_bytes(lim.work_size)},mode=0755,uid={AGENT_UID},gid={AGENT_UID}",
                        "/tmp": f"rw,exec,nosuid,nodev,nr_inodes={inodes['/tmp']},"
                        f"size={_parse_bytes(lim.tmp_size)},mode=1777",
                        # replaces Docker's own /dev/shm mount (shm_size), which has no inode cap
                        "/dev/shm": f"rw,noexec,nosuid,nodev,nr_inodes={inodes['/dev/shm']},"
                        f"size={_parse_bytes(lim.shm_size)},mode=1777",
                    },
                    ipc_mode="private",  # its own IPC namespace, so the sysctls below are the sandbox's own
                    sysctls=ipc_sysctls(lim),
                    cap_drop=["ALL"],
                    cap_add=SUPERVISOR_CAPS,
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
        self._oom = OomCounter(self._api, self._cid)
        try:
            self._api.start(self._cid)
        except (APIError, DockerException) as err:
            self.close()
            raise SandboxUnavailable(
                f"cannot start sandbox container {self.name}: {err}; {DAEMON_FIX}"
            ) from err
        if prespawn:
            self._chan_future = run_in_sandbox_thread(lambda: self._start_supervisor(time.monotonic() + 60))

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
        stop_at_cap: bool = False,
        file: dict | None = None,
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
        request = encode_request(
            argv, env or {}, cwd or WORKDIR, timeout_s, cap, stdin,
            uid=AGENT_UID, gid=AGENT_UID, stop_at_cap=stop_at_cap, file=file,
        )  # fmt: skip
        t0 = time.monotonic()
        deadline = t0 + timeout_s + HOST_GRACE_S
        oom_before = self._oom.count()
        for _attempt in range(2):
            chan = self._supervisor(deadline)
            if chan is None:  # no supervisor and none can start: the agent filled processes or memory
                msg = f"odyssey: cannot start the command: {_NO_ROOM}\n".encode()
                return b"", msg, ExecResult(126, "", "", duration_s=time.monotonic() - t0)
            outcome = chan.run(request, deadline, cap)
            if outcome.kind == "done":
                break
            self._drop_supervisor()
            if outcome.kind != "not_accepted":  # the command may have run: never run it twice
                break
        duration = time.monotonic() - t0
        out, err = bytes(outcome.stdout), bytes(outcome.stderr)
        if outcome.kind == "done":
            x = outcome.result or {}
            truncated = x["out_bytes"] > cap or x["err_bytes"] > cap or bool(x["capped"])
            oom = x["oom_kills"] > 0
            return out, err, ExecResult(int(x["rc"]), "", "", bool(x["timed_out"]), truncated, duration, oom)
        state = self.state()  # no result: did the container die?
        if not state.get("Running"):
            raise self._crash_error(state)
        if outcome.kind == "deadline":  # the supervisor is starved or stuck: stop everything of the agent
            self._kill_all_agent_processes(chan)
            return out, err, ExecResult(137, "", "", True, False, duration)
        # The supervisor is gone. Whose fault is decided from the memory cgroup's OOM-kill counter, which only
        # the kernel moves, never from what the supervisor (or a process the agent starved) printed.
        oom_after = self._oom.count()
        diag = chan.diagnostics.decode(errors="replace")
        if oom_before is not None and oom_after is not None:
            if oom_after > oom_before:  # the agent filled the memory: its failure, scored
                if outcome.kind == "not_accepted":  # killed twice before taking the request: it never ran
                    msg = f"odyssey: cannot start the command: {_NO_ROOM}\n".encode()
                    return out, err + msg, ExecResult(126, "", "", duration_s=duration, oom_killed=True)
                return out, err + _OOM_NOTE, ExecResult(137, "", "", False, False, duration, True)
            raise SandboxError(  # lost without running out of memory: only our machinery can do that
                f"the exec supervisor of sandbox {self.name} was lost ({outcome.kind}) while the sandbox had "
                f"memory to spare (no OOM kill); its diagnostics:\n{diag[-2000:] or '(none)'}"
            )
        # no OOM counter could be read (see sandbox/oom_counter.py): judge by the supervisor's own report
        if "Traceback" in diag:  # our supervisor crashed: an infrastructure failure, never the agent's
            raise SandboxError(f"the exec supervisor of sandbox {self.name} crashed:\n{diag[-2000:]}")
        if outcome.kind == "not_accepted":
            msg = f"odyssey: cannot start the command: {_NO_ROOM}\n".encode()
            return out, err + msg, ExecResult(126, "", "", duration_s=duration)
        return out, err + _OOM_NOTE, ExecResult(137, "", "", False, False, duration)

    # ---- the exec supervisor: started once per sandbox, reused by every call --------------------------
    def _start_supervisor(self, deadline: float) -> SupervisorChannel | None:
        """Start the supervisor; None when the agent's processes leave no room for it (the process table is
        full, or it was SIGKILLed while starting: the sandbox is out of memory)."""
        try:
            return SupervisorChannel.start(self._api, self._cid, deadline)
        except NotFound as err:
            raise self._crash_error({"Status": "removed"}) from err
        except APIError as err:
            if err.status_code == 409:  # container not running / paused
                raise self._crash_error() from err
            if _pids_exhausted(str(err)):
                return None
            raise SandboxUnavailable(f"exec in {self.name} failed: {err}; {DAEMON_FIX}") from err
        except ExecStartFailed as fail:
            if fail.status in (404, 409):
                raise self._crash_error() from fail
            if _pids_exhausted(fail.message):
                return None
            raise SandboxUnavailable(f"exec in {self.name} failed to start: {fail}; {DAEMON_FIX}") from fail
        except SupervisorKilled:  # e.g. the agent filled the memory: its own failure, not infrastructure
            state = self.state()
            if not state.get("Running"):
                raise self._crash_error(state) from None
            return None
        except SandboxUnavailable as err:
            state = self.state()
            if not state.get("Running"):
                raise self._crash_error(state) from err
            if _pids_exhausted(str(err)):
                return None
            raise
        except (DockerException, OSError) as err:
            raise SandboxUnavailable(f"lost the Docker daemon: {err}; {DAEMON_FIX}") from err

    def _supervisor(self, deadline: float) -> SupervisorChannel | None:
        if self._chan is not None and not self._chan.closed:
            return self._chan
        fut, self._chan_future = self._chan_future, None
        chan = None
        if fut is not None:
            try:
                chan = fut.result(timeout=max(deadline - time.monotonic(), 0.1))
            except Exception:  # failed or too slow: a fresh start below reports the reason
                fut.add_done_callback(_close_channel_future)
        if chan is None or chan.closed:
            chan = self._start_supervisor(deadline)
        self._chan = chan
        return chan

    def _drop_supervisor(self) -> None:
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()

    def _kill_all_agent_processes(self, chan: SupervisorChannel) -> None:
        """Host-side fallback when the supervisor misses the deadline: kill it and every agent process."""
        kill = ["bash", "-c", 'kill -9 -- "$1"', "kill"]  # the shell's builtin: the image has no /bin/kill
        for user, argv in ((KEEPER_USER, [*kill, str(chan.pid)]), (AGENT_USER_SPEC, [*kill, "-1"])):
            try:
                exec_id = self._api.exec_create(self._cid, argv, user=user)["Id"]
                self._api.exec_start(exec_id)
            except (APIError, DockerException, OSError):
                pass

    # ---- files ---------------------------------------------------------------------------------------
    def write_file(
        self, path: str, data: bytes, mode: int | None = None, *, timeout_s: float = FILE_TIMEOUT_S
    ) -> None:
        """Write `data` (any bytes) to `path` (relative paths are under /work), creating parent dirs; then
        chmod it to `mode` if given.

        Only regular files are written: a FIFO, socket, device or directory at `path` raises OSError naming
        it at once (the supervisor opens the path without blocking and checks what it opened). Raises
        PermissionError (read-only location), FileNotFoundError, OSError (e.g. /work full, a file over
        `limits.fsize`) and TimeoutError (after `timeout_s`) — tool-level failures.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"write_file needs bytes, got {type(data).__name__}; encode text first")
        if mode is not None and (type(mode) is not int or not 0 <= mode <= 0o7777):
            raise ValueError(f"write_file mode must be an int permission like 0o644, got {mode!r}")
        _, err, res = self._exec_bytes(
            ["write_file", path], timeout_s, bytes(data), env=None, cwd=None, cap=1 << 16,
            file={"op": "write", "path": path, "mode": mode},
        )  # fmt: skip
        if res.exit_code != 0 or res.timed_out:
            raise _file_error("write_file", path, err, res, timeout_s)

    def read_file(self, path: str, max_bytes: int = 64 << 20, *, timeout_s: float = FILE_TIMEOUT_S) -> bytes:
        """Return the bytes of the regular file `path` (relative paths are under /work).

        A file larger than `max_bytes` raises OSError as soon as the limit is passed (an endless device such
        as a symlink to /dev/zero fails fast; devices are read without blocking, so a terminal with nothing
        to read fails at once). A FIFO, socket or directory raises OSError naming it at once, never blocks;
        a read that takes longer than `timeout_s` raises TimeoutError. FileNotFoundError / PermissionError
        as usual."""
        out, err, res = self._exec_bytes(
            ["read_file", path], timeout_s, None, env=None, cwd=None, cap=max_bytes, stop_at_cap=True,
            file={"op": "read", "path": path},
        )  # fmt: skip
        if res.truncated:
            raise OSError(f"read_file({path!r}): file larger than {max_bytes} bytes")
        if res.exit_code != 0 or res.timed_out:
            raise _file_error("read_file", path, err, res, timeout_s)
        return out

    # ---- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the container (force). Idempotent; never raises for an already-gone container."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        self._drop_supervisor()
        fut, self._chan_future = self._chan_future, None
        if fut is not None:
            fut.add_done_callback(_close_channel_future)
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

    async def awrite_file(
        self, path: str, data: bytes, mode: int | None = None, *, timeout_s: float = FILE_TIMEOUT_S
    ) -> None:
        await _in_thread(lambda: self.write_file(path, data, mode, timeout_s=timeout_s))

    async def aread_file(
        self, path: str, max_bytes: int = 64 << 20, *, timeout_s: float = FILE_TIMEOUT_S
    ) -> bytes:
        return await _in_thread(lambda: self.read_file(path, max_bytes, timeout_s=timeout_s))

    async def aclose(self) -> None:
        await _in_thread(self.close)


def _pids_exhausted(message: str) -> bool:
    """Does a runtime error say that no process could be created (the pids cgroup is full)?"""
    text = message.lower()
    return "resource temporarily unavailable" in text or "pids" in text and "limit" in text


def _close_channel_future(fut) -> None:
    if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().close()


def _file_error(op: str, path: str, err: bytes, res: ExecResult, timeout_s: float) -> OSError:
    if res.timed_out:
        return TimeoutError(
            f"{op}({path!r}) timed out after {timeout_s:g} s; pass a larger timeout_s if the file is that big"
        )
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
