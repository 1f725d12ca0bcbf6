"""Reward composition from config: parse and validate specs, score trajectories, aggregate metrics.

YAML (a list; see docs/rewards.md):

    rewards:
      - {name: outcome, weight: 1.0}
      - {name: overlong, weight: 1.0, params: {max_completion_len: 8192, soft_punish_cache: 1024}}
      - {name: my_pkg.rewards:brevity, weight: 0.1, params: {target: 200}, key: brevity}

`validate_reward_specs` runs at config load and raises one ValueError listing every bad spec.
`compose(traj, specs)` fills traj.rewards / traj.turn_rewards:

    traj.rewards[key]          = value_k                      (unweighted, per spec)
    traj.rewards[key/c]        = component c of spec k        (logging only)
    traj.rewards["total"]      = sum_k weight_k * value_k
    traj.turn_rewards[i]       = sum_{k with per_turn} weight_k * per_turn_k[i]

A reward function that raises (or returns garbage) sets traj.reward_error and leaves no rewards,
so the trajectory is excluded (`is_trainable`) and counted (`RewardMetrics`), never silently zero.
A trajectory with an infrastructure error is not scored at all.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.trajectory import Trajectory
from rewards.base import PARAM_CHECK_ATTR, normalize_result
from rewards.registry import BUILTINS, resolve_reward

log = logging.getLogger(__name__)

SPEC_KEYS = ("name", "weight", "params", "key")
RESERVED_KEYS = ("total",)


@dataclass(frozen=True)
class RewardSpec:
    """One validated entry of the reward list. `key` names its entry in traj.rewards."""

    name: str
    weight: float
    params: dict[str, Any]
    key: str
    fn: Callable = field(repr=False, compare=False)


def _type_ok(value: Any, hint: Any) -> bool:
    """Shallow check of a YAML value against a simple annotation; unknown annotations pass."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (dict, list, tuple) or hint in (dict, list, tuple):
        return isinstance(value, origin or hint)
    return True


def _check_params(name: str, fn: Callable, params: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no introspectable signature (some C callables): checked when called
    ps = list(sig.parameters.values())
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD, ps[0].VAR_POSITIONAL):
        raise ValueError(
            f"{name}{sig} must take the trajectory as its first positional argument: def fn(traj, **params)"
        )
    accepted = [p.name for p in ps[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    try:
        bound = sig.bind(None, **params)
    except TypeError as e:
        unknown = [k for k in params if k not in sig.parameters]
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, accepted, n=1)
            if close:
                hints.append(f"{k!r} -> did you mean {close[0]!r}?")
        raise ValueError(
            f"params {sorted(params)} do not fit {name}{sig}: {e}. "
            f"Accepted params: {', '.join(accepted) or '(none)'}" + (f". {'; '.join(hints)}" if hints else "")
        ) from e
    try:
        hints_by_name = typing.get_type_hints(fn)
    except Exception:
        hints_by_name = {}
    for k, v in params.items():
        hint = hints_by_name.get(k, inspect.Parameter.empty)
        if not _type_ok(v, hint):
            want = getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint)
            raise ValueError(f"param {k}={v!r} ({type(v).__name__}) does not match its annotation {want}")
    checker = getattr(fn, PARAM_CHECK_ATTR, None)
    if checker is not None:
        bound.apply_defaults()
        checker(**dict(list(bound.arguments.items())[1:]))  # raises ValueError naming the bad value


