"""`Dispatcher`: one queue of samples, fed by the driver to rollout worker actors as they free up.

    d = Dispatcher(spawn, num_workers=2, slots=4, max_infra_retries=1)
    d.put(samples)                       # rl/rollout/tasks.py Samples; a GRPO group may span workers
    while not d.idle:
        for f in d.poll(timeout=0.5):    # Finished(sample, traj, worker_id, final)
            ...

Each worker holds at most `slots` samples in flight (`actor.run_sample.remote(sample)`; an async actor
runs them concurrently on one batched engine). When one finishes, the next queued sample goes to
whichever worker has a free slot, so no worker idles while another has a backlog (the round-robin
split it replaces waited for the slowest worker).

Failures, and what happens to the sample:
- the episode ended with an infrastructure error (dead sandbox, engine or env crash; the trajectory is
  marked `infra_error`): re-queued at the front with `attempt + 1`, up to `max_infra_retries` times;
  the failed attempt comes back with `final=False`. The last attempt comes back `final=True`, still
  marked, so the learner masks it (never scored 0).
- `run_sample` raised (a bug in scoring or in the worker): handled like an infrastructure error, the
  final attempt becoming an empty trajectory marked with the error.
- the actor died (killed, OOM, node lost): every sample it held is re-queued at the front (same
  attempt: not the sample's fault), the failure is recorded in `failures`, and `spawn(worker_id)`
  starts a replacement, at most `max_restarts` times in all. A sample is finished exactly once: a
  result that never came back is re-run, one that came back is never re-run.

spawn(worker_id) -> (actor, ready): `ready` is an ObjectRef (or None) that resolves when the actor may
take work, e.g. once the current policy weights are loaded (rl/train/weight_sync.py).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rl.rollout.tasks import Sample
from rl.trajectory import Trajectory


class NoWorkersLeft(RuntimeError):
    """Every rollout worker died and max_restarts replacements were used up."""


@dataclass
class Finished:
    """A sample's episode came back. final=False: an infrastructure failure that was re-queued."""

    sample: Sample
    traj: Trajectory
    worker_id: int
    final: bool


@dataclass
class _Worker:
    id: int
    actor: Any
    ready: Any = None  # ObjectRef resolving when the actor may take work; None = ready
    running: dict[Any, Sample] = field(default_factory=dict)  # ObjectRef -> sample


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:400] if text else ''}"


