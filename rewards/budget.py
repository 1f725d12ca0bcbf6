"""Length-shaping penalties: `turn_penalty` (per assistant turn) and `token_budget` (tokens over a budget).

turn_penalty:
    per_turn[i] = -penalty   if i >= free_turns else 0;      value = sum_i per_turn[i]

token_budget: with U_i = tokens used after assistant turn i,
    count="generated": U_i = generated tokens in assistant turns 0..i
    count="total":     U_i = context length when turn i+1 starts (prompt, turns and the
                       observations turn i caused), U_last = T
    E_i = max(0, U_i - budget)                               (tokens over budget so far)
    per_turn[i] = -penalty_per_token * (E_i - E_{i-1})       (E_{-1} = 0)
    running sums are clipped at -max_penalty (when set);      value = sum_i per_turn[i]
so each turn pays for the over-budget tokens it added.
"""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards.base import RewardResult, param_check


def _check_turn(penalty: float, free_turns: int) -> None:
    if free_turns < 0:
        raise ValueError(f"turn_penalty: free_turns must be >= 0, got {free_turns}")


@param_check(_check_turn)
def turn_penalty(traj: Trajectory, *, penalty: float = 0.01, free_turns: int = 0) -> RewardResult:
    per_turn = [(-penalty if i >= free_turns else 0.0) for i in range(traj.n_assistant_turns)]
    return RewardResult.from_per_turn(per_turn, {"n_turns": float(len(per_turn))})


def _check_budget(budget: int, penalty_per_token: float, max_penalty: float | None, count: str) -> None:
    if budget < 0:
        raise ValueError(f"token_budget: budget must be >= 0, got {budget}")
    if penalty_per_token < 0:
        raise ValueError(
            f"token_budget: penalty_per_token must be >= 0 (it is subtracted), got {penalty_per_token}"
        )
    if max_penalty is not None and max_penalty < 0:
        raise ValueError(f"token_budget: max_penalty must be >= 0 (or null), got {max_penalty}")
    if count not in ("generated", "total"):
        raise ValueError(f"token_budget: count must be 'generated' or 'total', got {count!r}")


def usage_after_turns(traj: Trajectory, count: str) -> list[int]:
    """U_i of the module docstring, one per assistant turn."""
    spans = traj.assistant_spans()
    if count == "generated":
        used, out = 0, []
        for s in spans:
            used += int(traj.loss_mask[s.start : s.end].sum())
            out.append(used)
        return out
    return [spans[i + 1].start if i + 1 < len(spans) else traj.n_tokens for i in range(len(spans))]


@param_check(_check_budget)
def token_budget(
    traj: Trajectory,
    *,
    budget: int,
    penalty_per_token: float = 1e-4,
    max_penalty: float | None = None,
    count: str = "generated",
) -> RewardResult:
    _check_budget(budget, penalty_per_token, max_penalty, count)
    usage = usage_after_turns(traj, count)
    per_turn, prev_excess, total = [], 0, 0.0
    for u in usage:
        excess = max(0, u - budget)
        r = -penalty_per_token * (excess - prev_excess)
        if max_penalty is not None:
            r = max(r, -max_penalty - total)
        per_turn.append(r)
        total += r
        prev_excess = excess
    used = usage[-1] if usage else (traj.n_generated if count == "generated" else traj.n_tokens)
    return RewardResult.from_per_turn(per_turn, {"used": float(used), "over": float(max(0, used - budget))})