def parse_reward_spec(spec: Any, index: int = 0) -> RewardSpec:
    """Validate and resolve one spec dict (or pass a RewardSpec through). ValueError on any problem."""
    if isinstance(spec, RewardSpec):
        return spec
    where = f"rewards[{index}]"
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where}: expected a mapping {{name, weight, params}}, got {type(spec).__name__} {spec!r}"
        )
    where = f"rewards[{index}] ({spec.get('name', '?')})"
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        sugg = [difflib.get_close_matches(str(k), SPEC_KEYS, n=1) for k in unknown]
        hint = "; ".join(f"{k!r} -> {s[0]!r}?" for k, s in zip(unknown, sugg) if s)
        raise ValueError(
            f"{where}: unknown field(s) {unknown}; a reward spec has {', '.join(SPEC_KEYS)}"
            + (f" ({hint})" if hint else "")
        )
    if "name" not in spec:
        raise ValueError(f"{where}: missing 'name' (a built-in such as 'outcome', or 'pkg.module:function')")
    name = spec["name"]
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(float(weight)):
        raise ValueError(
            f"{where}: weight must be a finite number, got {weight!r} ({type(weight).__name__})"
            + ("; remove the quotes around it in YAML" if isinstance(weight, str) else "")
        )
    params = spec.get("params") or {}
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise ValueError(f"{where}: params must be a mapping of parameter name -> value, got {params!r}")
    try:
        fn = resolve_reward(name)
        _check_params(name, fn, params)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    key = spec.get("key")
    if key is None:
        key = name if name in BUILTINS else name.split(":")[1].split(".")[-1]
    if not isinstance(key, str) or not key or "/" in key:
        raise ValueError(f"{where}: key must be a non-empty string without '/', got {key!r}")
    if key in RESERVED_KEYS:
        raise ValueError(f"{where}: key {key!r} is reserved; choose another key")
    return RewardSpec(name=name, weight=float(weight), params=dict(params), key=key, fn=fn)


def validate_reward_specs(specs: Any) -> list[RewardSpec]:
    """Parse a list of reward specs; raise one ValueError listing every problem (before any rollout).

    Checks: unknown built-in name (with the closest match), bad "pkg.module:fn" (module missing,
    attribute missing, not callable), params that do not bind to the function's signature or do not
    match simple annotations or the function's param checker, non-numeric weight, duplicate keys.
    An empty list is valid here; `compose` refuses to score with no rewards.
    """
    if specs is None:
        return []
    if isinstance(specs, (dict, str)) or not isinstance(specs, Sequence):
        raise ValueError(
            f"rewards must be a list of {{name, weight, params}} mappings, got {type(specs).__name__}"
        )
    parsed, errors = [], []
    for i, s in enumerate(specs):
        try:
            parsed.append(parse_reward_spec(s, i))
        except ValueError as e:
            errors.append(str(e))
    seen: dict[str, int] = {}
    for i, p in enumerate(parsed):
        if p.key in seen:
            errors.append(
                f"two rewards share the key {p.key!r}; give one of them a distinct 'key:' "
                "(each key names one entry of traj.rewards)"
            )
        seen[p.key] = i
    if errors:
        raise ValueError("invalid reward config:\n  - " + "\n  - ".join(errors))
    return parsed


def specs_from_yaml(text: str) -> list[RewardSpec]:
    """Parse a YAML list of reward specs (or a mapping with a `rewards:` list) and validate it."""
    import yaml

    data = yaml.safe_load(text)
    if isinstance(data, dict) and "rewards" in data:
        data = data["rewards"]
    return validate_reward_specs(data)


# ---- scoring -----------------------------------------------------------------------------------


def infra_error_of(traj: Trajectory) -> str | None:
    """traj.infra_error, or the first infra_error an env step reported."""
    if traj.infra_error:
        return traj.infra_error
    for info in traj.step_infos:
        if info.infra_error:
            return info.infra_error
    return None


def compose(traj: Trajectory, specs: Sequence[RewardSpec | dict]) -> Trajectory:
    """Score `traj` in place with every spec and return it. Never raises for a failing reward function."""
    specs = validate_reward_specs(specs)  # RewardSpecs pass through; dicts are parsed
    if not specs:
        raise ValueError("compose needs at least one reward spec; configure `rewards:` (docs/rewards.md)")
    traj.rewards, traj.turn_rewards, traj.reward_error = {}, [], None
    traj.metadata.pop("reward_failed", None)
    infra = infra_error_of(traj)
    if infra is not None:
        traj.metadata["reward_status"] = "skipped_infra_error"
        return traj
    n = traj.n_assistant_turns
    rewards: dict[str, float] = {}
    per_turn = np.zeros(n, dtype=np.float64)
    total = 0.0
    errors: list[str] = []
    failed: list[str] = []
    for spec in specs:
        try:
            out = spec.fn(traj, **spec.params)
        except Exception as e:
            log.warning("reward %r (%s) raised", spec.key, spec.name, exc_info=True)
            errors.append(f"reward {spec.key!r} ({spec.name}) raised {type(e).__name__}: {e}")
            failed.append(spec.key)
            continue
        try:
            res = normalize_result(out, n)
        except (TypeError, ValueError) as e:
            errors.append(f"reward {spec.key!r} ({spec.name}) {e}")
            failed.append(spec.key)
            continue
        rewards[spec.key] = res.value
        for c, v in res.components.items():
            rewards[f"{spec.key}/{c}"] = v
        total += spec.weight * res.value
        if res.per_turn is not None:
            per_turn += spec.weight * np.asarray(res.per_turn, dtype=np.float64)
    if errors:
        traj.reward_error = "; ".join(errors)
        traj.metadata["reward_status"] = "error"
        traj.metadata["reward_failed"] = failed
        return traj
    rewards["total"] = total
    traj.rewards = rewards
    traj.turn_rewards = per_turn.tolist()
    traj.metadata["reward_status"] = "ok"
    return traj


