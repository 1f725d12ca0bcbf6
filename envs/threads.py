"""Blocking calls into code that may hang (your agent, verifier or task function, a wrapped env's step) run
on a thread of their own, never on a shared pool, and never on the event loop's default executor.

    result = await run_in_own_thread(env.agent, client, task, timeout_s=300, what="agent")

Why: `asyncio.to_thread` puts work on the loop's default executor, min(32, cpus + 4) threads shared by
everything in the process. Agents that block there (waiting on the policy, or forever) took every thread,
and the engine's decode step, queued behind them, never ran: every episode timed out, scored 0.

Each call starts a fresh daemon thread, so any number of calls run at once (their callers bound how many:
a rollout worker plays at most `rollout.concurrent_episodes` episodes) and a call that never returns holds
only its own thread. After `timeout_s` the caller gets `OwnThreadTimeout` and goes on; the thread is
abandoned, because Python cannot kill a thread: it runs until its function returns, then ends. Abandoned
threads still running ("hung") are logged, counted (`hung_threads()`; a worker's `progress()` reports
them), and bounded: with `MAX_HUNG_THREADS` of them alive, new calls raise `HungThreadsError` naming them
and the fix, instead of leaking threads without end; calls start again as soon as hung ones return.

Odyssey's own blocking work has executors of its own, which nothing here touches: the engine steps on
its own thread (TorchEngine, VllmEngine), a rollout worker writes its store and loads weights on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

MAX_HUNG_THREADS = 64  # per process; each holds a thread's stack and whatever its function holds

T = TypeVar("T")


class OwnThreadTimeout(TimeoutError):
    """The call ran past its `timeout_s`; its thread was abandoned (it runs on until it returns)."""


class HungThreadsError(RuntimeError):
    """Too many abandoned threads are still running to start another one."""


@dataclass(frozen=True)
class HungThread:
    """A call that ran past its timeout and whose thread is still running."""

    thread: str
    what: str
    function: str
    overdue_s: float


@dataclass(frozen=True)
class _Call:
    thread: threading.Thread
    what: str
    function: str
    deadline: float | None  # time.monotonic() past which the call is abandoned; None: never


class OwnThreads:
    """Runs each call on a new daemon thread (see the module docstring); `max_hung` bounds the abandoned
    threads still running."""

    def __init__(self, max_hung: int = MAX_HUNG_THREADS, prefix: str = "odyssey") -> None:
        if max_hung < 1:
            raise ValueError(f"max_hung must be >= 1, got {max_hung}")
        self.max_hung, self.prefix = int(max_hung), prefix
        self._lock = threading.Lock()
        self._live: dict[int, _Call] = {}
        self._ids = itertools.count()

    def hung(self) -> list[HungThread]:
        """The calls past their timeout whose threads are still running, most overdue first."""
        now = time.monotonic()
        with self._lock:
            calls = [c for c in self._live.values() if c.deadline is not None and now > c.deadline]
        out = [HungThread(c.thread.name, c.what, c.function, round(now - c.deadline, 3)) for c in calls]
        return sorted(out, key=lambda h: -h.overdue_s)

    def live_threads(self) -> list[threading.Thread]:
        """Every thread started here that has not returned yet (hung or not)."""
        with self._lock:
            return [c.thread for c in self._live.values()]

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None, what: str) -> T:
        """`fn(*args)` on a new thread; OwnThreadTimeout after `timeout_s` seconds (None: no limit).

        `what` names the caller's kind of code ("agent", "verifier", ...) in thread names and errors. An
        exception `fn` raises is raised here (a BaseException that is not an Exception, as RuntimeError)."""
        hung = self.hung()
        if len(hung) >= self.max_hung:
            shown = ", ".join(f"{h.what} {h.function} ({h.overdue_s:.0f} s over)" for h in hung[:3])
            raise HungThreadsError(
                f"{len(hung)} abandoned threads are still running past their timeouts ({shown}, ...); "
                "Python cannot kill a thread, so no more are started until they return. Fix the code that "
                "hangs (make it return, e.g. give its blocking calls timeouts), or restart the worker"
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        key = next(self._ids)
        function = getattr(fn, "__qualname__", None) or repr(fn)

        def body() -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
                error = e if isinstance(e, Exception) else RuntimeError(f"{what} {function} raised {e!r}")
            finally:
                with self._lock:
                    call = self._live.pop(key, None)
            if call is not None and call.deadline is not None and time.monotonic() > call.deadline:
                log.warning("%s %s (thread %s) returned after its timeout", what, function, call.thread.name)
            try:
                loop.call_soon_threadsafe(_settle, done, value, error)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                pass

        thread = threading.Thread(target=body, name=f"{self.prefix}-{what}-{key}", daemon=True)
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        with self._lock:
            self._live[key] = _Call(thread, what, function, deadline)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._live.pop(key, None)
            raise
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            if not done.cancelled():  # fn's own TimeoutError, not ours
                raise
            log.warning(
                "%s %s ran past its timeout of %g s; its thread %s is abandoned and runs on (%d hung)",
                what, function, timeout_s, thread.name, len(self.hung()),
            )
            raise OwnThreadTimeout(f"{what} {function} ran past its timeout of {timeout_s:g} s") from None


def _settle(done: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if done.done():  # timed out or cancelled: the caller has gone on
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(value)


OWN_THREADS = OwnThreads()


async def run_in_own_thread(fn: Callable[..., T], *args: Any, timeout_s: float | None, what: str) -> T:
    """`OWN_THREADS.run(fn, *args, timeout_s=..., what=...)`: the process's one registry of such threads."""
    return await OWN_THREADS.run(fn, *args, timeout_s=timeout_s, what=what)


def hung_threads() -> list[HungThread]:
    """This process's abandoned threads that are still running."""
    return OWN_THREADS.hung()
