"""Run configuration: one YAML file describes a whole run; every mistake is reported before anything starts.

    cfg = load_config("configs/tiny.yaml", ["learner.lr=1e-5", "rollout.num_workers=4"])
    write_resolved(cfg, cfg.logging.run_dir)          # -> <run_dir>/config.yaml, reloadable as is

Sections (docs/config.md lists every key): model, env, rewards, rollout, learner, orchestrator, logging,
warmup.

Overrides are `dotted.key=value`; the value is parsed as a YAML scalar or flow collection (`1e-5`, `true`,
`null`, `[1, 2]`, `{difficulty: 2}`), list items are addressed by index (`rewards.0.weight=0.5`).

Validation happens in two passes, each listing every problem it finds in one `ConfigError`:
1. structure (pydantic, strict types, `extra="forbid"`): unknown keys (with the closest valid key), wrong
   types, out-of-range values;
2. meaning (only once the structure is valid): budgets that contradict each other, the model preset and its
   overrides (against `model.config.OdysseyConfig`), reward specs (`rewards.compose.validate_reward_specs`),
   the env id and its kwargs (against the env registry and the env class signature). Each of these checks
   imports its module lazily and is skipped only if that module is not installed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import inspect
import json
import re
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

RESOLVED_NAME = "config.yaml"


class ConfigError(ValueError):
    """A config that must not start. `problems` holds one line per problem, each naming its key path."""

    def __init__(self, problems: Sequence[str], source: str | Path | None = None) -> None:
        self.problems = list(problems)
        self.source = str(source) if source is not None else None
        head = f"invalid config {self.source}" if self.source else "invalid config"
        super().__init__(f"{head}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# ---------------------------------------------------------------------------------------------------------
# YAML: PyYAML follows YAML 1.1, where `1e-5` is a string. Resolve 1.2-style floats as floats.
# ---------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader with 1.2-style floats and no duplicate keys (YAML forbids them; PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    f"in the mapping starting at line {node.start_mark.line + 1}",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); remove one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """YAML with 1.2-style floats (`1e-5` is a float); a duplicate key is an error."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