def untrainable_reason(traj: Trajectory) -> str | None:
    """Why `traj` must stay out of advantage groups, or None when it may be trained on."""
    infra = infra_error_of(traj)
    if infra is not None:
        return f"infra_error: {infra}"
    if traj.reward_error:
        return f"reward_error: {traj.reward_error}"
    if "total" not in traj.rewards:
        return "not scored: call rewards.compose(traj, specs) first"
    if traj.n_generated == 0:
        return "no generated tokens"
    return None


def is_trainable(traj: Trajectory) -> bool:
    """True when traj was scored without errors, had no infra failure and has generated tokens.
    The learner forms advantage groups only from trainable trajectories."""
    return untrainable_reason(traj) is None


@dataclass
class RewardMetrics:
    """Aggregate over a batch: per-key mean of scored trajectories, error and infra-error counts."""

    n: int = 0
    n_scored: int = 0
    n_reward_errors: int = 0
    n_infra_errors: int = 0
    n_trainable: int = 0
    errors_by_key: dict[str, int] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def update(self, traj: Trajectory) -> None:
        self.n += 1
        if infra_error_of(traj) is not None:
            self.n_infra_errors += 1
        elif traj.reward_error:
            self.n_reward_errors += 1
            for k in traj.metadata.get("reward_failed") or ["?"]:
                self.errors_by_key[k] = self.errors_by_key.get(k, 0) + 1
        elif "total" in traj.rewards:
            self.n_scored += 1
            for k, v in traj.rewards.items():
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.counts[k] = self.counts.get(k, 0) + 1
        self.n_trainable += is_trainable(traj)

    def merge(self, other: RewardMetrics) -> RewardMetrics:
        out = RewardMetrics(
            self.n + other.n,
            self.n_scored + other.n_scored,
            self.n_reward_errors + other.n_reward_errors,
            self.n_infra_errors + other.n_infra_errors,
            self.n_trainable + other.n_trainable,
        )
        for src in (self, other):
            for k, v in src.errors_by_key.items():
                out.errors_by_key[k] = out.errors_by_key.get(k, 0) + v
            for k, v in src.sums.items():
                out.sums[k] = out.sums.get(k, 0.0) + v
                out.counts[k] = out.counts.get(k, 0) + src.counts[k]
        return out

    @classmethod
    def from_trajectories(cls, trajs: Iterable[Trajectory]) -> RewardMetrics:
        m = cls()
        for t in trajs:
            m.update(t)
        return m

    def as_dict(self, prefix: str = "reward/") -> dict[str, float]:
        d = {
            f"{prefix}n": float(self.n),
            f"{prefix}n_scored": float(self.n_scored),
            f"{prefix}reward_errors": float(self.n_reward_errors),
            f"{prefix}infra_errors": float(self.n_infra_errors),
            f"{prefix}trainable_frac": self.n_trainable / self.n if self.n else 0.0,
        }
        for k, v in self.errors_by_key.items():
            d[f"{prefix}errors/{k}"] = float(v)
        for k, v in self.sums.items():
            d[f"{prefix}{k}/mean"] = v / self.counts[k]
        return d


def compose_batch(trajs: Iterable[Trajectory], specs: Sequence[RewardSpec | dict]) -> RewardMetrics:
    """compose() every trajectory (in place) and return the batch's RewardMetrics."""
    specs = validate_reward_specs(specs)
    m = RewardMetrics()
    for t in trajs:
        m.update(compose(t, specs))
    return m
