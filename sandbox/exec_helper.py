"""The exec supervisor: the trusted side of every sandbox, run inside the container as root.

The host starts it once per sandbox (`docker exec -u 0 -w / python3 -I -S -c <loader>`, the source in the
exec's environment, which only root can read) and keeps its
stdin/stdout as a private channel: nothing else writes to that stream, and no agent process can reach the
supervisor (it runs as another uid, so the agent cannot signal it, ptrace it, read its memory or open its
descriptors through /proc). The container grants it exactly three capabilities, CAP_SETUID, CAP_SETGID and
CAP_SETPCAP, which it uses only to start each command as the agent with an empty capability bounding set.
There is no secret: the stream is the authority.

Per command (host -> supervisor):

    b"R" + u32 length + JSON {argv, env, cwd, timeout_s, cap, stdin_len, stop_at_cap, uid, gid[, file]}
    then exactly `stdin_len` bytes, the command's stdin (stdin_len < 0: stdin is /dev/null)

    file (optional): {"op": "read", "path"} or {"op": "write", "path", "mode"}: instead of exec'ing argv, the
    forked command process (already the agent, in cwd) copies the regular file `path` to its stdout, or its
    stdin to `path` (parent directories created, then chmod `mode` unless null). It opens the path with
    O_NONBLOCK and checks fstat on that very descriptor, so a FIFO, socket, device or directory is refused at
    once (exit 1, the reason on stderr) and a path swapped between a check and the open cannot block it.
    Reads accept character devices, read without blocking: /dev/zero runs into the byte cap, a terminal
    with nothing to read fails at once.

Frames (supervisor -> host), each `type (1 byte) + u32 big-endian length + payload`:

    H {"pid"}                once, when the supervisor is ready
    A {"pid"}                the request was read; the command starts now (it runs at most once)
    O bytes / E bytes        the command's stdout / stderr; at most `cap` bytes of each in total
    X {"rc", "timed_out", "capped", "oom_kills", "elapsed_us", "out_bytes", "err_bytes"}   the result

Process tree of one command:

    supervisor (root)
      └─ keeper (root, PR_SET_CHILD_SUBREAPER)        waits for the command; orphans of the command
           └─ command (uid/gid of the agent, setsid,  re-parent to it, so every process the command
              nice +10, oom_score_adj 1000,            started (setsid, double fork) stays in its tree
              no capabilities, fds 0-2 only)           while the command runs

The command's exit is observed by the keeper (waitpid), not announced by anything the command writes, so
its exit code cannot be forged. A ptrace stop is not an exit: a process that makes the keeper its tracer
(PTRACE_TRACEME) and stops is detached at once with its signal, so it stays in the tree, stopped or
running, until it exits or the timeout kills it. Its stdout/stderr are fresh pipes: output written after
the command exited (by background processes) is not read. On timeout (or `stop_at_cap` overflow) every
process in the keeper's tree is SIGKILLed with the supervisor's effective uid switched to the agent's, so a
kill can never reach the supervisor or the container's keep-alive, and needs no fork (a full process table
cannot stop it). The command runs at nice +10, so a CPU hog cannot starve the supervisor that enforces its
timeout.

Stdlib only; must run on the sandbox image's Python (Debian bookworm: 3.11).
"""

import errno
import json
import os
import select
import signal
import stat
import struct
import sys
import time

try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except Exception:  # no ctypes in the image: escaped processes are then only bounded by the lease
    _prctl = None

_HDR = struct.Struct(">cI")
_CHUNK = 1 << 16
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAPBSET_DROP = 24
_PTRACE_DETACH = 17
try:
    _ptrace = ctypes.CDLL(None, use_errno=True).ptrace
    _ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
except Exception:  # no ctypes: a traced process then stays stopped until the timeout kills it
    _ptrace = None
_OOM_FILES = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
_E2BIG_HELP = (
    "the command line and environment are too long for the kernel (E2BIG: at most 128 KiB per argument "
    "and about 2 MiB in total): pass large data on stdin or in a file"
)
_PIDS_HELP = "the sandbox's process limit is exhausted (a fork bomb?); processes must exit first"


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def send(kind, payload=b""):
    """Write one frame to the host (fd 1, which only this process and its keepers hold)."""
    if isinstance(payload, dict):
        payload = json.dumps(payload).encode()
    _write_all(1, _HDR.pack(kind, len(payload)) + payload)


