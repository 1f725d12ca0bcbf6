"""Custom reward functions used by tests/test_rewards.py through "tests.custom_rewards:<name>" paths."""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards import RewardResult


def brevity(traj: Trajectory, *, target: int = 10, scale: float = 0.01) -> RewardResult:
    """-scale per generated token beyond `target`, per assistant turn."""
    per_turn = [-scale * max(0, len(s) - target) for s in traj.assistant_spans()]
    return RewardResult.from_per_turn(per_turn, {"target": float(target)})


def half(traj: Trajectory) -> float:
    """A custom reward may return a plain float."""
    return 0.5


def explode(traj: Trajectory, *, message: str = "boom") -> RewardResult:
    raise RuntimeError(message)


def wrong_length(traj: Trajectory) -> RewardResult:
    return RewardResult.from_per_turn([1.0] * (traj.n_assistant_turns + 1))


def nan_value(traj: Trajectory) -> float:
    return float("nan")


def turn_index_scorer(traj: Trajectory, turn: int) -> float:
    """A stand-in process reward model: scores turn i as (i + 1) / 10."""
    return (turn + 1) / 10


def no_args() -> float:
    return 1.0


NOT_CALLABLE = 3
