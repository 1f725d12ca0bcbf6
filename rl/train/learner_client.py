"""`LearnerClient`: the driver's handle on the learner (`rl.learner.group.LearnerGroup` on Ray); the driver
holds no model.

    client = LearnerClient(cfg)          # learner.num_ranks ranks with orchestrator.learner_resources
    fut = client.step(trajectories)      # non-blocking: the learner trains while rollouts continue
    metrics = client.result(fut)         # {"loss", "grad_norm", "tokens", ...}
    ref = client.weights()               # ObjectRef of rank 0's state_dict: put once, fetched by N workers
    client.save(dir); client.load(dir)   # learner state (model safetensors, optimizer, scheduler, RNG...)

The learner is a `LearnerGroup` (N `LearnerRank` actors joined by torch.distributed, each holding
a `rl.learner.Learner`). This module only adapts it to the loop:

- placement: the ranks get every resource of `orchestrator.learner_resources`, custom ones included (the
  group's constructor takes num_cpus / num_gpus only, so `PlacedLearnerGroup` starts the same actors with
  full Ray options), and `torch_threads` = their CPU amount;
- asynchrony: `LearnerGroup.step` blocks (it prepares the batch here, then waits for the ranks), so it runs
  on one background thread and `step` returns a Future;
- weight sync: `weights()` is rank 0's `state_dict` actor call, left in the object store (the group's own
  `state_dict()` would fetch the weights into this process);
- `save`/`load` write and read `dir` on rank 0's node (every rank for load): the run dir must be
  reachable there, the one shared path a multi-node run needs besides the trajectory store, which only
  the driver writes.

A dead rank surfaces as `LearnerDied` (from `result`, `ready`, `save`, `load`), which the loop turns into
a stop with the resume command.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from rl.placement import torch_threads


class LearnerDied(RuntimeError):
    """A learner actor is gone (killed, OOM, node lost)."""


def _actor_error(e: BaseException) -> bool:
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:300]}" if text else type(e).__name__


def placed_learner_group(cfg: Any) -> Any:
    """A LearnerGroup whose rank actors carry `orchestrator.learner_resources` (custom resources too)."""
    import ray

    from rl.learner.group import LearnerGroup, LearnerRank

    resources = cfg.orchestrator.learner_resources

    class PlacedLearnerRank(LearnerRank):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # save_pretrained's shard bars would flood the driver's log
            super().__init__(*args, **kwargs)

        def info(self) -> dict:
            """pid and Ray node id of this rank (placement.json, tests)."""
            import os

            return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    class PlacedLearnerGroup(LearnerGroup):
        def __init__(self) -> None:  # LearnerGroup.__init__ with full actor options
            self.cfg = cfg
            self.world_size = int(cfg.learner.num_ranks)
            self._start(ray.remote(PlacedLearnerRank), resources, torch_threads(resources), max_restarts=0)

    return PlacedLearnerGroup()


class LearnerClient:
    """See the module docstring."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        try:
            self.group = placed_learner_group(cfg)
        except Exception as e:
            if _actor_error(e):
                raise LearnerDied(f"a learner rank died while starting: {_reason(e)}") from e
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner-step")

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            if _actor_error(e) or (hasattr(e, "cause") and _actor_error(e.cause)):
                raise LearnerDied(_reason(e)) from e
            raise

    def ready(self, timeout: float | None = None) -> dict:
        """Ping every rank: rank 0's pid and node id, every rank's under "ranks" (LearnerDied if gone)."""
        import ray

        def ping() -> dict:
            infos = ray.get([r.info.remote() for r in self.group.ranks], timeout=timeout)
            return {**infos[0], "ranks": infos}

        return self._call(ping)

    def step(self, trajectories: list) -> concurrent.futures.Future:
        return self._pool.submit(self._call, self.group.step, trajectories)

    @staticmethod
    def done(fut: concurrent.futures.Future) -> bool:
        return fut.done()

    @staticmethod
    def wait(fut: concurrent.futures.Future, timeout: float) -> bool:
        """Block until the step is done or `timeout` s passed; True when done."""
        return fut in concurrent.futures.wait([fut], timeout=timeout).done

    def result(self, fut: concurrent.futures.Future) -> dict[str, float]:
        return dict(fut.result())

    def weights(self) -> Any:
        """ObjectRef of rank 0's state_dict, or under FSDP of its WeightBuckets manifest (every rank gathers
        one bucket at a time; rl/learner/shard_export.py); never fetched here."""
        return self.group.weights_ref()

    def save(self, path: Path) -> None:
        self._call(self.group.save, str(path))

    def load(self, path: Path) -> None:
        self._call(self.group.load, str(path))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.group.shutdown()
        except Exception:  # ranks already dead: shutdown killed what was left
            pass
