"""Experience buffer: finished episodes gather into GRPO groups; the learner takes whole groups.

    buf = ExperienceBuffer(group_size=4, order="fifo")
    group = buf.add(sample, traj)          # a Group once all group_size members are in, else None
    batch, dropped = buf.take(n_groups=4, learner_version=7, max_staleness=1)

A `Group` is the `group_size` final trajectories of one task (`Sample.task.key`), in sample order.
Members whose episode failed on infrastructure are kept, marked: the learner masks them (never
scored 0). Which complete groups form the next batch is `order` (orchestrator.buffer_order):

- fifo: strictly in task order: the batch is the next n tasks drawn, and it is ready only when all n
  are complete (so which samples form each batch never depends on timing, sync or async);
- length: the n groups whose mean trajectory lengths are closest together (a length bucket: packed
  micro-batches of similar lengths waste less of their token budget);
- freshness: least stale first (newest `oldest_version`), then task index;
- priority: largest |advantage| first, the group's mean |r - mean(r)| of the valid members' total
  reward (zero-variance groups last: they carry no gradient), then task index.

The batch is returned in sample order (task index, sample index), so the learner sees the same list
whichever worker finished first. A member whose oldest generated token is more than `max_staleness`
versions behind the learner is dropped from its group there and returned in `dropped` (counted by the
loop); its group goes on with the rest.

The buffer is persistent: `save(path)` / `load(path)` write the complete and the partial groups (one
Arrow file in the trajectory store format, via rl/trajectory.py) into a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from rl.rollout.tasks import Sample
from rl.trajectory import Trajectory, trajectories_from_batch, trajectories_to_batch

Order = Literal["fifo", "length", "freshness", "priority"]
ORDERS: tuple[str, ...] = ("fifo", "length", "freshness", "priority")


def _valid(t: Trajectory) -> bool:
    from rewards.compose import is_trainable

    return is_trainable(t)


@dataclass
class Group:
    """The members of one task's group (sorted by sample index once complete)."""

    key: str
    task_index: int
    members: list[tuple[Sample, Trajectory]] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for _, t in self.members]

    def rewards(self) -> np.ndarray:
        """Total rewards of the valid (trainable) members [n_valid]."""
        return np.array([t.rewards["total"] for t in self.trajectories if _valid(t)], dtype=np.float64)

    @property
    def has_variance(self) -> bool:
        """At least two valid members with different total rewards (a GRPO signal)."""
        r = self.rewards()
        return r.size >= 2 and bool(np.ptp(r) > 0)

    @property
    def priority(self) -> float:
        r = self.rewards()
        return float(np.abs(r - r.mean()).mean()) if r.size >= 2 else 0.0

    @property
    def oldest_version(self) -> int:
        vs = [t.oldest_version for t in self.trajectories if t.oldest_version is not None]
        return min(vs) if vs else 0

    @property
    def mean_tokens(self) -> float:
        return float(np.mean([t.n_tokens for t in self.trajectories])) if self.members else 0.0


def staleness(traj: Trajectory, learner_version: int) -> int:
    """Versions between the learner and the trajectory's oldest generated token."""
    v = traj.oldest_version
    return int(learner_version) - (int(v) if v is not None else int(learner_version))