class Dispatcher:
    """See the module docstring. env_id / version_of: label the empty trajectory of a sample whose
    `run_sample` raised on its last attempt. log: where failure lines go."""

    def __init__(
        self,
        spawn: Callable[[int], tuple[Any, Any]],
        num_workers: int,
        slots: int,
        *,
        max_infra_retries: int = 1,
        max_restarts: int = 3,
        env_id: str = "",
        log: Callable[[str], None] = print,
    ):
        if num_workers < 1 or slots < 1:
            raise ValueError(f"need num_workers >= 1 and slots >= 1, got {num_workers}, {slots}")
        self._spawn, self.slots, self.max_infra_retries = spawn, slots, max_infra_retries
        self.max_restarts, self.env_id, self.log = max_restarts, env_id, log
        self.queue: collections.deque[Sample] = collections.deque()
        self.workers: dict[int, _Worker] = {}
        for i in range(num_workers):
            self._start(i)
        self.restarts = 0
        self.infra_retries = 0
        self.failures: list[str] = []

    # ------------------------------------------------------------------ queue
    def put(self, samples: Iterable[Sample], front: bool = False) -> None:
        samples = list(samples)
        if front:
            self.queue.extendleft(reversed(samples))
        else:
            self.queue.extend(samples)

    def in_flight(self) -> list[Sample]:
        return [s for w in self.workers.values() for s in w.running.values()]

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self.queue and not any(w.running for w in self.workers.values())

    def ready_actors(self) -> dict[int, Any]:
        """worker id -> actor, for the workers that can take work now."""
        return {i: w.actor for i, w in self.workers.items() if w.ready is None}

    # ------------------------------------------------------------------ workers
    def _start(self, worker_id: int) -> None:
        actor, ready = self._spawn(worker_id)
        self.workers[worker_id] = _Worker(worker_id, actor, ready)

    def replace(self, worker_id: int, reason: str) -> None:
        """Kill worker `worker_id`, re-queue its samples at the front, start a replacement."""
        import ray

        w = self.workers.pop(worker_id)
        lost = list(w.running.values())
        self.put(lost, front=True)
        msg = f"rollout worker {worker_id} failed ({reason}); {len(lost)} episodes re-queued"
        try:
            ray.kill(w.actor)
        except Exception:  # already gone
            pass
        if self.restarts >= self.max_restarts:
            msg += f"; not replaced (max_restarts={self.max_restarts} reached)"
            self.failures.append(msg)
            self.log(msg)
            if not self.workers:
                raise NoWorkersLeft(f"every rollout worker failed; last: {msg}")
            return
        self.restarts += 1
        self.failures.append(msg + "; replaced by a new actor")
        self.log(self.failures[-1])
        self._start(worker_id)

    def _feed(self) -> None:
        for w in self.workers.values():
            while w.ready is None and self.queue and len(w.running) < self.slots:
                sample = self.queue.popleft()
                w.running[w.actor.run_sample.remote(sample)] = sample

    # ------------------------------------------------------------------ results
    def poll(self, timeout: float = 0.5) -> list[Finished]:
        """Feed free slots, wait up to `timeout` s for results, return the finished episodes."""
        import ray

        self._check_ready()
        self._feed()
        refs = {ref: w for w in self.workers.values() for ref in w.running}
        starting = {w.ready: w for w in self.workers.values() if w.ready is not None}
        if not refs and not starting:
            return []
        done, _ = ray.wait([*refs, *starting], num_returns=1, timeout=timeout)
        if done:  # everything else that is ready too
            done, _ = ray.wait([*refs, *starting], num_returns=len(refs) + len(starting), timeout=0)
        out: list[Finished] = []
        dead: dict[int, str] = {}
        for ref in done:
            if ref in starting:
                continue  # _check_ready handles it
            w = refs[ref]
            if w.id in dead:
                continue
            sample = w.running[ref]
            try:
                traj = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                dead[w.id] = _short(e)
                continue
            except ray.exceptions.RayTaskError as e:  # run_sample raised: a bug, not the policy's doing
                self.log(f"rollout worker {w.id}: episode {sample.key} raised {_short(e)}")
                from rl.rollout.worker import failed_trajectory

                traj = failed_trajectory(f"worker error: {_short(e)}", sample, self.env_id, -1)
            del w.running[ref]
            out.append(self._finished(sample, traj, w.id))
        for worker_id, reason in dead.items():
            self.replace(worker_id, reason)
        self._check_ready()
        self._feed()
        return out

    def _finished(self, sample: Sample, traj: Trajectory, worker_id: int) -> Finished:
        from rewards.compose import infra_error_of

        if infra_error_of(traj) is not None and sample.attempt < self.max_infra_retries:
            self.infra_retries += 1
            self.put([sample.retry()], front=True)
            return Finished(sample, traj, worker_id, final=False)
        return Finished(sample, traj, worker_id, final=True)

    def _check_ready(self) -> None:
        import ray

        for w in list(self.workers.values()):
            if w.ready is None:
                continue
            done, _ = ray.wait([w.ready], timeout=0)
            if not done:
                continue
            try:
                ray.get(w.ready)
                w.ready = None
            except Exception as e:  # the new actor could not start or load the weights
                self.replace(w.id, f"start-up: {_short(e)}")

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker can take work (start-up, weights loaded), replacing failed ones."""
        import ray

        deadline = time.monotonic() + timeout
        while any(w.ready is not None for w in self.workers.values()):
            pending = [w.ready for w in self.workers.values() if w.ready is not None]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(pending)} rollout workers not ready after {timeout:.0f} s")
            ray.wait(pending, num_returns=len(pending), timeout=min(left, 5.0))
            self._check_ready()

    def close(self, timeout: float = 60.0) -> None:
        """Close every worker (engine, sandbox pool) and kill the actors."""
        import ray

        closing = []
        for w in self.workers.values():
            try:
                closing.append(w.actor.close.remote())
            except Exception:
                pass
        if closing:
            try:
                ray.wait(closing, num_returns=len(closing), timeout=timeout)
            except Exception:
                pass
        for w in self.workers.values():
            try:
                ray.kill(w.actor)
            except Exception:
                pass
        self.workers.clear()
