"""Training: the agentic RL loop on Ray (docs/training.md).

    from rl.config import load_config
    from rl.train import train
    summary = train(load_config("configs/tiny.yaml", ["learner.steps=10"]))   # what `odyssey train` does

One idea per module: placement (actor resources), learner_client (the learner on Ray), weight_sync
(learner -> workers), buffer (groups, reordering, persistence), checkpoint (atomic, complete-only),
metrics (metrics.jsonl, live line), loop (the driver), eval (held-out evaluation), cli (`odyssey train`,
`odyssey eval`). Tasks, samples and the work queue live with the rollout (rl/rollout/tasks.py, dispatch.py).
"""

from __future__ import annotations

from typing import Any


def train(cfg: Any, *, config_path: str | None = None, console: Any = None) -> dict[str, Any]:
    """Run (or resume) training for `cfg` (an rl.config.RunConfig); returns the summary dict.
    Raises rl.train.loop.TrainingStopped (with the resume command) when the run cannot go on."""
    from rl.train.loop import Trainer

    return Trainer(cfg, config_path=config_path, console=console).run()


__all__ = ["train"]