# ---------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    """The policy: a `model.config` preset plus field overrides (validated against OdysseyConfig), or any
    Hugging Face causal LM checkpoint (`hf_path`; docs/hf.md "Training any Hugging Face causal LM")."""

    preset: str = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_from: str | None = None  # a saved checkpoint directory; None = fresh init from learner.seed
    hf_path: str | None = None  # a local HF causal LM checkpoint directory (Llama, Qwen2/3, Qwen3-MoE, ...)
    # or an embedded model's alias (model/embedded.py), e.g. smollm2-135m-instruct

    @field_validator("hf_path")
    @classmethod
    def _embedded_alias(cls, v: str | None) -> str | None:
        """An embedded model's alias becomes its converted checkpoint directory, here, once: every consumer
        of the config (learner, workers, vLLM, the tokenizer) reads the directory (docs/hf.md)."""
        from model.embedded import resolve_hf_path

        return None if v is None else resolve_hf_path(v)

    @property
    def checkpoint(self) -> str | None:
        """The directory the policy loads from (hf_path or init_from), or None for a fresh preset."""
        return self.hf_path or self.init_from


class DatasetSection(_Section):
    """Tasks from a file (envs/dataset.py): a .jsonl or .parquet of rows, split into train and eval rows."""

    path: str = Field(min_length=1)
    eval_size: float = Field(0.1, ge=0.0)  # < 1: fraction of the rows held out for eval; >= 1: a count
    seed: int = 0  # the train/eval split and the per-epoch shuffle of the train rows
    prompt_field: str = Field("prompt", min_length=1)  # column with the prompt (string or chat messages)
    answer_field: str = Field("answer", min_length=1)  # column with the ground truth (dataset-qa's verifier)


class EnvSection(_Section):
    """The environment: an id known to `envs` (built-in, plugin, or `reasoning-gym/<name>`, `skyrl/<env>`),
    the kwargs for `envs.make`, and optionally a dataset whose rows are the tasks."""

    id: str = "arith"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetSection | None = None  # `dataset: PATH` is short for `dataset: {path: PATH}`

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_path(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v


class RewardEntry(_Section):
    """One reward: a built-in name or "pkg.module:fn", its weight, params, and an optional result key."""

    name: str = Field(min_length=1)
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    key: str | None = None
    timeout_s: float | None = Field(None, gt=0.0)  # async rewards only: limit of one call (None = 60 s)


class RolloutSection(_Section):
    """Episode generation: engine, workers, per-episode budgets, sampling and sandboxes."""

    engine: Literal["torch", "vllm"] = "torch"
    num_workers: int = Field(1, ge=1)
    concurrent_episodes: int = Field(4, ge=1)  # per worker
    episodes: int = Field(64, ge=1)  # per policy step in training; total for `odyssey rollout`
    max_turns: int = Field(8, ge=1)  # assistant turns per episode
    max_tokens: int = Field(4096, ge=1)  # whole-episode token budget (prompt + all turns + observations)
    max_new_tokens: int = Field(512, ge=1)  # per assistant turn
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = disabled
    seed: int = 0
    sandbox_pool_size: int = Field(4, ge=0)  # warm sandboxes per worker; 0 = no shared pool
    sandbox_image: str | None = None  # None = sandbox.image.DEFAULT_IMAGE
    # stop when more than this share of a batch's episodes end in infra errors (rl.rollout.health); 1 = never
    max_infra_fraction: float = Field(0.5, gt=0.0, le=1.0)


GROUPED_ADVANTAGES = ("grpo", "rloo", "raft")  # learner.advantage values computed per task group


class LearnerSection(_Section):
    """Policy optimisation (rl/learner/, docs/learner.md): advantages, loss, off-policy correction, optimiser,
    packing and data parallelism."""

    # group mean baseline | leave-one-out | PPO (value) | each group's best successes (weight 1 per task)
    advantage: Literal["grpo", "rloo", "gae", "raft"] = "grpo"
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    steps: int = Field(100, ge=1)  # policy steps (Learner.step calls); sizes the lr schedule
    lr: float = Field(1e-5, gt=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, per optimizer step
    warmup_steps: int = Field(0, ge=0)  # optimizer steps of linear warm-up
    weight_decay: float = Field(0.0, ge=0.0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = Field(1.0, gt=0.0)  # max global grad norm
    group_size: int = Field(8, ge=1)  # grpo/rloo: episodes per task (the advantage baseline group)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # std-normalisation of group advantages
    negative_advantage_weight: float = Field(1.0, ge=0.0, le=1.0)  # scales advantages < 0 (0 = positive only)
    turn_credit: bool = False  # grpo/rloo: per-turn rewards as discounted returns-to-go on their own turn
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)  # ratio clipped to [1 - low, 1 + high]
    clip_eps_high: float = Field(0.28, gt=0.0)  # cispo: the IS weight is capped at 1 + high
    kl_coef: float = Field(0.0, ge=0.0)  # KL to the frozen initial policy; 0 = no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0.0)
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    overlong_filter: bool = False  # DAPO: truncated episodes are kept out of the loss
    tis_cap: float | None = Field(2.0, gt=0.0)  # truncated IS weight cap (rollout vs learner); None = off
    mis_band: list[float] | None = None  # [lo, hi]: mask where the learner/rollout ratio leaves the band
    mis_level: Literal["token", "sequence"] = "token"  # what mis_band masks: single tokens or whole episodes
    routing_replay: bool = True  # R3: replay the rollout's expert choices in the learner forward
    ppo_epochs: int = Field(1, ge=1)
    num_minibatches: int = Field(1, ge=1)  # optimizer steps per epoch of a policy step
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # gae: token discount; turn_credit: turn discount
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    value_model: Literal["head", "critic"] = "head"  # gae: value head on the policy trunk | separate critic
    critic_preset: str | None = None  # critic: model preset; None = a copy of the policy's initial trunk
    value_coef: float = Field(0.5, ge=0.0)
    value_clip: float = Field(0.2, gt=0.0)
    micro_batch_tokens: int = Field(16384, ge=1)  # packed tokens per forward/backward (longer: alone)
    # a GRPO group's common prompt runs through the model once for its G completions (HF full-attention
    # policies; rl/learner/prefix_sharing.py); Odyssey's model computes every sequence whole either way
    share_prefixes: bool = True
    activation_checkpointing: bool = False  # per decoder layer: recompute activations in the backward
    # a micro-batch longer than this runs in windows of this many tokens carrying KDA/MLA state; 0 = off
    sequence_chunk_tokens: int = Field(0, ge=0)
    num_ranks: int = Field(1, ge=1)  # learner ranks (LearnerGroup): context_parallel x data-parallel groups
    # ranks one micro-batch is split across, in contiguous shards (model/context_parallel.py); 1 = off
    context_parallel: int = Field(1, ge=1)
    seed: int = 0  # model init and minibatch order

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {v}")
        return v

    @field_validator("mis_band")
    @classmethod
    def _mis_band(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (len(v) != 2 or not 0.0 <= v[0] < 1.0 < v[1]):
            raise ValueError(
                f"mis_band must be [lo, hi] with 0 <= lo < 1 < hi, e.g. [0.5, 2.0], or null; got {v}"
            )
        return v


class OrchestratorSection(_Section):
    """The training loop (rl/train/, docs/training.md): placement, sync/async, groups, buffer, weight sync,
    checkpoints, evaluation."""

    # placement: Ray resources of one actor each, e.g. {CPU: 1} or {CPU: 1, GPU: 1, rollout_node: 0.01}
    rollout_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    learner_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    # sync / async: policy versions a trajectory may lag behind the learner; 0 = on-policy
    max_staleness: int = Field(1, ge=0)
    # groups and failures
    max_infra_retries: int = Field(1, ge=0)  # re-runs of an infra-failed episode before it is masked
    max_worker_restarts: int = Field(4, ge=0)  # dead rollout workers replaced during a run, in all
    dynamic_sampling: bool = False  # DAPO: draw more groups until the batch has only non-zero-variance ones
    dynamic_sampling_cap: float = Field(3.0, ge=1.0)  # most groups drawn per step, x the batch's groups
    # experience buffer
    buffer_order: Literal["fifo", "length", "freshness", "priority"] = "fifo"
    # weight sync
    weight_sync_timeout_s: float = Field(300.0, gt=0.0)
    # checkpoints
    checkpoint_every: int = Field(50, ge=0)  # learner steps; 0 = only at the end
    keep_checkpoints: int = Field(3, ge=1)
    resume: bool = True  # continue from the latest checkpoint in logging.run_dir
    # evaluation on held-out tasks
    eval_every: int = Field(0, ge=0)  # learner steps between evaluations; 0 = none during training
    eval_episodes: int = Field(32, ge=1)  # sampled episodes per evaluation (+ one greedy per task)
    eval_pass_k: int = Field(4, ge=1)  # samples per held-out task: pass@1 and pass@k
    eval_difficulties: list[int] | None = None  # evaluate at each of these env difficulties; None = env's

    @field_validator("rollout_resources", "learner_resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if not x >= 0}
        if bad:
            raise ValueError(f"resource amounts must be >= 0, got {bad}")
        low = {k for k in v if k.lower() in ("cpu", "gpu") and k not in ("CPU", "GPU")}
        if low:
            raise ValueError(f"Ray spells the built-in resources CPU and GPU; got {sorted(low)}")
        return v


class WarmupSection(_Section):
    """The SFT warm-up on an env's oracle episodes (`odyssey warmup`, rl/warmup.py)."""

    steps: int = Field(250, ge=1)  # optimizer steps
    batch_size: int = Field(8, ge=1)  # oracle transcripts per step
    lr: float = Field(1e-3, gt=0.0)  # peak AdamW lr (from 2e-3: format learnt faster, digit copying stalls)
    warmup_steps: int = Field(10, ge=0)  # linear lr warm-up, then cosine decay to lr_min_ratio * lr
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)


