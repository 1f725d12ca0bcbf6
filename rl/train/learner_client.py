"""`LearnerClient`: the driver's handle on the learner running as Ray actors; the driver holds no model.

    client = LearnerClient(cfg)              # learner actor(s) with orchestrator.learner_resources
    fut = client.step(trajectories)          # non-blocking: the learner trains while rollouts continue
    metrics = client.result(fut)             # {"loss", "grad_norm", "tokens", ...}
    ref = client.weights()                   # ObjectRef of the state_dict: put once, fetched by N workers
    client.save(dir); client.load(dir)       # learner state (model safetensors, optimizer, scheduler, RNG...)

The learner itself is `rl.learner.Learner` (issue 11: `Learner(cfg)`, `.step(trajs) -> dict`,
`.state_dict()`, `.save(dir)`, `.load(dir)`); this module only hosts it on Ray. `save`/`load` write
and read `dir` on the learner's node: the run dir must be reachable there (the one shared path a
multi-node run needs besides the trajectory store, which only the driver writes).

A dead learner actor surfaces as `LearnerDied` (from `result`, `weights`, `save`), which the loop turns
into a stop with the resume command.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from rl.train.placement import actor_options, torch_threads

DEFAULT_LEARNER = "rl.learner:Learner"


class LearnerDied(RuntimeError):
    """The learner actor is gone (killed, OOM, node lost)."""


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class LearnerRank:
    """One learner process (a Ray actor): builds `learner_cls(cfg)` with `threads` torch threads."""

    def __init__(self, cfg: Any, learner_cls: str = DEFAULT_LEARNER, threads: int = 1):
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(int(threads))
        hf_logging.disable_progress_bar()  # save_pretrained's shard bars would flood the driver's log
        self.learner = _import(learner_cls)(cfg)
        self.version = 0

    def step(self, trajectories: list) -> dict[str, float]:
        metrics = dict(self.learner.step(trajectories))
        self.version += 1
        return metrics

    def weights(self) -> dict:
        """The policy's state_dict (CPU tensors): returned into Ray's object store, never to the driver."""
        return {k: v.detach().cpu() for k, v in self.learner.state_dict().items()}

    def save(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.learner.save(path)
        return path

    def load(self, path: str, version: int) -> int:
        self.learner.load(path)
        self.version = int(version)
        return self.version

    def info(self) -> dict:
        import ray

        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "version": self.version,
        }


class LearnerClient:
    """See the module docstring. learner_cls: "module:Class" of the learner (default rl.learner:Learner)."""

    def __init__(self, cfg: Any, learner_cls: str = DEFAULT_LEARNER):
        import ray

        resources = cfg.orchestrator.learner_resources
        opts = {**actor_options(resources), "max_restarts": 0, "max_concurrency": 1}
        self.actor = (
            ray.remote(LearnerRank).options(**opts).remote(cfg, learner_cls, torch_threads(resources))
        )

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise LearnerDied(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from e

    def ready(self, timeout: float | None = None) -> dict:
        """Wait until the learner is built; returns its pid / node id."""
        return self._get(self.actor.info.remote(), timeout)

    def step(self, trajectories: list) -> Any:
        return self.actor.step.remote(trajectories)

    @staticmethod
    def done(fut: Any) -> bool:
        import ray

        return bool(ray.wait([fut], timeout=0)[0])

    def result(self, fut: Any) -> dict[str, float]:
        return self._get(fut)

    def weights(self) -> Any:
        """ObjectRef of the current state_dict (resolved on the workers; check it with `check`)."""
        return self.actor.weights.remote()

    def save(self, path: Path) -> None:
        self._get(self.actor.save.remote(str(path)))

    def load(self, path: Path, version: int) -> None:
        self._get(self.actor.load.remote(str(path), int(version)))

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception:
            pass
