"""`SandboxPool`: warm sandboxes handed out one per trajectory, never reused dirty.

Lifecycle of one container:

    background creator ──create+start──► ready (warm) ──lease()──► leased (one trajectory) ──exit──► removed
                                            │ health check fails (dead, or older than ttl/2)  ──────► removed

- `size` warm containers are kept ready. Taking one immediately schedules its replacement, so a burst of
  leases beyond `size` waits only for creations already under way (about 0.2-1 s each).
- Leaving a lease (normally, by exception, or by task cancellation) removes the container in the
  background; the next trajectory always gets a fresh one.
- Health check on hand-out: one `inspect` (is it running?) — a dead warm container is replaced, not leased.
- The reaper (`sandbox.reaper`) runs at `start` and every `reap_interval_s` in a background thread.

Sync and async: the pool is implemented with threads (a lock + condition, a small creator thread pool).
The async API (`await start()`, `async with lease()`, `await close()`) runs the same blocking methods on the
sandbox thread pool, so sync callers (`start_sync`, `with lease_sync()`, `close_sync`) and async callers
can share one pool, from any thread or event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager

from sandbox.container import Sandbox, SandboxLimits, run_in_sandbox_thread
from sandbox.errors import SandboxError, SandboxUnavailable
from sandbox.image import DEFAULT_IMAGE, image_exists
from sandbox.reaper import reap, start_background_reaper


class SandboxPool:
    """Keeps `size` hardened sandboxes warm; `lease()` scopes one to one trajectory.

    size: warm containers kept ready (>= 1). image/limits: as for `Sandbox`.
    reap_interval_s: period of the background reaper. create_workers: concurrent container creations.
    acquire_timeout_s: how long a lease waits for a container before raising `SandboxUnavailable`.
    """

    def __init__(
        self,
        size: int = 4,
        image: str = DEFAULT_IMAGE,
        limits: SandboxLimits | None = None,
        *,
        reap_interval_s: float = 60.0,
        create_workers: int = 2,
        acquire_timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"SandboxPool size must be >= 1, got {size}")
        self.size, self.image, self.limits = size, image, limits or SandboxLimits()
        self.reap_interval_s, self.acquire_timeout_s = reap_interval_s, acquire_timeout_s
        self.pool_id = f"{os.getpid()}-{secrets.token_hex(3)}"
        self._cv = threading.Condition()
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._leased: set[Sandbox] = set()
        self._creating = 0
        self._failures = 0
        self._last_error: BaseException | None = None
        self._started = self._closed = False
        self._creator = ThreadPoolExecutor(
            max_workers=create_workers, thread_name_prefix=f"pool-{self.pool_id}"
        )
        self._removals: set[Future] = set()
        self.stats = {"created": 0, "leased": 0, "removed": 0, "unhealthy": 0, "create_failures": 0}

    def __repr__(self) -> str:
        return (
            f"SandboxPool(size={self.size}, image={self.image}, ready={len(self._ready)}, "
            f"leased={len(self._leased)}, creating={self._creating})"
        )

    # ---- sync API ------------------------------------------------------------------------------------
    def start_sync(self, wait: bool = True) -> SandboxPool:
        """Check the image, reap leftovers, start the background reaper, fill the pool (wait for it)."""
        if self._closed:
            raise SandboxError("this SandboxPool is closed; create a new one")
        if not image_exists(self.image):
            raise SandboxUnavailable(
                f"sandbox image {self.image} is missing: run `make setup` (or `odyssey sandbox build`)"
            )
        reap()
        start_background_reaper(self.reap_interval_s)
        with self._cv:
            self._started = True
            self._refill_locked()
            failures0 = self._failures
            deadline = time.monotonic() + self.acquire_timeout_s
            while wait and len(self._ready) < self.size:
                if self._failures > failures0 and self._creating == 0:
                    raise SandboxUnavailable(f"the pool could not create sandboxes: {self._last_error}")
                if not self._cv.wait(timeout=max(deadline - time.monotonic(), 0.01)):
                    if time.monotonic() >= deadline:
                        raise SandboxUnavailable(
                            f"the pool did not fill {self.size} sandboxes in {self.acquire_timeout_s:.0f} s; "
                            "is the Docker daemon overloaded? (try a smaller size)"
                        )
        return self

    def acquire_sync(self, timeout_s: float | None = None) -> Sandbox:
        """Take a healthy warm sandbox (waits for one if none is ready). Pair with `release`."""
        if not self._started:
            raise SandboxError(
                "SandboxPool is not started: call `pool.start_sync()` or `await pool.start()` first"
            )
        timeout_s = self.acquire_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cv:
                failures0 = self._failures
                while not self._ready:
                    if self._closed:
                        raise SandboxError("this SandboxPool is closed")
                    if self._failures > failures0 and self._creating == 0:  # all attempts since entry failed
                        raise SandboxUnavailable(f"the pool cannot create sandboxes: {self._last_error}")
                    self._refill_locked()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise SandboxUnavailable(
                            f"no sandbox became ready within {timeout_s:.0f} s ({self!r}); "
                            "the Docker daemon may be overloaded: lower concurrency or raise the pool size"
                        )
                    self._cv.wait(timeout=remaining)
                if self._closed:
                    raise SandboxError("this SandboxPool is closed")
                sb = self._ready.popleft()
            healthy = self._healthy(sb)
            with self._cv:
                self._refill_locked()  # the replacement starts now, while this one is in use
                if healthy:
                    self._leased.add(sb)
                    self.stats["leased"] += 1
                    return sb
                self.stats["unhealthy"] += 1
            self._remove_in_background(sb)

    def release(self, sb: Sandbox) -> None:
        """End a lease: the container is removed in the background (never handed out again). Non-blocking."""
        with self._cv:
            self._leased.discard(sb)
        self._remove_in_background(sb)

    @contextmanager
    def lease_sync(self, timeout_s: float | None = None) -> Iterator[Sandbox]:
        """`with pool.lease_sync() as sb:` — one fresh sandbox for one trajectory."""
        sb = self.acquire_sync(timeout_s)
        try:
            yield sb
        finally:
            self.release(sb)

    def close_sync(self) -> None:
        """Remove every container of this pool (warm, leased, being created) and wait until they are gone."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            doomed = list(self._ready) + list(self._leased)
            self._ready.clear()
            self._leased.clear()
            self._cv.notify_all()
        for sb in doomed:
            self._remove_in_background(sb)
        self._creator.shutdown(wait=True)  # in-flight creations see _closed and remove what they made
        for fut in list(self._removals):
            try:
                fut.result(timeout=60)
            except Exception:
                pass

    def __enter__(self) -> SandboxPool:
        return self.start_sync()

    def __exit__(self, *exc: object) -> None:
        self.close_sync()

    # ---- async API -----------------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> SandboxPool:
        return await asyncio.wrap_future(run_in_sandbox_thread(lambda: self.start_sync(wait)))

    @asynccontextmanager
    async def lease(self, timeout_s: float | None = None) -> AsyncIterator[Sandbox]:
        """`async with pool.lease() as sb:` — as `lease_sync`, awaiting instead of blocking.

        Cancelling the waiting task cannot leak: a sandbox acquired after the cancellation is released.
        """
        fut = run_in_sandbox_thread(lambda: self.acquire_sync(timeout_s))
        try:
            sb = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._release_if_acquired)
            raise
        try:
            yield sb
        finally:
            self.release(sb)

    def _release_if_acquired(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())

    async def close(self) -> None:
        await asyncio.wrap_future(run_in_sandbox_thread(self.close_sync))

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- internals -----------------------------------------------------------------------------------
    @property
    def n_ready(self) -> int:
        return len(self._ready)

    @property
    def n_leased(self) -> int:
        return len(self._leased)

    def _healthy(self, sb: Sandbox) -> bool:
        if time.monotonic() - sb.created_at > self.limits.ttl_s / 2:
            return False  # recycle before the reaper's TTL could hit it mid-trajectory
        try:
            return sb.is_alive()
        except SandboxError:
            return False

    def _refill_locked(self) -> None:
        """Schedule creations until ready + creating == size (caller holds the lock)."""
        if self._closed or not self._started:
            return
        for _ in range(self.size - len(self._ready) - self._creating):
            self._creating += 1
            self._creator.submit(self._create_one)

    def _create_one(self) -> None:
        try:
            sb = Sandbox(self.image, self.limits, labels={"odyssey.pool": self.pool_id})
        except BaseException as err:
            with self._cv:
                self._creating -= 1
                self._failures += 1
                self.stats["create_failures"] += 1
                self._last_error = err
                self._cv.notify_all()
            return
        with self._cv:
            self._creating -= 1
            self.stats["created"] += 1
            if not self._closed:
                self._ready.append(sb)
                self._last_error = None
                self._cv.notify_all()
                return
        sb.close()  # pool closed while we were creating

    def _remove_in_background(self, sb: Sandbox) -> None:
        """Remove `sb` on the sandbox thread pool; in this thread when that pool cannot take work: at
        interpreter exit, where a lease left open is finalized after `atexit` removed its container (then
        there is nothing left to do) or while modules are being torn down (the thread pool's module globals
        are None: submitting raised TypeError, printed as "Exception ignored")."""

        def remove() -> None:
            try:
                sb.close()
            except SandboxError:
                pass  # daemon down: the reaper removes it later
            with self._cv:
                self.stats["removed"] += 1

        if sb.closed or sys.is_finalizing():
            try:
                remove()
            except Exception:  # noqa: BLE001 - interpreter teardown: the reaper removes what is left
                pass
            return
        try:
            fut = run_in_sandbox_thread(remove)
        except Exception:  # noqa: BLE001 - shutting down: executors refuse work (RuntimeError) or are gone
            try:
                remove()
            except Exception:  # noqa: BLE001 - as above: the reaper is the backstop
                pass
            return
        self._removals.add(fut)
        fut.add_done_callback(self._removals.discard)


_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool(size: int | None = None) -> SandboxPool:
    """A process-wide started pool (size from `size`, else ODYSSEY_SANDBOX_POOL_SIZE, else 2).

    For callers that were given no pool (e.g. `envs.make(id)` without `sandbox_pool`). Closed at exit.
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            n = size or int(os.environ.get("ODYSSEY_SANDBOX_POOL_SIZE", "2"))
            pool = SandboxPool(n)
            pool.start_sync(wait=False)
            _default_pool = pool
        return _default_pool


@atexit.register
def _close_default_pool() -> None:
    if _default_pool is not None:
        try:
            _default_pool.close_sync()
        except Exception:
            pass