class LoggingSection(_Section):
    """Outputs: the run directory and how often `odyssey train` prints its live line."""

    run_dir: str = "runs/default"
    log_every: int = Field(1, ge=1)  # learner steps between metric lines
    tensorboard: bool = True  # also write each metrics record to <run_dir>/tensorboard (rl/train/sinks.py)
    wandb_project: str | None = None  # also log to this W&B project (needs the wandb package)
    sample_rollouts: int = Field(2, ge=0)  # rollouts per step logged as text (samples_text.jsonl)


class StageEntry(_Section):
    """One stage of a progressive run (rl/train/stages.py): overrides and the gate that ends it."""

    name: str = Field(min_length=1)
    set: dict[str, Any] = Field(default_factory=dict)  # dotted env./rollout./learner./rewards. keys
    until_steps: int | None = Field(None, ge=1)  # advance after this many steps in the stage
    until_eval_success: float | None = Field(None, ge=0.0, le=1.0)  # ... or when a held-out eval reaches it


def _default_rewards() -> list[RewardEntry]:
    return [RewardEntry(name="outcome", weight=1.0)]


class RunConfig(_Section):
    """A whole run. Build with `load_config`; constructing it directly runs the same validation."""

    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection = Field(default_factory=EnvSection)
    rewards: list[RewardEntry] = Field(default_factory=_default_rewards)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    stages: list[StageEntry] = Field(default_factory=list)  # progressive stages; [] = one stage

    @model_validator(mode="after")
    def _meaning(self) -> RunConfig:
        problems = (
            _budget_problems(self)
            + _orchestrator_problems(self.orchestrator)
            + _init_from_problems(self.model)
            + _hf_problems(self)
            + (_model_problems(self.model) if not is_hf_policy(self.model) else [])
            + _reward_problems(self.rewards)
            + _env_problems(self.env, self.rewards)
        )
        if not problems and self.stages:
            from rl.train.stages import stage_problems

            problems = stage_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------------------
# Meaning checks (pass 2). Each returns "key.path: problem; fix" lines.
# ---------------------------------------------------------------------------------------------------------


