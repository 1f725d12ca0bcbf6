"""Loading a run config: YAML (1.2-style floats, no duplicate keys), dotted overrides, the two validation
passes with every problem listed in one `ConfigError`, the resolved file, progressive stages' configs, and
`odyssey config show`.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rl.config.checks import _closest, _show, config_problems
from rl.config.schema import ConfigError, RunConfig, _leaf_paths, _submodel

RESOLVED_NAME = "config.yaml"


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
# Error formatting
# ---------------------------------------------------------------------------------------------------------


def _path(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)

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


def _embedded_resolved(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`data` with a `model.hf_path` that names an embedded model (model/embedded.py, e.g.
    smollm2-135m-instruct) replaced by its converted checkpoint directory (converted on first use, nothing
    downloaded), before the schema: every consumer of the config (learner, workers, vLLM, the tokenizer, the
    run's saved config.yaml) reads the directory. A path is kept; an unknown bare name is a problem."""
    model = data.get("model")
    hf_path = model.get("hf_path") if isinstance(model, dict) else None
    if not isinstance(hf_path, str):
        return data, []
    from model.embedded import resolve_hf_path

    try:
        return {**data, "model": {**model, "hf_path": resolve_hf_path(hf_path)}}, []
    except ValueError as e:
        return data, [f"model.hf_path: {e}"]


def validate_config(data: dict[str, Any], source: str | Path | None = None, io: bool = True) -> RunConfig:
    """RunConfig from raw data: the schema (pass 1), then the meaning checks (pass 2, rl/config/checks.py;
    io=False: only those that read no file), then every stage's own config. ConfigError (not pydantic's
    ValidationError) listing every problem of the first pass that has any."""
    if io:
        data, problems = _embedded_resolved(data)
        if problems:
            raise ConfigError(problems, source)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source) from None
    problems = config_problems(cfg, io)
    if not problems and cfg.stages:
        problems = stage_problems(cfg)
    if problems:
        raise ConfigError([ln for p in problems for ln in p.splitlines()], source)
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Progressive stages (rl/train/stages.py runs them)
# ---------------------------------------------------------------------------------------------------------

STAGE_PREFIXES = ("env.", "rollout.", "learner.", "rewards.")
# keys a stage cannot change: the run's length, its seeds (task identity), and what checkpoints and the
# experience buffer are built around (group shape, advantage estimator, value model, LoRA adapters)
FIXED_KEYS = (
    "learner.steps",
    "learner.group_size",
    "learner.advantage",
    "learner.value_model",
    "learner.critic_preset",
    "learner.lora",
    "learner.seed",
    "rollout.seed",
)


def stage_config(cfg: RunConfig, index: int, io: bool = False) -> RunConfig:
    """The effective RunConfig of stage `index`: `cfg` with the stage's `set` applied and no `stages`.
    Checked by the schema and the meaning checks that read no file (io=True: all of them; `load_config`
    ran those on every stage already). Raises ConfigError naming the stage when the result is invalid."""
    stage = cfg.stages[index]
    data = cfg.model_dump(mode="json")
    data["stages"] = []
    try:
        for key, value in stage.set.items():
            apply_override(data, f"{key}={json.dumps(value)}")
        return validate_config(data, io=io)
    except ConfigError as e:
        raise ConfigError([f"stages.{index} ({stage.name}): {p}" for p in e.problems]) from None
    except ValueError as e:  # an override that does not address the config (apply_override)
        raise ConfigError([f"stages.{index} ({stage.name}): {e}"]) from None


def stage_problems(cfg: RunConfig) -> list[str]:
    """Config-time checks of `stages`: keys, gates, and each stage's own config (every check)."""
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
            elif any(key == k or key.startswith(k + ".") for k in FIXED_KEYS):
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
            stage_config(cfg, i, io=True)
        except ConfigError as e:
            out += e.problems
    return out


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


__all__ = [
    "FIXED_KEYS",
    "RESOLVED_NAME",
    "STAGE_PREFIXES",
    "apply_override",
    "cli_main",
    "load_config",
    "parse_yaml",
    "stage_config",
    "stage_problems",
    "validate_config",
    "write_resolved",
]
