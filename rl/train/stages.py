"""Progressive stages in one run: `stages:` in the run config, e.g. an 8K -> 64K context curriculum.

    stages:
      - name: 8k
        set: {rollout.max_tokens: 8192, learner.micro_batch_tokens: 8192}
        until_eval_success: 0.6        # advance after a held-out eval in this stage reaches 0.6 ...
        until_steps: 200               # ... or after 200 steps in it, whichever comes first
      - name: 64k
        set: {rollout.max_tokens: 65536, learner.micro_batch_tokens: 65536}

Stage i runs with the run config plus its `set` overrides (dotted keys under env., rollout., learner. or
rewards.; values as in YAML): `rl.config.stage_config`, and `load_config` checks every stage's config
(`rl.config.stage_problems`). A stage's gate is `until_steps` (steps done in the stage), and/or
`until_eval_success` (the `success` of a held-out evaluation run in the stage, orchestrator.eval_every);
the last stage has no gate and runs until learner.steps. The stage index and the step it began at are
part of the checkpoint (driver.json), so a resumed run continues in its stage; every metrics record
carries `stage`, which `odyssey report` uses to mark the boundaries.

On a boundary the driver checkpoints (already in the new stage), stops the rollout workers and the
learner, and starts them again from that checkpoint with the new stage's config: exactly the resume
path, so the samples in flight are re-queued with their seeds and played under the new limits.
"""

from __future__ import annotations

from typing import Any

from rl.config import FIXED_KEYS, STAGE_PREFIXES, stage_config, stage_problems

__all__ = ["FIXED_KEYS", "STAGE_PREFIXES", "StageController", "stage_config", "stage_problems"]


class StageController:
    """Which stage the run is in and when it advances. `stages`: the config's StageEntry list (may be
    empty: then there is one implicit stage and nothing ever advances)."""

    def __init__(self, stages: list[Any]):
        self.stages = list(stages)

    def name(self, index: int) -> str:
        return self.stages[index].name if self.stages else "main"

    def should_advance(self, index: int, steps_in_stage: int, eval_success: float | None) -> bool:
        """True when stage `index`'s gate is met: `steps_in_stage` >= until_steps, or an evaluation run in
        the stage (`eval_success`, None when this step had none) >= until_eval_success."""
        if index >= len(self.stages) - 1:
            return False
        s = self.stages[index]
        if s.until_steps is not None and steps_in_stage >= s.until_steps:
            return True
        return s.until_eval_success is not None and eval_success is not None and (
            eval_success >= s.until_eval_success
        )