def _budget_problems(c: RunConfig) -> list[str]:
    r, lr = c.rollout, c.learner
    out = []
    if r.sandbox_image is not None and r.sandbox_pool_size == 0:
        out.append(
            f"rollout.sandbox_image ({r.sandbox_image!r}) is the image of each worker's shared sandbox pool, "
            "and rollout.sandbox_pool_size=0 starts none (envs then lease from the default pool on the "
            "default image); set rollout.sandbox_pool_size >= 1 or remove rollout.sandbox_image"
        )
    if r.max_new_tokens > r.max_tokens:
        out.append(
            f"rollout.max_new_tokens ({r.max_new_tokens}) exceeds rollout.max_tokens ({r.max_tokens}), the "
            "whole-episode budget; lower max_new_tokens or raise max_tokens"
        )
    if lr.advantage in ("grpo", "rloo") and lr.group_size < 2:  # raft needs no baseline: any size
        out.append(
            f"learner.group_size ({lr.group_size}) must be >= 2 for {lr.advantage} (advantages are "
            "relative to the group); use 2 or more, or learner.advantage=gae"
        )
    elif lr.advantage in GROUPED_ADVANTAGES and r.episodes % lr.group_size:
        fit = lr.group_size * max(1, r.episodes // lr.group_size)
        out.append(
            f"rollout.episodes ({r.episodes}) must be a multiple of learner.group_size "
            f"({lr.group_size}) for {lr.advantage}; e.g. rollout.episodes={fit}"
        )
    if lr.advantage == "raft" and c.orchestrator.dynamic_sampling:
        out.append(
            "orchestrator.dynamic_sampling discards groups whose rewards are all equal, and raft trains "
            "on the all-success ones; set orchestrator.dynamic_sampling=false with learner.advantage=raft"
        )
    if lr.turn_credit and lr.advantage == "raft":
        out.append(
            "learner.turn_credit applies to grpo/rloo; raft trains successful episodes with one weight each. "
            "Set learner.turn_credit=false"
        )
    elif lr.turn_credit and lr.advantage == "gae":
        out.append(
            "learner.turn_credit applies to grpo/rloo; with advantage=gae per-turn rewards already land on "
            "their turn's tokens. Set learner.turn_credit=false"
        )
    out += _context_parallel_problems(lr)
    if lr.critic_preset is not None:
        if lr.advantage != "gae" or lr.value_model != "critic":
            out.append(
                "learner.critic_preset is only read with learner.advantage=gae and "
                "learner.value_model=critic; remove it or set both"
            )
        else:
            out += _critic_preset_problems(lr.critic_preset)
    return out


def _context_parallel_problems(lr: LearnerSection) -> list[str]:
    R = lr.context_parallel
    if R == 1:
        return []
    out = []
    if lr.num_ranks % R:
        out.append(
            f"learner.num_ranks ({lr.num_ranks}) must be a multiple of learner.context_parallel ({R}): the "
            f"ranks form num_ranks / context_parallel data-parallel groups of {R}; e.g. learner.num_ranks={R}"
        )
    if lr.sequence_chunk_tokens:
        out.append(
            "learner.sequence_chunk_tokens and learner.context_parallel > 1 do not combine yet (a rank runs "
            "its shard unchunked); set one of them (sequence_chunk_tokens=0 or context_parallel=1)"
        )
    if lr.activation_checkpointing:
        out.append(
            "learner.activation_checkpointing is not applied inside a context-parallel shard (recomputing "
            "the exchanges in the backward is not supported); set learner.activation_checkpointing=false "
            "or learner.context_parallel=1"
        )
    if lr.advantage == "gae" and lr.value_model == "critic":
        out.append(
            "learner.context_parallel does not split a separate critic's trunk; use learner.value_model=head "
            "or learner.context_parallel=1"
        )
    return out


def _orchestrator_problems(o: OrchestratorSection) -> list[str]:
    out = []
    if o.eval_episodes % o.eval_pass_k:
        fit = o.eval_pass_k * max(1, o.eval_episodes // o.eval_pass_k)
        out.append(
            f"orchestrator.eval_episodes ({o.eval_episodes}) must be a multiple of orchestrator.eval_pass_k "
            f"({o.eval_pass_k}): each held-out task is sampled eval_pass_k times; e.g. eval_episodes={fit}"
        )
    return out


def _critic_preset_problems(preset: str) -> list[str]:
    try:
        from model.config import PRESETS
    except ImportError:
        return []
    if preset in PRESETS:
        return []
    return [f"learner.critic_preset: unknown preset {preset!r} (choose from {', '.join(sorted(PRESETS))})"]


def _init_from_problems(m: ModelSection) -> list[str]:
    """model.init_from must be a saved checkpoint directory here and now (not a hub name found missing
    30 s later inside a Ray worker)."""
    if m.init_from is None:
        return []
    path = Path(m.init_from).expanduser()
    fix = "give the directory a checkpoint was saved to (e.g. by `odyssey warmup --out DIR`), or null"
    if not path.exists():
        return [f"model.init_from: directory {m.init_from!r} does not exist; {fix}"]
    if not path.is_dir():
        return [f"model.init_from: {m.init_from!r} is a file, not a checkpoint directory; {fix}"]
    if not (path / "config.json").is_file():
        return [f"model.init_from: {m.init_from!r} holds no config.json: not a saved checkpoint; {fix}"]
    return _preset_vs_checkpoint(m, path)


def is_hf_policy(m: ModelSection) -> bool:
    """The policy is an HF causal LM: model.hf_path, or model.init_from holding a non-Odyssey checkpoint."""
    if m.hf_path is not None:
        return True
    if m.init_from is None:
        return False
    try:
        saved = json.loads((Path(m.init_from).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False  # _init_from_problems names it
    return saved.get("model_type") != "odyssey_moe"


def _hf_problems(c: RunConfig) -> list[str]:
    """model.hf_path is a readable HF causal LM checkpoint, and no key asks for what only Odyssey's model
    has (docs/hf.md "Training any Hugging Face causal LM")."""
    m, lr = c.model, c.learner
    out: list[str] = []
    if m.hf_path is not None:
        path = Path(m.hf_path).expanduser()
        fix = ("give a local directory written by transformers' save_pretrained (no hub names: nothing is "
               "downloaded)")
        if m.init_from is not None:
            return [f"model.hf_path and model.init_from are both set ({m.hf_path!r}, {m.init_from!r}); the "
                    "policy loads from one directory: keep one of them"]
        if not path.is_dir():
            return [f"model.hf_path: {m.hf_path!r} is not a directory; {fix}"]
        if not (path / "config.json").is_file():
            return [f"model.hf_path: {m.hf_path!r} holds no config.json; {fix}"]
        try:
            saved = json.loads((path / "config.json").read_text())
        except ValueError as e:
            return [f"model.hf_path: {path / 'config.json'} is not valid JSON ({e}); {fix}"]
        if saved.get("model_type") == "odyssey_moe":
            out.append(f"model.hf_path: {m.hf_path!r} is an Odyssey checkpoint; load it with model.init_from")
    if not is_hf_policy(m):
        return out
    where = f"model.hf_path={m.hf_path}" if m.hf_path else f"model.init_from={m.init_from} (an HF checkpoint)"
    if m.overrides:
        out.append(f"model.overrides apply to Odyssey presets; with {where} edit the checkpoint's "
                   "config.json instead, or remove model.overrides")
    if lr.sequence_chunk_tokens:
        out.append(f"learner.sequence_chunk_tokens needs Odyssey's model (it carries the KDA/MLA state "
                   f"between windows); with {where} set it to 0")
    if lr.context_parallel > 1:
        out.append(f"learner.context_parallel needs Odyssey's model; with {where} set it to 1")
    if lr.advantage == "gae" and lr.value_model == "critic":
        out.append(f"learner.value_model=critic copies an Odyssey trunk; with {where} use value_model=head")
    try:
        saved = json.loads((Path(m.checkpoint).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return out
    out += _hybrid_problems(saved, where, c.rollout.engine)
    out += [f"{where}: {e}" for e in hf_attention_problems(saved)]
    vocab = (saved.get("text_config") or saved).get("vocab_size")
    own = (Path(m.checkpoint).expanduser() / "tokenizer.json").is_file()
    try:
        n_tok = _tokenizer_size(m.checkpoint)
    except ValueError as e:  # the checkpoint's own tokenizer is unusable: policy_tokenizer says why
        return [*out, f"{where}: {e}"]
    whose = "its own tokenizer" if own else "Odyssey's tokenizer (the checkpoint ships none)"
    if isinstance(vocab, int) and n_tok is not None and vocab < n_tok:
        out.append(f"{where}: the model's vocab_size ({vocab}) is smaller than {whose} ({n_tok} tokens); "
                   f"token ids would overflow its embedding. Use a model with vocab_size >= {n_tok}")
    return out


# HF hybrids whose linear-attention / state-space layers the learner's packed row cannot reset per sequence:
# model_type -> what those layers are. kimi_linear and glm5_next (KDA) are made packing-correct by
# model/hf_linear_attention.py (learner and TorchEngine; not the vLLM path yet).
_KDA_HYBRIDS = ("kimi_linear", "glm5_next")
_UNPACKED_HYBRIDS = {
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                     "olmo_hybrid", "qwen4_exp", "qwen4_exp_text"), "Gated DeltaNet linear-attention"),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "jamba", "zamba", "zamba2",
                     "nemotron_h", "granitemoehybrid"), "Mamba state-space"),
    **dict.fromkeys(("lfm2", "lfm2_moe", "inkling", "inkling_text"), "gated short-convolution"),
    "minimax": "Lightning linear-attention", "recurrent_gemma": "RG-LRU recurrent", "rwkv": "RWKV recurrent",
    "xlstm": "xLSTM recurrent", "zaya": "recurrent",
}
_RECURRENT_LAYER_WORDS = ("linear", "mamba", "conv", "recurrent", "ssm", "lightning", "lstm", "rwkv", "delta")


def _hybrid_problems(saved: dict, where: str, engine: str) -> list[str]:
    """An HF checkpoint (config.json `saved`) with linear-attention or state-space layers: refused unless
    Odyssey makes its packed forward per-sequence correct (kimi_linear, glm5_next: the learner and
    TorchEngine; refused for rollout.engine=vllm)."""
    text = saved.get("text_config") if isinstance(saved.get("text_config"), dict) else {}
    model_type = str(saved.get("model_type", ""))
    kind = _UNPACKED_HYBRIDS.get(model_type) or _UNPACKED_HYBRIDS.get(str(text.get("model_type", "")))
    layer_types = [str(t) for t in (saved.get("layer_types") or text.get("layer_types") or [])]
    odd = sorted({t for t in layer_types if any(w in t.lower() for w in _RECURRENT_LAYER_WORDS)})
    if model_type in _KDA_HYBRIDS:
        if engine == "torch":  # TorchEngine carries per-row KDA state (model/hf_policy.py, HFPackedCache)
            return []
        return [f"{where}: {model_type} (a KDA hybrid) trains in Odyssey's learner and generates with "
                f"TorchEngine (per-row recurrent + conv state, model/hf_linear_attention.py), but "
                f"rollout.engine={engine} cannot generate with it yet: the vLLM path has no per-row KDA "
                "state for it (issue 42). Set rollout.engine=torch (TorchEngine)"]
    if kind is None and not odd:
        return []
    what = f"{kind} layers" if kind else f"layers of type {', '.join(odd)}"
    return [f"{where}: model_type {model_type!r} is a hybrid with {what}. The learner packs sequences into "
            "one row, and Odyssey has no per-sequence state resets (cu_seqlens through the short "
            "convolutions and recurrences) for these layers, so every sequence after the first would train "
            "on state leaked from the one before it: silently wrong. Supported hybrids: kimi_linear and "
            "glm5_next (KDA); otherwise use a full-attention model (Llama, Qwen2/3, Qwen3-MoE)"]


def hf_attention_problems(saved: dict) -> list[str]:
    """Attention variants in an HF checkpoint's config.json that Odyssey's packed learner (per-sequence causal
    SDPA) and TorchEngine (one full KV row per sequence) cannot serve: each would otherwise pass validation
    and then fail every episode, or train on wrong log-probs (docs/hf.md, HF support)."""
    c = saved.get("text_config") or saved
    out: list[str] = []
    other = sorted({t for t in c.get("layer_types") or () if t != "full_attention"})
    window = c.get("sliding_window")
    if other:
        out.append(f"config.json has layer_types {other}; Odyssey serves full-attention layers only "
                   "('full_attention' for every layer). Use a full-attention model")
    elif isinstance(window, int) and c.get("use_sliding_window") is not False and not c.get("layer_types"):
        out.append(f"config.json sets sliding_window={window} (sliding-window attention), which Odyssey's "
                   "packed learner and TorchEngine do not apply. Use a full-attention model, or, when no "
                   f"trajectory will reach {window} tokens (the window then never applies), set "
                   '"sliding_window": null in config.json')
    if c.get("use_sliding_window") is True and not isinstance(window, int) and not other:
        out.append("config.json sets use_sliding_window=true; Odyssey serves full attention only: set it to "
                   "false or use a full-attention model")
    for field, what in (("attention_chunk_size", "chunked attention"), ("attn_logit_softcapping",
                                                                        "attention soft-capping")):
        if c.get(field) is not None:
            out.append(f"config.json sets {field}={c[field]} ({what}), which Odyssey's packed attention does "
                       f"not apply. Use a model without it (or set \"{field}\": null if it was trained "
                       "without it)")
    alibi = c.get("alibi") or (c.get("attn_config") or {}).get("alibi") or c.get("model_type") in ("bloom",)
    if alibi:
        out.append("config.json uses ALiBi position biases, which Odyssey's packed attention does not apply. "
                   "Use a model with rotary or no position embeddings")
    if c.get("model_type") in ("gpt_oss",):
        out.append(f"model_type {c['model_type']!r} uses attention sinks, which Odyssey's packed attention "
                   "does not apply. Use a model without them")
    return out


def _preset_vs_checkpoint(m: ModelSection, path: Path) -> list[str]:
    """With model.init_from, the checkpoint's architecture is loaded and model.overrides apply on top of it
    (rl/rollout/worker.build_policy). model.preset must then describe the checkpoint: a field where preset +
    overrides and checkpoint + overrides disagree would otherwise be silently ignored."""
    try:
        from model.config import PRESETS, OdysseyConfig
    except ImportError:
        return []
    if m.preset not in PRESETS or is_hf_policy(m):
        return []  # _model_problems names an unknown preset; an HF checkpoint has no preset
    try:
        saved = json.loads((path / "config.json").read_text())
        expected = OdysseyConfig.from_preset(m.preset, **m.overrides)
    except Exception:  # an unreadable config.json fails at load with its own message; bad overrides above
        return []
    own = [k for k in OdysseyConfig.__annotations__ if k in saved and k not in m.overrides]
    diff = [k for k in own if saved[k] != getattr(expected, k)]
    if not diff:
        return []
    brief = lambda v: json.dumps(v)[:40]  # noqa: E731
    shown = ", ".join(f"{k}={brief(saved[k])} (preset: {brief(getattr(expected, k))})" for k in diff[:4])
    match = [p for p in PRESETS if all(saved[k] == getattr(OdysseyConfig.from_preset(p), k) for k in own)]
    fix = f"set model.preset={match[0]}" if match else "set model.preset to the checkpoint's preset"
    return [
        f"model.preset: {m.preset!r} does not describe the checkpoint in model.init_from ({shown}); the "
        f"checkpoint's architecture is what loads, so {fix} (model.overrides apply on top of either)"
    ]


def _closest(word: str, options: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, list(options), n=1)
    return close[0] if close else None


def _model_problems(m: ModelSection) -> list[str]:
    try:
        from model.config import PRESETS, OdysseyConfig
    except ImportError:
        return []
    if m.preset not in PRESETS:
        hint = _closest(m.preset, PRESETS)
        return [
            f"model.preset: unknown preset {m.preset!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f" (choose from {', '.join(sorted(PRESETS))})"
        ]
    fields = [f.name for f in dataclasses.fields(OdysseyConfig) if f.name != "transformers_version"]
    out = []
    for k, v in m.overrides.items():
        path = f"model.overrides.{k}"
        if k not in fields:
            hint = _closest(k, fields)
            out.append(
                f"{path}: unknown model field" + (f"; did you mean 'model.overrides.{hint}'?" if hint else "")
            )
            continue
        from pydantic import TypeAdapter

        try:
            TypeAdapter(_field_type(OdysseyConfig, k), config=ConfigDict(strict=True)).validate_python(v)
        except ValidationError as e:
            out.append(f"{path}: {e.errors()[0]['msg']}, got {_show(v)}")
    if out:
        return out
    try:
        cfg = OdysseyConfig.from_preset(m.preset, **m.overrides)
    except Exception as e:  # the config's own validators: keep their message, drop the wrapper lines
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        msg = re.sub(r"^\w+Error: ", "", lines[-1]) if lines else type(e).__name__
        return [f"model.overrides: {msg}"]
    n_tok = _tokenizer_size()
    if n_tok is not None and cfg.vocab_size < n_tok:
        out.append(
            f"model.overrides.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({n_tok}); token ids would overflow the embedding. Use vocab_size >= {n_tok}"
        )
    return out


def _tokenizer_size(checkpoint: str | None = None) -> int | None:
    """Size of the policy's tokenizer (model.tokenizer.policy_tokenizer), None when it cannot be loaded
    here; a ValueError names a checkpoint tokenizer that is unusable."""
    try:
        from model.tokenizer import policy_tokenizer

        return len(policy_tokenizer(checkpoint))
    except (ImportError, FileNotFoundError):
        return None


def _field_type(cls: type, name: str) -> Any:
    """The annotation of dataclass field `name`, evaluated in its defining module (Any if that fails)."""
    for c in cls.__mro__:
        ann = c.__dict__.get("__annotations__", {})
        if name in ann:
            hint = ann[name]
            if isinstance(hint, str):
                try:
                    hint = eval(hint, vars(sys.modules[c.__module__]))  # noqa: S307 - source annotations
                except Exception:
                    return Any
            return hint
    return Any


def _reward_problems(rewards: list[RewardEntry]) -> list[str]:
    if not rewards:
        return ["rewards: empty; give at least one reward, e.g. rewards: [{name: outcome, weight: 1.0}]"]
    try:
        from rewards.compose import validate_reward_specs
    except ImportError:
        return []
    try:
        validate_reward_specs([r.model_dump(exclude_none=True) for r in rewards])
    except ValueError as e:
        lines = str(e).splitlines()
        body = [ln.strip().removeprefix("- ") for ln in lines[1:]] if len(lines) > 1 else lines
        return [ln if ln.startswith("rewards[") else f"rewards: {ln}" for ln in body if ln]
    return []


def _env_problems(env: EnvSection, rewards: Sequence[RewardEntry] = ()) -> list[str]:
    try:
        from envs.registry import NAMESPACES, EnvLoadError, EnvNotFoundError, entry_for, list_envs
    except ImportError:
        return []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = {e.id: e for e in list_envs(load=False)}
        try:
            entry = entry_for(env.id)
        except EnvNotFoundError as e:
            if "/" in env.id:  # a namespace's own message names its close matches
                return [f"env.id: {e}"]
            hint = _closest(env.id, [i for i, e in entries.items() if e.status != "broken"])
            return [
                f"env.id: unknown env {env.id!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (registered: {', '.join(sorted(entries))}, and "
                + ", ".join(f"{ns}/<name>" for ns in NAMESPACES)
                + "; `odyssey envs list` shows them)"
            ]
        except EnvLoadError as e:
            return [f"env.id: {e}"]
    if entry.status == "broken":
        return [f"env.id: env {env.id!r} is broken: {entry.error}"]
    factory = entry.factory
    if factory is None:
        from envs.dotted import DottedNameError, resolve_name

        try:
            factory = resolve_name(entry.entry_point, what="entry point")
        except DottedNameError as e:
            return [f"env.id: env {env.id!r} cannot be imported from {entry.entry_point}: {e.problem}"]
    out = []
    if "max_turns" in env.kwargs:
        out.append(
            "env.kwargs.max_turns: the turn limit has one source, rollout.max_turns (the env and the agent "
            "loop both read it); remove env.kwargs.max_turns and set "
            f"rollout.max_turns={env.kwargs['max_turns']}"
        )
    accepted = _accepted_kwargs(factory)
    if accepted is not None:
        out += [
            f"env.kwargs.{k}: unknown argument of env {env.id!r}"
            + (f"; did you mean 'env.kwargs.{hint}'?" if (hint := _closest(k, accepted)) else "")
            + f" (accepted: {', '.join(sorted(accepted))})"
            for k in env.kwargs
            if k not in accepted and k != "max_turns"
        ]
    return out + _dataset_problems(env, getattr(factory, "func", factory), rewards)


def _dataset_problems(env: EnvSection, env_cls: Any, rewards: Sequence[RewardEntry]) -> list[str]:
    """env.dataset against the file (readable, rows fit, split), the env (takes rows, needs them, its own
    checks), and TRL-form rewards (their required arguments are dataset columns or params)."""
    try:
        from envs.dataset import DatasetError, TaskDataset
    except ImportError:
        return []
    data = None
    if env.dataset is not None:
        d = env.dataset
        try:
            data = TaskDataset.load(d.path, d.eval_size, d.seed, d.prompt_field, d.answer_field)
        except DatasetError as e:
            return [f"env.dataset: {e}"]
    check = getattr(env_cls, "dataset_problems", None)
    out = [f"env.dataset: {p}" for p in check(data)] if check is not None else []
    if data is None and env.dataset is not None and check is None:
        out.append(f"env.dataset: env {env.id!r} is not an Odyssey ToolEnv and cannot take dataset rows")
    return out + _trl_column_problems(rewards, data)


def _trl_column_problems(rewards: Sequence[RewardEntry], data: Any) -> list[str]:
    """A TRL-form reward's required arguments (no default, not in params) must be dataset columns."""
    try:
        from rewards.registry import resolve_reward
        from rewards.trl_form import const_params, is_trl_form
    except ImportError:
        return []
    columns = set(data.columns) if data is not None else set()
    out = []
    for i, r in enumerate(rewards):
        try:
            fn = resolve_reward(r.name)
        except ValueError:
            continue  # reported by _reward_problems
        if not is_trl_form(fn):
            continue
        need = [
            p.name
            for p in const_params(fn)
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        missing = [n for n in need if n not in r.params and n not in columns]
        if missing:
            where = f"the columns of env.dataset ({', '.join(sorted(columns))})" if data else "no dataset"
            out.append(
                f"rewards[{i}] ({r.name}): this TRL-form reward needs {missing} as dataset columns (TRL "
                f"passes every column by name), but the tasks have {where}; add the columns, give them in "
                "params, or give the arguments defaults"
            )
    return out


def _accepted_kwargs(factory: Any) -> set[str] | None:
    """Keyword names a function or class accepts, following **kwargs up the MRO; None = anything goes."""
    if inspect.isclass(factory):
        fns = [
            c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__ and c is not object
        ]
    else:
        fns = [factory]
    names: set[str] = set()
    for fn in fns:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return None
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


# ---------------------------------------------------------------------------------------------------------
# Error formatting
# ---------------------------------------------------------------------------------------------------------


def _show(v: Any) -> str:
    s = repr(v)
    return (s if len(s) <= 60 else s[:57] + "...") + f" ({type(v).__name__})"


def _path(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        sub = _submodel(f.annotation)
        if sub is not None:
            out += _leaf_paths(sub, path + (".0." if typing.get_origin(f.annotation) is list else "."))
    return out


def _submodel(tp: Any) -> type[BaseModel] | None:
    """The section model behind an annotation (X, list[X], X | None), if any."""
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        sub = _submodel(arg)
        if sub is not None:
            return sub
    return None


def _children_at(loc: Sequence[Any]) -> list[str] | None:
    """Valid keys of the section at `loc` (list indices skipped), or None if it is a free-form mapping."""
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _submodel(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else None


def _unknown_key(loc: Sequence[Any]) -> str:
    path, key, parent = _path(loc), str(loc[-1]), list(loc[:-1])
    siblings = _children_at(parent) or []
    hint = _closest(key, siblings)
    if hint:
        return f"{path}: unknown key; did you mean '{_path([*parent, hint])}'?"
    # A misplaced key: the same (or a close) name in another section ("lr" -> "learner.lr").
    leaves = _leaf_paths(RunConfig)
    close = _closest(key, sorted({p.rsplit(".", 1)[-1] for p in leaves}))
    if close:
        where = " or ".join(f"'{p}'" for p in leaves if p.rsplit(".", 1)[-1] == close)
        return f"{path}: unknown key; did you mean {where}?"
    return f"{path}: unknown key" + (f" (valid keys here: {', '.join(siblings)})" if siblings else "")


def _format_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors(include_url=False):
        loc, kind = e["loc"], e["type"]
        if kind == "extra_forbidden":
            out.append(_unknown_key(loc))
        elif kind == "missing":
            out.append(f"{_path(loc)}: required key missing")
        elif not loc and kind == "value_error":
            msg = str(e["ctx"]["error"]) if "ctx" in e and "error" in e["ctx"] else e["msg"]
            out += msg.splitlines()
        elif kind == "value_error":  # a field validator's own message (it shows the value)
            out.append(f"{_path(loc)}: {e['ctx']['error']}")
        else:
            out.append(f"{_path(loc) or '(top level)'}: {e['msg']}, got {_show(e['input'])}")
    return out


# ---------------------------------------------------------------------------------------------------------
# Loading, overrides, writing
# ---------------------------------------------------------------------------------------------------------

_KEY_RE = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in raw config data (value parsed as YAML). ValueError names the problem."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ValueError(
            f"override {override!r}: expected KEY=VALUE with a dotted key, e.g. learner.lr=1e-5 "
            "or rewards.0.weight=0.5"
        )
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {override!r}: value is not valid YAML ({e.problem})") from e
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _descend(node, part, parts[: i + 1], override)
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, parts, override)] = value
    else:
        node[last] = value


def _index(node: list, part: str, parts: list[str], override: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ValueError(
            f"override {override!r}: {'.'.join(parts[:-1]) or 'list'} is a list of {len(node)} item(s); "
            f"address an item by index 0..{len(node) - 1}, got {part!r}"
        )
    return int(part)


def _defaults() -> dict[str, Any]:
    """Every default of RunConfig as plain data (for overrides that address into a section not written)."""
    return RunConfig.model_construct().model_dump(mode="json")


def _default_at(path: list[str]) -> Any:
    node: Any = _defaults()
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return copy.deepcopy(node) if isinstance(node, dict | list) else None


def _descend(node: Any, part: str, so_far: list[str], override: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, so_far, override)]
    child = node.get(part)
    if child is None:  # not in the file: start from the default (`learner.betas.0=0.5` sets one item)
        default = _default_at(so_far)
        child = node[part] = default if default is not None else {}
    if not isinstance(child, (dict, list)):
        raise ValueError(
            f"override {override!r}: {'.'.join(so_far)} is a value ({_show(child)}), not a section"
        )
    return child


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read YAML, apply dotted overrides, validate. Raises ConfigError listing every problem."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a config file" if path.is_dir() else "no such config file"
        raise ConfigError([f"{path}: {what} (configs/ holds the shipped ones, e.g. configs/tiny.yaml)"])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            [f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start} cannot be decoded; "
             "save the file as UTF-8"],
            path,
        ) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"YAML syntax error{at}: {getattr(e, 'problem', None) or e}"], path) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"(top level): expected a mapping of sections, got {_show(data)}"], path)
    problems = []
    for ov in overrides:
        try:
            apply_override(data, ov)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems, path)
    return validate_config(data, source=path)