def _read_exact(fd, n):
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def oom_kills():
    """The container's memory cgroup OOM-kill counter (cgroup v2 or v1); 0 when unreadable."""
    for path in _OOM_FILES:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def descendants(root):
    """Pids of every live process below `root`, from /proc/<pid>/stat (the comm field may hold ')').
    Zombies are skipped: they are dead already, only not yet reaped."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            state, ppid = fields[0], int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
        if state not in (b"Z", b"X"):
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _drop_privileges(uid, gid):
    """Become uid/gid with no supplementary groups; setresuid away from root clears every capability."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _drop_bounding_set():
    """Empty the capability bounding set (needs CAP_SETPCAP), so the agent cannot even name a capability
    to regain; no-new-privileges already stops setuid binaries and file capabilities."""
    if _prctl is None:
        return
    for cap in range(64):
        _prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability: ignored


def kill_tree(root, uid):
    """SIGKILL everything below `root`. The supervisor sends the signals with its effective uid set to the
    agent's (real and saved uid stay root, so it can switch back, and the agent still cannot signal or
    ptrace it meanwhile): the kernel then refuses any target that is not the agent's, such as the
    supervisor, the keepers or the container's keep-alive. No fork is needed, so a full process table
    (a fork bomb) cannot stop the kill; each round kills what a fresh scan finds, until nothing is left."""
    for _ in range(500):
        pids = descendants(root)
        if not pids:
            return
        os.setresuid(-1, uid, -1)
        try:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        finally:
            os.setresuid(-1, 0, -1)


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(st_mode):
    for test, name in _FILE_KINDS:
        if test(st_mode):
            return name
    return "not a regular file"


def _open_regular(path, flags, mode=0o666, char_devices=False):
    """Open `path` without blocking (O_NONBLOCK: a FIFO without a peer, a lease) and return the descriptor
    only if fstat on it says regular file (in blocking mode again), or, with `char_devices`, a character
    device (left non-blocking: /dev/zero reads until the caller's cap, a terminal with nothing to read
    fails at once); OSError naming what it is otherwise."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a socket, or a FIFO without a reader opened for writing
            try:
                what = _kind(os.stat(path).st_mode)
            except OSError:
                raise err from None
            raise OSError(errno.ENXIO, f"is {what}, not a regular file") from None
        raise
    st_mode = os.fstat(fd).st_mode
    if char_devices and stat.S_ISCHR(st_mode):
        return fd
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"is {_kind(st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def _file_op(op):
    """In the forked command process, as the agent: copy a regular file (or a character device such as a
    symlink to /dev/zero, read without blocking until the supervisor's byte cap) to stdout ("read"), or
    stdin to a regular file ("write"). Returns the exit code: 0, or 1 with the reason on stderr."""
    path = op["path"]
    try:
        if op["op"] == "read":
            fd = _open_regular(path, os.O_RDONLY, char_devices=True)
            while True:
                try:
                    chunk = os.read(fd, _CHUNK)
                except BlockingIOError:
                    why = "is a character device with nothing to read now (a terminal?), not a regular file"
                    raise OSError(errno.EAGAIN, why) from None
                if not chunk:
                    return 0
                _write_all(1, chunk)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = _open_regular(path, os.O_WRONLY | os.O_CREAT)
        os.ftruncate(fd, 0)
        while True:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                break
            _write_all(fd, chunk)
        if op.get("mode") is not None:
            os.fchmod(fd, int(op["mode"]))
        return 0
    except OSError as err:
        where = f" {err.filename!r}" if err.filename and err.filename != path else ""
        hint = (
            "; read_file/write_file handle regular files only: use exec for pipes and devices"
            if "not a regular file" in str(err.strerror)
            else ""
        )
        os.write(2, f"odyssey: {path!r}{where}: {err.strerror}{hint}\n".encode())
        return 1


def _exec_command(req, stdin_r, out_w, err_w):
    """In the forked command process: new session, fds 0-2 only, become the agent, nice +10, exec (or,
    for a file request, copy the file and exit)."""
    try:
        os.setsid()
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, max(os.sysconf("SC_OPEN_MAX"), 1024))
        try:  # the kernel's OOM killer picks agent processes before the supervisor (which stays at 500)
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        _drop_bounding_set()
        _drop_privileges(req["uid"], req["gid"])
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a command over fsize gets it
        env = dict(os.environ)
        env.update(req["env"])
        argv = req["argv"]
        try:
            os.chdir(req["cwd"])
        except OSError as err:
            os.write(2, f"odyssey: cannot change to directory {req['cwd']!r}: {err.strerror}\n".encode())
            os._exit(126)
        if req.get("file"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past fsize: EFBIG, reported as "File too large"
            os._exit(_file_op(req["file"]))
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as err:
            if err.errno == errno.E2BIG:
                sizes = sorted(len(a.encode()) for a in argv)
                why = f"{_E2BIG_HELP} (largest argument {sizes[-1]} bytes, {sum(sizes)} in total)"
            else:
                why = err.strerror
            os.write(2, f"odyssey: cannot run {argv[0][:200]!r}: {why}\n".encode())
            os._exit(127 if err.errno == errno.ENOENT else 126)
    finally:
        os._exit(126)


def _keeper(req, stdin_r, out_w, err_w, status_w, release_r):
    """In the forked keeper: sub-reaper of the command's tree. Writes `status N` (the command's wait
    status) or `forkerr E`, then waits for the supervisor's release before exiting.

    The keeper lets go of the host stream (fds 0-2 become /dev/null) and never returns into the
    supervisor's loop: whatever happens to it (the supervisor killed under it, its pipes gone), it ends
    with `os._exit`, silently. Only the supervisor speaks on the stream, so nothing the agent provokes in a
    keeper can look like the supervisor's own failure."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        _keep(req, stdin_r, out_w, err_w, status_w, release_r)
    finally:
        os._exit(0)


