"""What a reward function is.

A reward function is any callable `fn(traj, **params) -> RewardResult` (a plain float is
accepted too and means `RewardResult(value)`). `traj` is an `envs.trajectory.Trajectory`;
`params` come from the YAML spec and are checked against `fn`'s signature when the config
loads (see rewards/compose.py).

Result semantics (the learner relies on them, see rewards/placement.py):
- `per_turn is None`: an outcome-type scalar, credited on the last generated token.
- `per_turn` given: one value per assistant turn, credited on the last generated token of
  that turn; then `value` must equal `sum(per_turn)` (use `RewardResult.from_per_turn`).
- `components`: extra named numbers for logging (stored as "<key>/<component>"), never trained on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from envs.trajectory import Trajectory

PARAM_CHECK_ATTR = "__reward_param_check__"


@dataclass
class RewardResult:
    """value: scalar reward; per_turn: per assistant turn or None; components: logging extras."""

    value: float
    per_turn: list[float] | None = None
    components: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_per_turn(cls, per_turn: list[float], components: dict[str, float] | None = None) -> RewardResult:
        per_turn = [float(x) for x in per_turn]
        return cls(math.fsum(per_turn), per_turn, dict(components or {}))


class RewardFn(Protocol):
    def __call__(self, traj: Trajectory, /, **params: Any) -> RewardResult | float: ...


def param_check(checker: Callable[..., None]) -> Callable[[Callable], Callable]:
    """Attach a value checker to a reward function.

    `checker(**params)` receives every keyword parameter of the reward (defaults applied) and
    raises ValueError for bad values. It runs at config load (`validate_reward_specs`), so a
    bad value fails before any rollout; built-ins also call it at scoring time.
    """

    def deco(fn: Callable) -> Callable:
        setattr(fn, PARAM_CHECK_ATTR, checker)
        return fn

    return deco


def normalize_result(out: Any, n_turns: int) -> RewardResult:
    """Check a reward function's return value; raises TypeError/ValueError naming the problem."""
    if isinstance(out, bool) or out is None:
        raise TypeError(f"returned {out!r}; expected a RewardResult or a float")
    if isinstance(out, (int, float)) or (hasattr(out, "dtype") and getattr(out, "shape", None) == ()):
        out = RewardResult(float(out))
    if not isinstance(out, RewardResult):
        raise TypeError(f"returned a {type(out).__name__}; expected a RewardResult or a float")
    value = float(out.value)
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite value {value}")
    per_turn = None
    if out.per_turn is not None:
        per_turn = [float(x) for x in out.per_turn]
        if len(per_turn) != n_turns:
            raise ValueError(
                f"returned {len(per_turn)} per_turn values but the trajectory has {n_turns} assistant turns"
            )
        if not all(math.isfinite(x) for x in per_turn):
            raise ValueError(f"returned non-finite per_turn values {per_turn}")
        s = math.fsum(per_turn)
        if abs(s - value) > 1e-6 * max(1.0, abs(value)):
            raise ValueError(
                f"returned value {value} != sum(per_turn) {s}; per-turn rewards must add up to the value "
                "(build it with RewardResult.from_per_turn)"
            )
    components = {}
    for k, v in (out.components or {}).items():
        components[str(k)] = float(v)
    return RewardResult(value, per_turn, components)
