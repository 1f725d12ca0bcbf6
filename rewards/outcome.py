"""`outcome`: the environment's terminal success score.

    s     = traj.outcome                    (1.0 / 0.0, or a partial score in between)
    s     = 1[s >= threshold]               (only when `threshold` is set)
    value = fail_value + (success_value - fail_value) * s
    value = unterminated_value              when traj.outcome is None (episode not terminated;
                                            defaults to fail_value)

A scalar: placed on the last generated token.
"""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards.base import RewardResult, param_check


def _check(
    success_value: float, fail_value: float, threshold: float | None, unterminated_value: float | None
) -> None:
    if success_value < fail_value:
        raise ValueError(f"outcome: success_value ({success_value}) must be >= fail_value ({fail_value})")


@param_check(_check)
def outcome(
    traj: Trajectory,
    *,
    success_value: float = 1.0,
    fail_value: float = 0.0,
    threshold: float | None = None,
    unterminated_value: float | None = None,
) -> RewardResult:
    if traj.outcome is None:
        value = fail_value if unterminated_value is None else unterminated_value
        return RewardResult(float(value), None, {"terminated": 0.0})
    s = traj.outcome
    if threshold is not None:
        s = 1.0 if s >= threshold else 0.0
    return RewardResult(fail_value + (success_value - fail_value) * s, None, {"terminated": 1.0})
