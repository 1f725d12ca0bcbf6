"""Weight sync, learner -> rollout workers: one broadcast through Ray's object store.

    sync = WeightSync(timeout_s=300)
    sync.publish(learner.weights(), version=7)     # the learner's state_dict, put in the object store once
    failed = sync.push(dispatcher.ready_actors())  # every worker gets it from there; {worker_id: reason}

`publish` takes the ObjectRef the learner actor returned (its state_dict lives in the object store;
the driver never fetches it). `push` calls `update_weights([ref], version)` on every worker: the ref is
wrapped in a list so Ray hands it over unresolved, and each worker awaits it itself (N gets of one
put). A worker must answer with the new version within `timeout_s`; one that does not, or answers
with another version, or is dead, is returned as failed and the loop replaces it (the replacement
loads the same ref before it takes any work: `ready_ref`). Workers apply the weights between decode
steps; engines rebuild any cache computed with older weights (rl/rollout/engine.py).

A sharded learner (learner.sharding=fsdp) publishes the same way, but its ref resolves to a `WeightBuckets`
manifest (rl/learner/shard_export.py): the names, and one ref per bucket of at most 256 MiB, each gathered
from the shards alone and streamed to the object store as it completes. A worker fetches and loads the
buckets one at a time (`update_weights_stream`: TorchEngine per bucket with load_state_dict(strict=False),
VllmEngine through its reload's weights iterator), so neither the learner ranks nor the workers ever hold
more than one bucket of the new weights beside their own model. Nothing here changes: the ref, the
versions, the timeout and the failure handling are the same.
"""

from __future__ import annotations

import time
from typing import Any


class WeightSync:
    """Holds the latest published weights (ref + version) and pushes them to workers."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = float(timeout_s)
        self.ref: Any = None
        self.version = -1
        self.last_push_s = 0.0
        self.pushes = 0

    def publish(self, ref: Any, version: int) -> None:
        self.ref, self.version = ref, int(version)

    def ready_ref(self, actor: Any) -> Any:
        """Load the current weights into a (new) worker; the returned ref resolves when it has them."""
        if self.ref is None:
            raise RuntimeError("WeightSync.ready_ref before any weights were published")
        return actor.update_weights.remote([self.ref], self.version)

    def push(self, actors: dict[int, Any]) -> dict[int, str]:
        """Send the current weights to `actors` (worker id -> actor); wait for every answer (timeout_s).
        Returns {worker_id: reason} for the workers that failed the sync (the health check)."""
        import ray

        if not actors:
            return {}
        t0 = time.perf_counter()
        refs = {actor.update_weights.remote([self.ref], self.version): i for i, actor in actors.items()}
        done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s)
        failed = {
            refs[r]: f"no answer to the weight sync of version {self.version} in {self.timeout_s:g} s"
            for r in pending
        }
        for r in done:
            try:
                got = ray.get(r)
            except Exception as e:
                text = str(e).strip()
                failed[refs[r]] = (
                    f"weight sync failed: {type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}"
                )
                continue
            if int(got) != self.version:
                failed[refs[r]] = f"weight sync: worker reports version {got}, expected {self.version}"
        self.last_push_s = time.perf_counter() - t0
        self.pushes += 1
        return failed
