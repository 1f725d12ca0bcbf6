"""A rollout worker starts its sandbox pool when the driver pings it, so container start-up overlaps the
other workers' start-up instead of delaying the first episode (issue 18). Pure scheduling logic, with a
recording pool class in place of SandboxPool; the real pools run in tests/test_rollout_ray.py (Docker)."""

from __future__ import annotations

import asyncio

import pytest

import sandbox.pool
from rl.config import RunConfig
from rl.rollout.worker import RolloutWorker, WorkerSettings


class _NoEngine:
    weight_version = 0


class RecordingPool:
    """Stands in for SandboxPool: start takes a little while (and fails when told to); close is recorded."""

    made: list[RecordingPool] = []
    fail = False

    def __init__(self, size: int, image: str) -> None:
        self.size, self.image, self.started, self.closed = size, image, False, False
        RecordingPool.made.append(self)

    async def start(self) -> None:
        await asyncio.sleep(0.05)
        if RecordingPool.fail:
            raise RuntimeError("docker daemon down")
        self.started = True

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def worker(monkeypatch):
    RecordingPool.made, RecordingPool.fail = [], False
    monkeypatch.setattr(sandbox.pool, "SandboxPool", RecordingPool)
    cfg = RunConfig.model_validate({"env": {"id": "arith"}, "rollout": {"sandbox_pool_size": 2}})
    return RolloutWorker(WorkerSettings.from_config(cfg), engine=_NoEngine())


def test_ping_starts_the_pool_and_the_first_episode_waits_for_it(worker):
    async def go():
        assert await worker.ping() == 0 and await worker.ping() == 0
        await asyncio.sleep(0)  # let the warm-up task begin
        assert len(RecordingPool.made) == 1 and not RecordingPool.made[0].started  # begun, not finished
        await asyncio.gather(worker._ensure_pool(), worker._ensure_pool())  # two first episodes
        pool = RecordingPool.made[0]
        assert worker._pool is pool and pool.started and pool.size == 2
        await worker.ping()  # a later ping starts nothing
        await worker.close()
        assert len(RecordingPool.made) == 1 and pool.closed

    asyncio.run(go())


def test_a_failed_warm_up_reaches_the_first_episode(worker):
    RecordingPool.fail = True

    async def go():
        await worker.ping()
        with pytest.raises(RuntimeError, match="docker daemon down"):
            await worker._ensure_pool()  # as if the episode had started the pool itself
        await worker.close()

    asyncio.run(go())


def test_close_during_the_warm_up_leaks_no_pool(worker):
    async def go():
        await worker.ping()
        await asyncio.sleep(0)
        await worker.close()  # while the pool is still starting
        (pool,) = RecordingPool.made
        assert pool.started and pool.closed and worker._pool is None

    asyncio.run(go())
