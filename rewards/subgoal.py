"""`subgoal`: credit each milestone once, at the assistant turn where it was first achieved.

Milestones are the names env steps report in `step_infos[i].subgoals`; step i belongs to
assistant turn i. With w(g) = weights.get(g, default_weight):

    per_turn[i] = sum over milestones g first seen at step i of w(g)
    running sums are clipped so that sum_{j<=i} per_turn[j] <= cap    (when cap is set)
    value       = sum_i per_turn[i]

Repeats of an already-credited milestone earn nothing, so re-doing a step cannot farm reward.
"""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards.base import RewardResult, param_check


def _check(default_weight: float, weights: dict[str, float] | None, cap: float | None) -> None:
    for k, v in (weights or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"subgoal: weights[{k!r}] must be a number, got {v!r}")
    if cap is not None and cap < 0:
        raise ValueError(f"subgoal: cap must be >= 0 (or null for no cap), got {cap}")


@param_check(_check)
def subgoal(
    traj: Trajectory,
    *,
    default_weight: float = 1.0,
    weights: dict[str, float] | None = None,
    cap: float | None = None,
) -> RewardResult:
    weights = weights or {}
    per_turn = [0.0] * traj.n_assistant_turns
    seen: set[str] = set()
    total = 0.0
    for i, info in enumerate(traj.step_infos):
        for g in info.subgoals:
            if g in seen:
                continue
            seen.add(g)
            credit = float(weights.get(g, default_weight))
            if cap is not None:
                credit = min(credit, cap - total)
            per_turn[i] += credit
            total += credit
    return RewardResult.from_per_turn(per_turn, {"n_achieved": float(len(seen))})
