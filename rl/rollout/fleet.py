"""The rollout fleet: Ray, the RolloutWorker actors, and the Dispatcher that feeds them. One place for the
start-up sequence `odyssey rollout` (rl/rollout/cli.py), `odyssey train` (rl/train/loop.py) and
`odyssey eval` (rl/train/eval.py) share.

    fleet = RolloutFleet(num_cpus=4)                                # joins RAY_ADDRESS or starts Ray
    spawn = worker_spawner(settings, {"num_cpus": 1})               # worker_id -> (actor, ready ref)
    dispatcher = fleet.launch(spawn, num_workers=4, concurrency=8, env_id="arith", log=print)
    results = fleet.run_samples(samples)                            # {sample key: trajectory}
    fleet.close()                                                   # actors, then Ray if we started it

Ray: with RAY_ADDRESS set (`ray job submit`, or RAY_ADDRESS=auto) the fleet joins that cluster; otherwise
it starts an embedded one (RAY_AUTH_MODE=disabled, no dashboard, at least `num_cpus` logical CPUs, the
repo on the workers' PYTHONPATH) and shuts it down on close.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl.rollout.dispatch import Dispatcher
from rl.rollout.tasks import Sample
from rl.rollout.worker import RolloutWorker, WorkerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]

Spawn = Callable[[int], tuple[Any, Any]]  # worker_id -> (actor, object ref that resolves once it is ready)


def init_ray(num_cpus: int) -> bool:
    """Join RAY_ADDRESS (set by `ray job submit`, or by hand: RAY_ADDRESS=auto) or start an embedded Ray
    with at least `num_cpus` logical CPUs; True when we started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # always a new embedded cluster (never silently join a `ray start` one)
        num_cpus=max(os.cpu_count() or 1, num_cpus),
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
            }
        },
    )
    return True


def worker_spawner(
    settings: WorkerSettings,
    options: dict[str, Any],
    worker_cls: type = RolloutWorker,
    ready: Callable[[Any], Any] | None = None,
    actor_factory: Callable[[int], Any] | None = None,
) -> Spawn:
    """worker_id -> (a `worker_cls` Ray actor on `settings` with actor `options`, its ready ref). The driver
    stores the trajectories, so actors get no store_dir. ready(actor): the ref that resolves once the actor
    can take work (default: `actor.ping`). actor_factory(worker_id) -> actor replaces the default actor."""
    import ray

    actor_settings = dataclasses.replace(settings, store_dir=None)
    if actor_factory is None:
        cls = ray.remote(worker_cls).options(**{"max_restarts": 0, **options})

        def actor_factory(i: int) -> Any:
            return cls.remote(actor_settings, i)

    def spawn(i: int) -> tuple[Any, Any]:
        actor = actor_factory(i)
        return actor, (ready(actor) if ready is not None else actor.ping.remote())

    return spawn


class RolloutFleet:
    """Ray (joined, or embedded and owned: `started_ray`) and, once launched, the workers' Dispatcher."""

    def __init__(self, num_cpus: int) -> None:
        self.started_ray = init_ray(num_cpus)
        self.dispatcher: Dispatcher | None = None

    def launch(
        self,
        spawn: Spawn,
        num_workers: int,
        concurrency: int,
        *,
        env_id: str,
        log: Callable[[str], None],
        max_infra_retries: int = 1,
        max_restarts: int | None = None,
    ) -> Dispatcher:
        """Start `num_workers` actors by `spawn` (they come up in the background) behind one Dispatcher, at
        most `concurrency` episodes in flight each; `max_restarts` dead workers replaced in all (default:
        one per worker)."""
        self.dispatcher = Dispatcher(
            spawn,
            num_workers,
            concurrency,
            max_infra_retries=max_infra_retries,
            max_restarts=num_workers if max_restarts is None else max_restarts,
            env_id=env_id,
            log=log,
        )
        return self.dispatcher

    def run_samples(
        self, samples: list[Sample], on_other: Any = None, timeout: float = 0.5
    ) -> dict[str, Any]:
        """`run_samples` on this fleet's dispatcher."""
        assert self.dispatcher is not None, "launch the fleet first"
        return run_samples(self.dispatcher, samples, on_other, timeout)

    def close(self) -> None:
        """Close the dispatcher (its actors), then shut Ray down if this fleet started it."""
        try:
            if self.dispatcher is not None:
                self.dispatcher.close()
        finally:
            if self.started_ray:
                import ray

                ray.shutdown()


def run_samples(
    dispatcher: Dispatcher, samples: list[Sample], on_other: Any = None, timeout: float = 0.5
) -> dict[str, Any]:
    """Play `samples` first (front of the queue) and wait for all of them; finished episodes of other
    samples (training ones still in flight) go to `on_other`. Returns {sample key: trajectory}."""
    wanted = {s.key for s in samples}
    got: dict[str, Any] = {}
    dispatcher.put(samples, front=True)
    while len(got) < len(wanted):
        for f in dispatcher.poll(timeout):
            if f.sample.key in wanted:
                if f.final:
                    got[f.sample.key] = f.traj
            elif on_other is not None:
                on_other(f)
    return got


__all__ = ["REPO_ROOT", "RolloutFleet", "Spawn", "init_ray", "run_samples", "worker_spawner"]
