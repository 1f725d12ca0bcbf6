"""Run configuration: one YAML file describes a whole run; every mistake is reported before anything starts.

    cfg = load_config("configs/tiny.yaml", ["learner.lr=1e-5", "rollout.num_workers=4"])
    write_resolved(cfg, cfg.logging.run_dir)          # -> <run_dir>/config.yaml, reloadable as is

Sections (docs/config.md lists every key): model, env, rewards, rollout, learner, orchestrator, logging,
warmup, stages.

Overrides are `dotted.key=value`; the value is parsed as a YAML scalar or flow collection (`1e-5`, `true`,
`null`, `[1, 2]`, `{difficulty: 2}`), list items are addressed by index (`rewards.0.weight=0.5`).

Validation happens in two passes, each listing every problem it finds in one `ConfigError`:
1. structure (`schema.py`, pydantic, strict types, `extra="forbid"`): unknown keys (with the closest valid
   key), wrong types, out-of-range values. The schema imports nothing else of the repo; constructing a
   `RunConfig` runs this pass only.
2. meaning (`checks.py`, run by `load_config` / `validate_config` once the structure is valid): budgets that
   contradict each other, the advantage estimator's rules and registry names, the model preset and its
   overrides, checkpoints, reward specs, the env id and its kwargs, the dataset file, every stage's config.

`loader.py` reads YAML, applies overrides, runs both passes, writes the resolved file and builds a stage's
config (`stage_config`, which re-runs only the checks that read no file).
"""

from rl.config.checks import config_problems, is_hf_policy
from rl.config.loader import (
    FIXED_KEYS,
    RESOLVED_NAME,
    STAGE_PREFIXES,
    apply_override,
    cli_main,
    load_config,
    parse_yaml,
    stage_config,
    stage_problems,
    validate_config,
    write_resolved,
)
from rl.config.schema import (
    ConfigError,
    DatasetSection,
    EnvSection,
    LearnerSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    OrchestratorSection,
    RewardEntry,
    RolloutSection,
    RunConfig,
    StageEntry,
    WarmupSection,
    _leaf_paths,
    _submodel,
)

__all__ = [
    "FIXED_KEYS",
    "RESOLVED_NAME",
    "STAGE_PREFIXES",
    "ConfigError",
    "DatasetSection",
    "EnvSection",
    "LearnerSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "OrchestratorSection",
    "RewardEntry",
    "RolloutSection",
    "RunConfig",
    "StageEntry",
    "WarmupSection",
    "_leaf_paths",
    "_submodel",
    "apply_override",
    "cli_main",
    "config_problems",
    "is_hf_policy",
    "load_config",
    "parse_yaml",
    "stage_config",
    "stage_problems",
    "validate_config",
    "write_resolved",
]
