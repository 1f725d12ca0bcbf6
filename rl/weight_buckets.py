"""The manifest of a weight sync in buckets: what a sharded learner (rl/learner/shard_export.py) hands to the
rollout workers (rl/rollout/worker.py), which fetch and load the buckets one at a time.

It sits below both (layer 0 of rl/, tests/test_architecture.py): the learner makes it, the rollout reads it,
and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 256 << 20  # 256 MiB


@dataclass
class WeightBuckets:
    """The manifest of one weight sync in buckets (module docstring): `names` every state-dict name in load
    order, `refs` one Ray ObjectRef per bucket ({name: tensor}), `nbytes` the total, `bucket_bytes` the
    cap."""

    names: list[str]
    refs: list[Any] = field(default_factory=list)
    nbytes: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def stream(self) -> Iterator[dict[str, torch.Tensor]]:
        """Fetch the buckets one at a time (blocking `ray.get`: call from a thread, not an event loop); the
        caller drops each before the next is fetched."""
        import ray

        for ref in self.refs:
            yield ray.get(ref)
