"""Run an importable function in a child process with a wall-clock limit, without blocking the event loop.

    value, timed_out = await call_in_child(score_fn, answer, entry, timeout_s=30.0)

Scoring code that the policy's text drives (Math-Verify on `9^{9^{9^9}}`, a reasoning-gym scorer) can run
for minutes inside C code that no signal interrupts. Here it runs in a child Python process
(`python -m envs.child_process`, the parent's sys.path as its PYTHONPATH), where signal-based timeouts
inside the library work too (they need the main thread). Calls go through a small thread pool of
`MAX_CHILDREN` threads, each owning one child started on its first call; a call waits in the pool's queue,
never on the event loop or in asyncio's default thread pool.

Protocol: the parent writes one pickled `(fn, args)` (a function pickles by reference: it must be
importable by module and name) with an 8-byte length prefix to the child's stdin; the child answers
`("ok", value)` or `("error", exception)` the same way on a private copy of its stdout (its own stdout
goes to stderr, so a library's prints cannot corrupt the answer). A call past `timeout_s` kills the
child and returns `(None, True)`; the next call on that thread starts a fresh one. An exception inside
the function is raised here unchanged; a child that dies is a `ChildProcessDied`.

Each child starts in a new session (its own process group, pgid = its pid), and killing it kills the whole
group (`os.killpg`, SIGKILL): a helper the library spawned (Pillow's EPS plugin runs `gs`, a scorer may
run a shell) dies with it instead of being re-parented to init and running on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

MAX_CHILDREN = 2
_HEADER = struct.Struct("<Q")


class ChildProcessDied(RuntimeError):
    """The child process ended while running a call (killed from outside, out of memory, a crash)."""


class _Child:
    """One child process and its pipes; the child leads its own session and process group."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "envs.child_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # pgid = pid: `kill` ends everything the call spawned, too
        )

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[Any, bool]:
        payload = pickle.dumps((fn, args))
        try:
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.kill()  # with whatever it spawned
            raise ChildProcessDied(
                f"the scoring child process is gone (exit code {self.proc.returncode}): {e}"
            ) from e
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.kill()
            return None, True
        header = self.proc.stdout.read(_HEADER.size)
        if len(header) < _HEADER.size:
            self._kill_group()  # whatever it spawned dies with it
            code = self.proc.wait()
            raise ChildProcessDied(f"the scoring child process died (exit code {code}) while running {fn!r}")
        status, value = pickle.loads(self.proc.stdout.read(_HEADER.unpack(header)[0]))
        if status == "error":
            raise value
        return value, False

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pgid(self) -> int:
        """The child's process group (its own pid: it was started in a new session)."""
        return self.proc.pid

    def _kill_group(self) -> None:
        """SIGKILL every process in the child's group, the child included (it may already be gone). Called
        before the child is reaped, so its pid (the group id) cannot have been reused."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Kill the child and every process it spawned (its process group), and reap the child."""
        self._kill_group()
        self.proc.wait()


_local = threading.local()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_children: list[_Child] = []
_lock = threading.Lock()


def _call_blocking(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[Any, bool]:
    child: _Child | None = getattr(_local, "child", None)
    if child is None or not child.alive():
        child = _local.child = _Child()
        with _lock:
            _children.append(child)
    try:
        return child.call(fn, args, timeout_s)
    finally:
        if not child.alive():
            _local.child = None
            with _lock:
                if child in _children:
                    _children.remove(child)


async def call_in_child(fn: Callable[..., Any], *args: Any, timeout_s: float) -> tuple[Any, bool]:
    """`(fn(*args), False)` computed in a child process, or `(None, True)` after `timeout_s` seconds."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                MAX_CHILDREN, thread_name_prefix="odyssey-child"
            )
        executor = _executor
    return await asyncio.get_running_loop().run_in_executor(executor, _call_blocking, fn, args, timeout_s)


def shutdown() -> None:
    """Kill every child process (tests; a process exit closes their pipes and ends them anyway)."""
    with _lock:
        children = list(_children)
        _children.clear()
    for child in children:
        if child.alive():
            child.kill()


def _serve() -> None:
    """The child's loop: read a request, run it, answer; exit when the parent closes stdin."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's own prints go to stderr, never into the answer
    inp = sys.stdin.buffer
    while True:
        header = inp.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        fn, args = pickle.loads(inp.read(_HEADER.unpack(header)[0]))
        try:
            answer = pickle.dumps(("ok", fn(*args)))
        except Exception as e:
            try:
                answer = pickle.dumps(("error", e))
            except Exception:  # an exception that does not pickle: its text
                answer = pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        out.write(_HEADER.pack(len(answer)) + answer)
        out.flush()


if __name__ == "__main__":
    _serve()
