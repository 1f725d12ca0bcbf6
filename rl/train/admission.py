"""Admission: which groups the driver lets in. The staleness bound on groups ahead of the learner, and the
group filter of dynamic sampling.

    adm = Admission.from_config(cfg, groups_per_step=4)
    for _ in range(adm.room(len(buffer), busy=False)):      # tasks the bound allows to draw now
        adm.opened(task)                                     # drawn: its group is open until complete
    adm.closed(group.key); keep = adm.admit(group)           # complete: False = discard, draw another
    adm.step_taken()                                         # a batch went to the learner

Staleness bound (orchestrator.max_staleness = k; rl/train/loop.py has the reasoning): at most
`(k + 1 - busy) * G` useful groups (ready in the buffer, or open: drawn, not complete) are ahead of the
learner, G = the batch's group count, busy = 1 while a learner step runs.

Group filter (orchestrator.dynamic_sampling, DAPO): a complete group that the filter rejects is discarded
and another task drawn instead, until `(dynamic_sampling_cap - 1) * G` groups were discarded since the last
step; after that every group is kept. `orchestrator.group_filter` names the filter
(rl/train/group_filters.py).
"""

from __future__ import annotations

from typing import Any

from rl.rollout.tasks import Task
from rl.train.group_filters import GROUP_FILTERS, GroupFilter, group_filter


class Admission:
    """The staleness bound and the group filter (module docstring). max_staleness: k; groups_per_step: G;
    keep: the group filter, or None for no dynamic sampling; cap: orchestrator.dynamic_sampling_cap;
    filter_name: how its discards are counted ("discarded/<filter_name>")."""

    def __init__(
        self,
        max_staleness: int,
        groups_per_step: int,
        keep: GroupFilter | None = None,
        cap: float = 3.0,
        filter_name: str = "zero_variance",
    ) -> None:
        self.k, self.groups_per_step = max_staleness, groups_per_step
        self.keep, self.cap, self.filter_name = keep, cap, filter_name
        self.open: dict[str, Task] = {}  # task key -> task drawn whose group is not complete yet
        self.discarded = 0  # groups discarded since the last step

    @classmethod
    def from_config(cls, cfg: Any, groups_per_step: int) -> Admission:
        """From a RunConfig's orchestrator section."""
        o = cfg.orchestrator
        keep = group_filter(o.group_filter) if o.dynamic_sampling else None
        name = o.group_filter if o.group_filter in GROUP_FILTERS else o.group_filter.rsplit(":", 1)[-1]
        return cls(o.max_staleness, groups_per_step, keep, o.dynamic_sampling_cap, name)

    @property
    def counter(self) -> str:
        """The counter a discarded group adds to."""
        return f"discarded/{self.filter_name}"

    def limit(self, busy: bool) -> int:
        """Useful groups allowed ahead of the learner: (k + 1 - busy) * G."""
        return max(0, self.k + 1 - int(busy)) * self.groups_per_step

    def room(self, buffered: int, busy: bool) -> int:
        """New tasks that may be drawn now, with `buffered` groups in the experience buffer."""
        return max(0, self.limit(busy) - buffered - len(self.open))

    def opened(self, task: Task) -> None:
        """`task` was drawn: its group is open."""
        self.open[task.key] = task

    def closed(self, key: str) -> None:
        """The group of task `key` is complete."""
        self.open.pop(key, None)

    def open_indices(self) -> set[int]:
        """Indices of the open tasks (what the fifo buffer waits for)."""
        return {t.index for t in self.open.values()}

    def admit(self, group: Any) -> bool:
        """Whether a complete group goes on to the learner; False (counted in `discarded`) when the filter
        rejects it and fewer than (cap - 1) * G groups were discarded since the last step."""
        if self.keep is None or self.discarded >= (self.cap - 1.0) * self.groups_per_step or self.keep(group):
            return True
        self.discarded += 1
        return False

    def step_taken(self) -> None:
        """A batch went to the learner: the discard budget starts again."""
        self.discarded = 0

    def reset(self) -> None:
        """A new stage: no open groups (the buffer starts empty)."""
        self.open = {}


__all__ = ["Admission"]
