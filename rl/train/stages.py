"""Progressive stages in one run: `stages:` in the run config, e.g. an 8K -> 64K context curriculum.

    stages:
      - name: 8k
        set: {rollout.max_tokens: 8192, learner.micro_batch_tokens: 8192}
        until_eval_success: 0.6        # advance after a held-out eval in this stage reaches 0.6 ...
        until_steps: 200               # ... or after 200 steps in it, whichever comes first
      - name: 64k
        set: {rollout.max_tokens: 65536, learner.micro_batch_tokens: 65536}

Stage i runs with the run config plus its `set` overrides (dotted keys under env., rollout., learner. or
rewards.; values as in YAML). A stage's gate is `until_steps` (steps done in the stage), and/or
`until_eval_success` (the `success` of a held-out evaluation run in the stage, orchestrator.eval_every);
the last stage has no gate and runs until learner.steps. The stage index and the step it began at are
part of the checkpoint (driver.json), so a resumed run continues in its stage; every metrics record
carries `stage`, which `odyssey report` uses to mark the boundaries.

On a boundary the driver checkpoints (already in the new stage), stops the rollout workers and the
learner, and starts them again from that checkpoint with the new stage's config: exactly the resume
path, so the samples in flight are re-queued with their seeds and played under the new limits.
"""

from __future__ import annotations

import json
from typing import Any

STAGE_PREFIXES = ("env.", "rollout.", "learner.", "rewards.")
# keys a stage cannot change: the run's length, its seeds (task identity), and what checkpoints and the
# experience buffer are built around (group shape, advantage estimator, value model)
FIXED_KEYS = (
    "learner.steps",
    "learner.group_size",
    "learner.advantage",
    "learner.value_model",
    "learner.critic_preset",
    "learner.seed",
    "rollout.seed",
)


def stage_config(cfg: Any, index: int) -> Any:
    """The effective RunConfig of stage `index`: `cfg` with the stage's `set` applied and no `stages`.
    Raises rl.config.ConfigError naming the stage when the result is invalid."""
    from rl.config import ConfigError, apply_override, validate_config

    stage = cfg.stages[index]
    data = cfg.model_dump(mode="json")
    data["stages"] = []
    try:
        for key, value in stage.set.items():
            apply_override(data, f"{key}={json.dumps(value)}")
        return validate_config(data)
    except ConfigError as e:
        raise ConfigError([f"stages.{index} ({stage.name}): {p}" for p in e.problems]) from None
    except ValueError as e:  # an override that does not address the config (apply_override)
        raise ConfigError([f"stages.{index} ({stage.name}): {e}"]) from None


def stage_problems(cfg: Any) -> list[str]:
    """Config-time checks of `stages` (pass 2 of rl.config): keys, gates, and each stage's own config."""
    from rl.config import ConfigError

    out: list[str] = []
    n = len(cfg.stages)
    names = [s.name for s in cfg.stages]
    for i, s in enumerate(cfg.stages):
        where = f"stages.{i} ({s.name})"
        if names.count(s.name) > 1:
            out.append(f"{where}: the stage name {s.name!r} is used twice; give each stage its own name")
        for key in s.set:
            if not key.startswith(STAGE_PREFIXES):
                out.append(
                    f"{where}: set.{key}: a stage sets keys under {', '.join(STAGE_PREFIXES)} only "
                    "(the model, orchestrator and logging are the run's)"
                )
            elif key in FIXED_KEYS:
                out.append(f"{where}: set.{key}: fixed for the whole run (one of {', '.join(FIXED_KEYS)})")
        gated = s.until_steps is not None or s.until_eval_success is not None
        if i < n - 1 and not gated:
            out.append(f"{where}: every stage but the last needs a gate (until_steps, until_eval_success)")
        if i == n - 1 and gated:
            out.append(
                f"{where}: the last stage runs until learner.steps and has no gate; remove until_steps / "
                "until_eval_success, or add a stage after it"
            )
        if s.until_eval_success is not None and not cfg.orchestrator.eval_every:
            out.append(
                f"{where}: until_eval_success needs held-out evaluations; set orchestrator.eval_every >= 1"
            )
    if out:
        return out
    for i in range(n):
        try:
            stage_config(cfg, i)
        except ConfigError as e:
            out += e.problems
    return out


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