def validate_config(data: dict[str, Any], source: str | Path | None = None) -> RunConfig:
    """RunConfig from raw data; ConfigError (not pydantic's ValidationError) on any problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source) from None


def write_resolved(config: RunConfig, run_dir: str | Path) -> Path:
    """Write the fully resolved config to `<run_dir>/config.yaml` (load_config reads it back unchanged)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / RESOLVED_NAME
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text("# resolved by odyssey; reload with rl.config.load_config\n" + config.to_yaml())
    tmp.replace(out)
    return out


def cli_main(argv: list[str]) -> int:
    """`odyssey config show FILE [k=v ...]`: print the resolved config; exit 2 listing the problems."""
    parser = argparse.ArgumentParser(prog="odyssey config", description="Odyssey run configs")
    sub = parser.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print a config resolved with defaults and overrides")
    show.add_argument("file", help="YAML run config, e.g. configs/tiny.yaml")
    show.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. learner.lr=1e-5"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.file, args.overrides)
    except ConfigError as e:
        print(f"odyssey config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))


__all__ = [
    "ConfigError",
    "EnvSection",
    "LearnerSection",
    "LoggingSection",
    "ModelSection",
    "OrchestratorSection",
    "RewardEntry",
    "RolloutSection",
    "RunConfig",
    "apply_override",
    "cli_main",
    "load_config",
    "parse_yaml",
    "validate_config",
    "write_resolved",
]