def _keep(req, stdin_r, out_w, err_w, status_w, release_r):
    if _prctl is not None:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        child = os.fork()
    except OSError as err:
        os.write(status_w, f"forkerr {err.errno}\n".encode())
        return
    if child == 0:
        os.close(status_w)
        os.close(release_r)
        _exec_command(req, stdin_r, out_w, err_w)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    status = int(signal.SIGKILL)  # a wait status "killed by SIGKILL", should the wait below fail
    while True:  # also reaps orphans of the command that exit meanwhile
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if os.WIFSTOPPED(st):  # a ptrace stop (PTRACE_TRACEME made the keeper its tracer): not an exit
            _detach(pid, 0 if os.WSTOPSIG(st) == signal.SIGTRAP else os.WSTOPSIG(st))
            continue
        if pid == child:
            status = st
            break
    try:
        os.write(status_w, f"status {status}\n".encode())
    except OSError:  # the supervisor is gone (e.g. the OOM killer took it): nobody is left to tell
        return
    os.read(release_r, 1)  # stay the tree's sub-reaper until the supervisor has killed what it must


def _detach(pid, sig):
    """Let go of a tracee that chose the keeper as its tracer, delivering the signal it stopped with (a
    SIGSTOP then stops it as if untraced; the SIGTRAP a tracee gets after execve is dropped, as untraced
    processes get none). It stays in the keeper's tree, so the timeout still kills it."""
    if _ptrace is not None:
        _ptrace(_PTRACE_DETACH, pid, None, ctypes.c_void_p(sig))


def _parse_status(text):
    """(wait status or None, fork errno or None) from the complete lines of the keeper's report so far."""
    for line in text.split(b"\n")[:-1]:
        word, _, value = line.partition(b" ")
        if word == b"status" and value:
            return int(value), None
        if word == b"forkerr" and value:
            return None, int(value)
    return None, None


def _returncode(status):
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 126


