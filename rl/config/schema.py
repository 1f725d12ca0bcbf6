"""The run config's schema: pydantic sections with strict types, `extra="forbid"`, ranges and per-field
validators. Pure: it imports nothing else of the repo and reads no file, so constructing a `RunConfig`
checks its structure only; the meaning checks (rl/config/checks.py) run in `load_config`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator


class ConfigError(ValueError):
    """A config that must not start. `problems` holds one line per problem, each naming its key path."""

    def __init__(self, problems: Sequence[str], source: str | Path | None = None) -> None:
        self.problems = list(problems)
        self.source = str(source) if source is not None else None
        head = f"invalid config {self.source}" if self.source else "invalid config"
        super().__init__(f"{head}:\n" + "\n".join(f"  - {p}" for p in self.problems))


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
    # or an embedded model's alias (model/embedded.py, e.g. smollm2-135m-instruct), resolved by load_config

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

    engine: str = "torch"  # rl/rollout/worker.py: torch (TorchEngine) | vllm (VllmEngine) | pkg.module:fn
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


class LoraSection(_Section):
    """LoRA adapters (rl/learner/lora.py, docs/learner.md "LoRA"): only these low-rank weights train."""

    rank: int = Field(8, ge=1)  # r: the adapters' inner dimension
    alpha: float = Field(16.0, gt=0.0)  # the update is (alpha / rank) B A
    # names of the trunk's Linear layers; a name matches every module whose name ends in "." + it
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input, in the learner's forwards


class LearnerSection(_Section):
    """Policy optimisation (rl/learner/, docs/learner.md): advantages, loss, off-policy correction, optimiser,
    packing and data parallelism."""

    # an estimator of rl/learner/estimators.py: grpo (group mean baseline) | rloo (leave-one-out) | gae (PPO,
    # value model) | raft (each group's best successes, weight 1 per task) | pkg.module:attr (your own)
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"  # rl/learner/losses.py: ppo_clip | gspo | cispo | pkg.module:fn (your own)
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
    # grpo/rloo: the loss normalisers (N tokens, E episodes) also count the all-equal groups dropped from the
    # loss, as TRL's GRPOTrainer does (it trains them at advantage 0); false: DAPO, kept groups only
    equal_groups_in_normaliser: bool = False
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
    # how the ranks hold the model: none = data parallelism (a whole copy each, DDP); fsdp = FSDP2
    # (parameters, gradients and AdamW state sharded over the ranks, rl/learner/fsdp.py); ep = DDP with the
    # routed experts split over the ranks (model/expert_parallel.py); fsdp+ep = FSDP2 plus the experts split
    sharding: Literal["none", "fsdp", "ep", "fsdp+ep"] = "none"
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute dtype; auto: bf16 on CUDA
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # the gradient reduce-scatter's dtype
    seed: int = 0  # model init and minibatch order
    # train LoRA adapters only (HF policies); the engines get merged weights. null = full fine-tuning
    lora: LoraSection | None = None

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
    # what dynamic sampling discards: rl/train/group_filters.py, zero_variance | pkg.module:fn (keep = True)
    group_filter: str = "zero_variance"
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
    """A whole run. Build with `load_config` (structure and meaning checks); constructing it directly checks
    the structure only (rl/config/checks.py holds the meaning checks, which read files)."""

    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection = Field(default_factory=EnvSection)
    rewards: list[RewardEntry] = Field(default_factory=_default_rewards)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    stages: list[StageEntry] = Field(default_factory=list)  # progressive stages; [] = one stage

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------------------
# Introspection (error messages, the config-key tests)
# ---------------------------------------------------------------------------------------------------------


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


__all__ = [
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
]
