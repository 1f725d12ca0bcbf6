"""Run configuration: one YAML file describes a whole run; every mistake is reported before anything starts.

    cfg = load_config("configs/tiny.yaml", ["learner.lr=1e-5", "rollout.num_workers=4"])
    write_resolved(cfg, cfg.logging.run_dir)          # -> <run_dir>/config.yaml, reloadable as is

Sections (docs/config.md lists every key): model, env, rewards, rollout, learner, orchestrator, logging.

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
import dataclasses
import difflib
import inspect
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
    pass


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
    """YAML with 1.2-style floats (`1e-5` is a float)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


# ---------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    """The policy: a `model.config` preset plus field overrides (validated against OdysseyConfig)."""

    preset: str = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_from: str | None = None  # a saved checkpoint directory; None = fresh init from learner.seed


class EnvSection(_Section):
    """The environment: an id known to `envs` (built-in or plugin) and the kwargs for `envs.make`."""

    id: str = "arith"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardEntry(_Section):
    """One reward: a built-in name or "pkg.module:fn", its weight, params, and an optional result key."""

    name: str = Field(min_length=1)
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    key: str | None = None


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


class LearnerSection(_Section):
    """Policy optimisation: algorithm, optimiser, loss, advantages and micro-batching."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = Field(100, ge=1)
    lr: float = Field(1e-5, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = Field(1.0, gt=0.0)  # max global grad norm
    group_size: int = Field(8, ge=1)  # GRPO: episodes per task (the advantage baseline group)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # std-normalisation of GRPO advantages
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)  # ratio clipped to [1 - low, 1 + high]
    clip_eps_high: float = Field(0.28, gt=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    tis_cap: float | None = Field(2.0, gt=0.0)  # truncated IS weight cap (rollout vs learner); None = off
    routing_replay: bool = True  # R3: replay the rollout's expert choices in the learner forward
    ppo_epochs: int = Field(1, ge=1)
    num_minibatches: int = Field(1, ge=1)  # optimizer steps per policy step
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # PPO / GAE
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    value_coef: float = Field(0.5, ge=0.0)
    value_clip: float = Field(0.2, gt=0.0)
    micro_batch_tokens: int = Field(16384, ge=1)  # packed tokens per forward/backward
    seed: int = 0

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {v}")
        return v


class OrchestratorSection(_Section):
    """The training loop: off-policy bound, checkpoints, resumption."""

    max_staleness: int = Field(1, ge=0)  # policy versions a trajectory may lag behind the learner
    checkpoint_every: int = Field(50, ge=0)  # learner steps; 0 = only at the end
    keep_checkpoints: int = Field(3, ge=1)
    resume: bool = True  # continue from the latest checkpoint in logging.run_dir


class LoggingSection(_Section):
    run_dir: str = "runs/default"
    log_every: int = Field(1, ge=1)  # learner steps between metric lines
    level: Literal["debug", "info", "warning", "error"] = "info"


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

    @model_validator(mode="after")
    def _meaning(self) -> RunConfig:
        problems = (
            _budget_problems(self)
            + _model_problems(self.model)
            + _reward_problems(self.rewards)
            + _env_problems(self.env)
        )
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
    if r.max_new_tokens > r.max_tokens:
        out.append(
            f"rollout.max_new_tokens ({r.max_new_tokens}) exceeds rollout.max_tokens ({r.max_tokens}), the "
            "whole-episode budget; lower max_new_tokens or raise max_tokens"
        )
    if lr.micro_batch_tokens < r.max_tokens:
        out.append(
            f"learner.micro_batch_tokens ({lr.micro_batch_tokens}) < rollout.max_tokens ({r.max_tokens}): "
            "a whole trajectory must fit in one packed micro-batch; raise learner.micro_batch_tokens"
        )
    if lr.algorithm == "grpo":
        if lr.group_size < 2:
            out.append(
                f"learner.group_size ({lr.group_size}) must be >= 2 for grpo (advantages are relative "
                "to the group); use 2 or more, or learner.algorithm=ppo"
            )
        elif r.episodes % lr.group_size:
            fit = lr.group_size * max(1, r.episodes // lr.group_size)
            out.append(
                f"rollout.episodes ({r.episodes}) must be a multiple of learner.group_size "
                f"({lr.group_size}) for grpo; e.g. rollout.episodes={fit}"
            )
    return out


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


def _tokenizer_size() -> int | None:
    try:
        from model.tokenizer import load_tokenizer

        return len(load_tokenizer())
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


def _env_problems(env: EnvSection) -> list[str]:
    try:
        from envs.registry import list_envs
    except ImportError:
        return []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = {e.id: e for e in list_envs(load=False)}
    entry = entries.get(env.id) or next((e for e in entries.values() if e.gym_id == env.id), None)
    if entry is None:
        hint = _closest(env.id, [i for i, e in entries.items() if e.status != "broken"])
        return [
            f"env.id: unknown env {env.id!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f" (registered: {', '.join(sorted(entries))}; `odyssey envs list` shows them)"
        ]
    if entry.status == "broken":
        return [f"env.id: env {env.id!r} is broken: {entry.error}"]
    factory = entry.factory
    if factory is None:
        from envs.dotted import DottedNameError, resolve_name

        try:
            factory = resolve_name(entry.entry_point, what="entry point")
        except DottedNameError as e:
            return [f"env.id: env {env.id!r} cannot be imported from {entry.entry_point}: {e.problem}"]
    accepted = _accepted_kwargs(factory)
    if accepted is None:
        return []
    return [
        f"env.kwargs.{k}: unknown argument of env {env.id!r}"
        + (f"; did you mean 'env.kwargs.{hint}'?" if (hint := _closest(k, accepted)) else "")
        + f" (accepted: {', '.join(sorted(accepted))})"
        for k in env.kwargs
        if k not in accepted
    ]


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


def _descend(node: Any, part: str, so_far: list[str], override: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, so_far, override)]
    child = node.get(part)
    if child is None:
        child = node[part] = {}
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
        data = parse_yaml(path.read_text(encoding="utf-8"))
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
