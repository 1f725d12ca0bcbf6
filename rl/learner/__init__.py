"""The learner: GRPO/PPO-family policy updates from scored trajectories (docs/learner.md).

    from rl.learner import Learner
    learner = Learner(cfg)                  # rl.config.RunConfig
    metrics = learner.step(trajectories)    # list[rl.trajectory.Trajectory], scored by rewards.compose

One idea per module: advantages, selection (what is masked), batch (trajectories -> samples), packing,
sharding (minibatches and ranks), off_policy, losses, routing (R3 agreement), forward (chunked log-probs),
value (PPO value model), optim, learner (the step), group (data-parallel LearnerGroup on Ray).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Learner"]


def __getattr__(name: str) -> Any:
    """`Learner` on first use, so importing a light module of the package (estimators, advantages) does not
    load the model code."""
    if name == "Learner":
        from rl.learner.learner import Learner

        return Learner
    raise AttributeError(f"module 'rl.learner' has no attribute {name!r}")
