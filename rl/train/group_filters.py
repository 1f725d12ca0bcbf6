"""Group filters of dynamic sampling, in one registry: `orchestrator.group_filter` names one.

A filter is fn(group) -> bool, True = keep the group for the learner, where group is an
rl.train.buffer.Group: `key`, `members` [(Sample, Trajectory)] sorted by sample index, `rewards()` (the
valid members' total rewards, float64 [n]), `has_variance`. Built-in: "zero_variance" (DAPO: keep a group
only when its valid members' total rewards differ). A user's filter is `pkg.module:fn`, resolved like
reward functions. This module imports nothing of the repo at load time, so the config checks can look a
name up; rl/train/admission.py applies the filter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GroupFilter = Callable[[Any], bool]


def zero_variance(group: Any) -> bool:
    """Keep a group with a GRPO signal: at least two valid members with different total rewards."""
    return bool(group.has_variance)


GROUP_FILTERS: dict[str, GroupFilter] = {"zero_variance": zero_variance}


def group_filter(name: str) -> GroupFilter:
    """The filter `name` names: a built-in (`GROUP_FILTERS`) or `pkg.module:fn` (module docstring)."""
    from envs.dotted import builtin_or_dotted

    return builtin_or_dotted(name, GROUP_FILTERS, "group filter", "fn(group) -> bool (True = keep)")


__all__ = ["GROUP_FILTERS", "GroupFilter", "group_filter", "zero_variance"]
