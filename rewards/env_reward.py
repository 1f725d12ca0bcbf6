"""`env_reward`: the rewards the env itself returned from each step, credited to their turns.

    per_turn[i] = scale * step_infos[i].env_reward      (0 for a turn the env never consumed)
    value       = sum_i per_turn[i]

For envs that reward every step (SkyRL-gym's multi-turn envs: a format score per turn, 1.0 for the
correct answer) this is the env's own trajectory reward, as SkyRL's trainers sum it. For Odyssey's
ToolEnvs the step reward is 0.0 until the env terminates the episode, then its success score, so this
equals `outcome` on terminated episodes.
"""

from __future__ import annotations

from envs.trajectory import Trajectory
from rewards.base import RewardResult


def env_reward(traj: Trajectory, *, scale: float = 1.0) -> RewardResult:
    per_turn = [0.0] * traj.n_assistant_turns
    for i, info in enumerate(traj.step_infos):
        per_turn[i] = scale * info.env_reward
    return RewardResult.from_per_turn(per_turn, {"n_steps": float(len(traj.step_infos))})