class _Run:
    """One command: relay stdin/stdout/stderr between the host stream and the command until it exits."""

    def __init__(self, req):
        self.req = req
        self.cap = int(req["cap"])
        self.stdin_left = max(int(req["stdin_len"]), 0)
        self.out_bytes = self.err_bytes = 0
        self.timed_out = self.capped = False
        self.t0 = time.monotonic()
        self.oom0 = oom_kills()

    def run(self):
        req = self.req
        if int(req["stdin_len"]) >= 0:
            stdin_r, stdin_w = os.pipe()
        else:
            stdin_r, stdin_w = os.open(os.devnull, os.O_RDONLY), -1
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        release_r, release_w = os.pipe()
        try:
            keeper = os.fork()
        except OSError:
            for fd in (stdin_r, stdin_w, out_r, out_w, err_r, err_w, status_r, status_w, release_r):
                if fd >= 0:
                    os.close(fd)
            os.close(release_w)
            return self._not_started()
        if keeper == 0:
            for fd in (stdin_w, out_r, err_r, status_r, release_w):
                if fd >= 0:
                    os.close(fd)
            _keeper(req, stdin_r, out_w, err_w, status_w, release_r)
        for fd in (stdin_r, out_w, err_w, status_w, release_r):
            os.close(fd)
        report = self._pump(stdin_w, out_r, err_r, status_r)
        status, fork_errno = _parse_status(report)
        if status is None and fork_errno is None:  # timeout or output cap: kill the tree, then collect
            kill_tree(keeper, req["uid"])
            while True:
                chunk = os.read(status_r, 64)
                report += chunk
                status, fork_errno = _parse_status(report)
                if status is not None or fork_errno is not None or not chunk:
                    break
        for fd, kind in ((out_r, b"O"), (err_r, b"E")):  # what the pipes hold now; later writes are dropped
            for _ in range(64):
                data = _read_some(fd)
                if not data:
                    break
                self._forward(kind, data)
            os.close(fd)
        os.close(release_w)
        os.close(status_r)
        os.waitpid(keeper, 0)
        self._discard_stdin()
        if fork_errno is not None:
            return self._not_started()
        return self._result(137 if status is None else _returncode(status))

    def _not_started(self):
        self._discard_stdin()
        msg = f"odyssey: cannot start the command: {_PIDS_HELP}\n".encode()
        self._forward(b"E", msg)
        return self._result(126)

    def _result(self, rc):
        send(
            b"X",
            {
                "rc": rc,
                "timed_out": self.timed_out,
                "capped": self.capped,
                "oom_kills": max(oom_kills() - self.oom0, 0),
                "elapsed_us": int((time.monotonic() - self.t0) * 1e6),
                "out_bytes": self.out_bytes,
                "err_bytes": self.err_bytes,
            },
        )

    def _discard_stdin(self):
        while self.stdin_left > 0:
            chunk = os.read(0, min(self.stdin_left, 1 << 20))
            if not chunk:
                raise SystemExit(0)  # the host went away
            self.stdin_left -= len(chunk)

    def _forward(self, kind, data):
        if kind == b"O":
            room, self.out_bytes = self.cap - self.out_bytes, self.out_bytes + len(data)
        else:
            room, self.err_bytes = self.cap - self.err_bytes, self.err_bytes + len(data)
        if room > 0:
            send(kind, data[:room])
        if room < len(data) and self.req.get("stop_at_cap"):
            self.capped = True

    def _pump(self, stdin_w, out_r, err_r, status_r):
        """Relay until the keeper reports (returns its report), the deadline passes or the output cap is
        hit with stop_at_cap (returns what was reported so far; the caller kills the tree)."""
        deadline = self.t0 + float(self.req["timeout_s"])
        streams = {out_r: b"O", err_r: b"E"}
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        if stdin_w >= 0:
            os.set_blocking(stdin_w, False)
        pending = bytearray()  # stdin read from the host, not yet taken by the command
        report = b""
        while True:
            status, fork_errno = _parse_status(report)
            if status is not None or fork_errno is not None or self.capped:
                break
            wait = deadline - time.monotonic()
            if wait <= 0:
                self.timed_out = True
                break
            if stdin_w >= 0 and not pending and self.stdin_left == 0:
                os.close(stdin_w)  # EOF on the command's stdin
                stdin_w = -1
            poller = select.poll()
            for fd in streams:
                poller.register(fd, select.POLLIN)
            poller.register(status_r, select.POLLIN)
            if self.stdin_left > 0 and len(pending) < (1 << 20):
                poller.register(0, select.POLLIN)
            if stdin_w >= 0 and pending:
                poller.register(stdin_w, select.POLLOUT)
            for fd, _ev in poller.poll(min(wait, 1.0) * 1000):
                if fd in streams:
                    data = _read_some(fd)
                    if data:
                        self._forward(streams[fd], data)
                    elif data == b"":  # every writer closed it
                        streams.pop(fd)
                elif fd == status_r:
                    chunk = os.read(status_r, 64)
                    report += chunk if chunk else b"status 9\n"  # the keeper died: as if SIGKILLed
                elif fd == 0:
                    chunk = os.read(0, min(self.stdin_left, 1 << 20))
                    if not chunk:
                        raise SystemExit(0)  # the host went away
                    self.stdin_left -= len(chunk)
                    if stdin_w >= 0:
                        pending += chunk
                elif fd == stdin_w and pending:
                    try:
                        del pending[: os.write(stdin_w, pending)]
                    except BlockingIOError:
                        pass
                    except OSError:  # the command closed its stdin: the rest is discarded
                        pending.clear()
                        os.close(stdin_w)
                        stdin_w = -1
        if stdin_w >= 0:
            os.close(stdin_w)
        return report


def _read_some(fd):
    """Up to _CHUNK bytes; b"" at EOF; None when nothing is available now."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return None


def main():
    os.environ.pop("ODYSSEY_SUPERVISOR_SOURCE", None)  # commands inherit this environment
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    send(b"H", {"pid": os.getpid()})
    while True:
        head = _read_exact(0, _HDR.size)
        if head is None:
            return 0
        kind, n = _HDR.unpack(head)
        body = _read_exact(0, n)
        if kind != b"R" or body is None:
            return 2
        send(b"A", {"pid": os.getpid()})
        _Run(json.loads(body)).run()


if __name__ == "__main__":
    sys.exit(main())
