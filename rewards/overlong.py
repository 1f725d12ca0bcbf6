"""`overlong`: DAPO soft overlong punishment (Yu et al. 2025, Eq. 13) on the response length.

With L = the number of generated tokens (sum of loss_mask; `count="total"` uses all T tokens),
L_max = max_completion_len and L_cache = soft_punish_cache:

    value = 0                                  if L <= L_max - L_cache
          = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
          = -1                                 if L > L_max

Identical to `trl.rewards.get_soft_overlong_punishment` (tests/test_rewards.py checks it).
A scalar: placed on the last generated token.
"""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards.base import RewardResult, param_check


def soft_overlong_punishment(length: int, max_completion_len: int, soft_punish_cache: int) -> float:
    """The DAPO formula for one length (same branch order as TRL)."""
    lo = max_completion_len - soft_punish_cache
    if length <= lo:
        return 0.0
    if length <= max_completion_len:
        return (lo - length) / soft_punish_cache
    return -1.0


def _check(max_completion_len: int, soft_punish_cache: int, count: str) -> None:
    if max_completion_len <= 0:
        raise ValueError(f"overlong: max_completion_len must be > 0, got {max_completion_len}")
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"overlong: soft_punish_cache must be in [0, max_completion_len={max_completion_len}], "
            f"got {soft_punish_cache}"
        )
    if count not in ("generated", "total"):
        raise ValueError(f"overlong: count must be 'generated' or 'total', got {count!r}")


@param_check(_check)
def overlong(
    traj: Trajectory, *, max_completion_len: int, soft_punish_cache: int, count: str = "generated"
) -> RewardResult:
    _check(max_completion_len, soft_punish_cache, count)
    length = traj.n_generated if count == "generated" else traj.n_tokens
    value = soft_overlong_punishment(length, max_completion_len, soft_punish_cache)
    return RewardResult(value, None, {"length": float(length)})