class ExperienceBuffer:
    """See the module docstring."""

    def __init__(self, group_size: int, order: str = "fifo"):
        if order not in ORDERS:
            raise ValueError(f"buffer order must be one of {ORDERS}, got {order!r}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size, self.order = group_size, order
        self.partial: dict[str, Group] = {}
        self.ready: dict[str, Group] = {}

    def __len__(self) -> int:
        """Complete groups waiting for the learner."""
        return len(self.ready)

    @property
    def n_trajectories(self) -> int:
        return sum(len(g.members) for g in (*self.partial.values(), *self.ready.values()))

    def keys(self) -> set[str]:
        """Sample keys of every trajectory held."""
        return {s.key for g in (*self.partial.values(), *self.ready.values()) for s, _ in g.members}

    def add(self, sample: Sample, traj: Trajectory) -> Group | None:
        """Add a final trajectory; returns its group when that completes it (the group is then ready)."""
        key = sample.task.key
        if key in self.ready:
            raise ValueError(f"group {key} is already complete; sample {sample.key} would be a duplicate")
        g = self.partial.setdefault(key, Group(key, sample.task.index))
        if any(s.index == sample.index for s, _ in g.members):
            raise ValueError(f"sample {sample.key} is already in the buffer (a duplicate result)")
        g.members.append((sample, traj))
        if len(g.members) < self.group_size:
            return None
        g.members.sort(key=lambda m: m[0].order)
        del self.partial[key]
        self.ready[key] = g
        return g

    def discard(self, key: str) -> Group:
        """Remove a complete group (e.g. zero reward variance under dynamic sampling)."""
        return self.ready.pop(key)

    def batch_ready(self, n: int, open_tasks: set[int]) -> bool:
        """Whether `take(n)` can form a full batch now. open_tasks: indices of the tasks drawn whose group
        is not complete yet (fifo waits for the lowest n indices of ready + open to be ready)."""
        if self.order != "fifo":
            return len(self.ready) >= n
        ready = {g.task_index for g in self.ready.values()}
        first = sorted(ready | set(open_tasks))[:n]
        return len(first) == n and all(i in ready for i in first)

    def _chosen(self, n: int) -> list[Group]:
        groups = sorted(self.ready.values(), key=lambda g: g.task_index)
        if self.order == "fifo":
            return groups[:n]
        if self.order == "freshness":
            return sorted(groups, key=lambda g: (-g.oldest_version, g.task_index))[:n]
        if self.order == "priority":
            return sorted(groups, key=lambda g: (-g.priority, g.task_index))[:n]
        by_len = sorted(groups, key=lambda g: (g.mean_tokens, g.task_index))  # length buckets
        if len(by_len) <= n:
            return by_len
        spans = [by_len[i + n - 1].mean_tokens - by_len[i].mean_tokens for i in range(len(by_len) - n + 1)]
        start = int(np.argmin(spans))  # the tightest window of n lengths (first one on ties)
        return by_len[start : start + n]

    def take(
        self, n_groups: int, learner_version: int, max_staleness: int
    ) -> tuple[list[tuple[Sample, Trajectory]], list[tuple[Sample, Trajectory]]]:
        """Remove up to `n_groups` complete groups (chosen by `order`). Returns (batch, dropped): batch in
        sample order without the members staler than `max_staleness`; dropped = those members."""
        batch, dropped = [], []
        for g in self._chosen(n_groups):
            del self.ready[g.key]
            for s, t in g.members:
                (dropped if staleness(t, learner_version) > max_staleness else batch).append((s, t))
        batch.sort(key=lambda m: m[0].order)
        return batch, dropped

    # ------------------------------------------------------------------ persistence
    def save(self, path: Path) -> int:
        """Write every held trajectory (with its sample and group state) to one Arrow file; returns N."""
        import pyarrow as pa

        rows = []
        for state, groups in (("ready", self.ready), ("partial", self.partial)):
            for g in groups.values():
                for s, t in g.members:
                    meta = {**t.metadata, "_buffer": {"state": state, "sample": s.to_dict()}}
                    rows.append(_with_metadata(t, meta))
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if rows:
            batch = trajectories_to_batch(rows)
            with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, batch.schema) as w:
                w.write_batch(batch)
        else:
            tmp.write_bytes(b"")
        tmp.replace(path)
        return len(rows)

    def load(self, path: Path) -> None:
        """Replace the contents with a buffer saved by `save`."""
        import pyarrow as pa

        self.partial, self.ready = {}, {}
        path = Path(path)
        if path.stat().st_size == 0:
            return
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        for i in range(reader.num_record_batches):
            for t in trajectories_from_batch(reader.get_batch(i)):
                meta = dict(t.metadata)
                info = meta.pop("_buffer")
                sample = Sample.from_dict(info["sample"])
                t = _with_metadata(t, meta)
                g = self.add(sample, t)
                if info["state"] == "partial" and g is not None:  # cannot happen with a consistent file
                    raise ValueError(f"{path}: group {g.key} was partial when saved but is complete")


def _with_metadata(t: Trajectory, metadata: dict) -> Trajectory:
    fields = {f: getattr(t, f) for f in t.__dataclass_fields__}
    fields["metadata"] = metadata
    return Trajectory(**fields)
