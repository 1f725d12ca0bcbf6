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

A reward function that raises (SystemExit included) or returns garbage (a non-finite value, per-turn
value or component included) sets traj.reward_error and leaves no rewards,
so the trajectory is excluded (`is_trainable`) and counted (`RewardMetrics`), never silently zero.
A trajectory with an infrastructure error is not scored at all.

Two forms of reward function (docs/rewards.md): Odyssey's `fn(traj, **params)`, called per trajectory,
and TRL's batched `fn(prompts, completions, completion_ids, **dataset_columns) -> list[float]`
(rewards/trl_form.py), called once per batch. Either may be `async def`: `acompose` / `acompose_batch`
await every async function concurrently (one task per trajectory for the per-trajectory form), each
call limited by the spec's `timeout_s` (default `DEFAULT_TIMEOUT_S`); a call past it is a reward
error, never a 0. Plain-def functions run, one thread per spec and batch, on a thread of their own
(envs/threads.py) with the same limit, so a slow or hung reward never holds the rollout worker's event
loop (its engine and every other episode). `compose` / `compose_batch` are the same for callers without a
running event loop (plain-def functions then run inline, unlimited; with async specs they run a loop with
asyncio.run).
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import logging
import math
import numbers
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

from envs.threads import HungThreadsError, OwnThreadTimeout, run_in_own_thread
from envs.trajectory import Trajectory
from rewards import trl_form
from rewards.base import PARAM_CHECK_ATTR, normalize_result
from rewards.registry import BUILTINS, resolve_reward

log = logging.getLogger(__name__)

SPEC_KEYS = ("name", "weight", "params", "key", "timeout_s")
RESERVED_KEYS = ("total",)
DEFAULT_TIMEOUT_S = 60.0  # a reward's call limit in acompose when its spec sets no timeout_s


@dataclass(frozen=True)
class RewardSpec:
    """One validated entry of the reward list. `key` names its entry in traj.rewards. form: "trajectory"
    (fn(traj, **params)) or "trl" (batched, rewards/trl_form.py); is_async: `async def`; timeout_s: the
    limit of one call in `acompose` (async: each call; plain def: the spec's calls on one batch)."""

    name: str
    weight: float
    params: dict[str, Any]
    key: str
    fn: Callable = field(repr=False, compare=False)
    form: str = "trajectory"
    is_async: bool = False
    timeout_s: float | None = None


_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)  # YAML "0.5" is not a float; 1 is


def _params_model(fn: Callable, params: list[inspect.Parameter]) -> type[BaseModel]:
    """A pydantic model of `fn`'s keyword params (after the trajectory): each annotation checked strictly
    (no string-to-number coercion; ints are accepted for floats), defaults kept, unknown names forbidden
    unless `fn` takes **kwargs. An annotation pydantic cannot check (a custom class without a schema)
    accepts anything, as an unannotated param does."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = hints.get(p.name, Any)
        try:
            TypeAdapter(hint, config=_STRICT)
        except Exception:
            hint = Any
        fields[p.name] = (hint, ... if p.default is inspect.Parameter.empty else p.default)
    config = _STRICT | {"extra": "allow" if any(p.kind == p.VAR_KEYWORD for p in params) else "forbid"}
    return create_model(f"{getattr(fn, '__name__', 'reward')}_params", __config__=config, **fields)


def _param_problems(name: str, sig: inspect.Signature, accepted: list[str], err: ValidationError) -> str:
    """pydantic's errors as one message naming each param and the fix."""
    unknown = [str(e["loc"][0]) for e in err.errors() if e["type"] == "extra_forbidden"]
    missing = [str(e["loc"][0]) for e in err.errors() if e["type"] == "missing"]
    out = []
    if unknown or missing:
        what = [f"unexpected param(s) {unknown}"] if unknown else []
        what += [f"missing required param(s) {missing}"] if missing else []
        close = {k: difflib.get_close_matches(k, accepted, n=1) for k in unknown}
        hints = [f"{k!r} -> did you mean {c[0]!r}?" for k, c in close.items() if c]
        out.append(
            f"params do not fit {name}{sig}: {' and '.join(what)}. "
            f"Accepted params: {', '.join(accepted) or '(none)'}" + (f". {'; '.join(hints)}" if hints else "")
        )
    for e in err.errors():
        if e["type"] in ("extra_forbidden", "missing"):
            continue
        where, value = ".".join(str(x) for x in e["loc"]), e["input"]
        ann = sig.parameters[str(e["loc"][0])].annotation
        want = ann.__name__ if isinstance(ann, type) else str(ann)
        out.append(f"param {where}={value!r} ({type(value).__name__}) does not match its annotation {want}")
        out[-1] += f" ({e['msg']})"
    return "; ".join(out)


def _check_params(name: str, fn: Callable, params: dict[str, Any]) -> None:
    """Check `params` against `fn`'s signature with pydantic, then the function's `@param_check` checker."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no introspectable signature (some C callables): checked when called
    ps = list(sig.parameters.values())
    if trl_form.is_trl_form(fn):
        _check_trl_params(name, fn, sig, params)
        return
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD, ps[0].VAR_POSITIONAL):
        raise ValueError(
            f"{name}{sig} must take the trajectory as its first positional argument: def fn(traj, **params)"
        )
    accepted = [p.name for p in ps[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    try:
        checked = _params_model(fn, ps[1:]).model_validate(params)
    except ValidationError as e:
        raise ValueError(_param_problems(name, sig, accepted, e)) from e
    checker = getattr(fn, PARAM_CHECK_ATTR, None)
    if checker is not None:
        values = {k: getattr(checked, k) for k in accepted} | dict(checked.model_extra or {})
        checker(**values)  # raises ValueError naming the bad value


def _check_trl_params(name: str, fn: Callable, sig: inspect.Signature, params: dict[str, Any]) -> None:
    """A TRL-form function's `params`: known names (unless it takes **kwargs), values matching their
    annotations. A required parameter that `params` leaves out is not an error here: it may be a dataset
    column (rl.config checks it against env.dataset's columns)."""
    ps = trl_form.const_params(fn)
    accepted = [p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    optional = [
        p.replace(default=None)
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        else p
        for p in ps
    ]
    try:
        _params_model(fn, optional).model_validate(params)
    except ValidationError as e:
        raise ValueError(_param_problems(name, sig, accepted, e)) from e


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
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    timeout = spec.get("timeout_s")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
            raise ValueError(f"{where}: timeout_s must be a positive number of seconds, got {timeout!r}")
    return RewardSpec(
        name=name,
        weight=float(weight),
        params=dict(params),
        key=key,
        fn=fn,
        form="trl" if trl_form.is_trl_form(fn) else "trajectory",
        is_async=is_async,
        timeout_s=float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S,
    )


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


_Outcome = Any  # a RewardResult, or the text of the reward error


def _fail(spec: RewardSpec, what: str) -> str:
    return f"reward {spec.key!r} ({spec.name}) {what}"


def _normalized(spec: RewardSpec, out: Any, traj: Trajectory) -> _Outcome:
    try:
        return normalize_result(out, traj.n_assistant_turns)
    except (TypeError, ValueError) as e:
        return _fail(spec, str(e))


def _raised(spec: RewardSpec, e: BaseException) -> str:
    log.warning("reward %r (%s) raised", spec.key, spec.name, exc_info=e)
    return _fail(spec, f"raised {type(e).__name__}: {e}")


def _trl_outcomes(spec: RewardSpec, out: Any, trajs: Sequence[Trajectory]) -> list[_Outcome]:
    try:
        values = trl_form.batch_values(out, len(trajs))
    except (TypeError, ValueError) as e:
        return [_fail(spec, str(e))] * len(trajs)
    return [
        _normalized(spec, v, t) if isinstance(v, float) else _fail(spec, v) for v, t in zip(values, trajs)
    ]


def _trl_call(spec: RewardSpec, trajs: Sequence[Trajectory]) -> Any:
    return spec.fn(**trl_form.batch_inputs(trajs, spec.params))


def _score_sync(spec: RewardSpec, trajs: Sequence[Trajectory]) -> list[_Outcome]:
    """A plain-def reward on every trajectory (TRL form: one call for the batch)."""
    if spec.form == "trl":
        try:
            out = _trl_call(spec, trajs)
        except (Exception, SystemExit) as e:
            return [_raised(spec, e)] * len(trajs)
        return _trl_outcomes(spec, out, trajs)
    outcomes = []
    for t in trajs:
        try:
            outcomes.append(_normalized(spec, spec.fn(t, **spec.params), t))
        except (Exception, SystemExit) as e:
            outcomes.append(_raised(spec, e))
    return outcomes


async def _await_limited(spec: RewardSpec, make_call: Callable[[], Any]) -> tuple[Any, str | None]:
    """(result, None), or (None, the error text) after an exception or `spec.timeout_s`."""
    try:
        return await asyncio.wait_for(make_call(), spec.timeout_s), None
    except TimeoutError:
        return None, _fail(spec, f"timed out after {spec.timeout_s:g} s (timeout_s); not scored")
    except (Exception, SystemExit) as e:
        return None, _raised(spec, e)


async def _score_sync_limited(spec: RewardSpec, trajs: Sequence[Trajectory]) -> list[_Outcome]:
    """A plain-def reward on a thread of its own, limited by `spec.timeout_s`: past it the batch's outcomes
    are reward errors and the thread is abandoned (Python cannot kill it; envs/threads.py counts it)."""
    try:
        return await run_in_own_thread(_score_sync, spec, trajs, timeout_s=spec.timeout_s,
                                       what=f"reward {spec.key}")  # fmt: skip
    except OwnThreadTimeout:
        return [_fail(spec, f"timed out after {spec.timeout_s:g} s (timeout_s); not scored")] * len(trajs)
    except HungThreadsError as e:
        return [_fail(spec, f"not run: {e}")] * len(trajs)


async def _score_async(spec: RewardSpec, trajs: Sequence[Trajectory]) -> list[_Outcome]:
    """An async reward: TRL form, one awaited call for the batch; per trajectory, one task each."""
    if spec.form == "trl":
        out, err = await _await_limited(spec, lambda: _trl_call(spec, trajs))
        return [err] * len(trajs) if err is not None else _trl_outcomes(spec, out, trajs)

    async def one(t: Trajectory) -> _Outcome:
        out, err = await _await_limited(spec, lambda: spec.fn(t, **spec.params))
        return err if err is not None else _normalized(spec, out, t)

    return list(await asyncio.gather(*(one(t) for t in trajs)))


def _prepare(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """Reset the reward fields; return the trajectories to score (those without an infra error)."""
    todo = []
    for traj in trajs:
        traj.rewards, traj.turn_rewards, traj.reward_error = {}, [], None
        traj.metadata.pop("reward_failed", None)
        if infra_error_of(traj) is not None:
            traj.metadata["reward_status"] = "skipped_infra_error"
        else:
            todo.append(traj)
    return todo


def _finish(traj: Trajectory, specs: Sequence[RewardSpec], outcomes: Sequence[_Outcome]) -> None:
    """Write one trajectory's rewards from its outcome per spec (or its reward error)."""
    rewards: dict[str, float] = {}
    per_turn = np.zeros(traj.n_assistant_turns, dtype=np.float64)
    total = 0.0
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        traj.reward_error = "; ".join(errors)
        traj.metadata["reward_status"] = "error"
        traj.metadata["reward_failed"] = [s.key for s, o in zip(specs, outcomes) if isinstance(o, str)]
        return
    for spec, res in zip(specs, outcomes):
        rewards[spec.key] = res.value
        for c, v in res.components.items():
            rewards[f"{spec.key}/{c}"] = v
        total += spec.weight * res.value
        if res.per_turn is not None:
            per_turn += spec.weight * np.asarray(res.per_turn, dtype=np.float64)
    rewards["total"] = total
    traj.rewards = rewards
    traj.turn_rewards = per_turn.tolist()
    traj.metadata["reward_status"] = "ok"


def _checked(specs: Sequence[RewardSpec | dict]) -> list[RewardSpec]:
    specs = validate_reward_specs(specs)  # RewardSpecs pass through; dicts are parsed
    if not specs:
        raise ValueError("compose needs at least one reward spec; configure `rewards:` (docs/rewards.md)")
    return specs


async def acompose_batch(trajs: Sequence[Trajectory], specs: Sequence[RewardSpec | dict]) -> list[Trajectory]:
    """Score `trajs` in place with every spec; async functions run concurrently with their timeouts.
    Never raises for a failing reward function. Returns the trajectories."""
    specs = _checked(specs)
    todo = _prepare(trajs)
    if todo:
        by_spec = await asyncio.gather(
            *(_score_async(s, todo) if s.is_async else _score_sync_limited(s, todo) for s in specs)
        )
        for j, traj in enumerate(todo):
            _finish(traj, specs, [res[j] for res in by_spec])
    return list(trajs)


async def acompose(traj: Trajectory, specs: Sequence[RewardSpec | dict]) -> Trajectory:
    """`acompose_batch` of one trajectory (TRL-form functions get a batch of one)."""
    await acompose_batch([traj], specs)
    return traj


def _compose_now(trajs: Sequence[Trajectory], specs: Sequence[RewardSpec | dict]) -> None:
    specs = _checked(specs)
    if not any(s.is_async for s in specs):  # no event loop needed
        todo = _prepare(trajs)
        if todo:
            by_spec = [_score_sync(s, todo) for s in specs]
            for j, traj in enumerate(todo):
                _finish(traj, specs, [res[j] for res in by_spec])
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(acompose_batch(trajs, specs))
        return
    raise RuntimeError(
        "async reward functions cannot be awaited by compose() inside a running event loop; "
        "use `await rewards.acompose(traj, specs)` (or acompose_batch) there"
    )


def compose(traj: Trajectory, specs: Sequence[RewardSpec | dict]) -> Trajectory:
    """Score `traj` in place with every spec and return it. Never raises for a failing reward function."""
    _compose_now([traj], specs)
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
    """Score every trajectory in place (TRL-form functions: one call for the batch) and return the batch's
    RewardMetrics."""
    trajs = list(trajs)
    _compose_now(trajs, specs)
    return RewardMetrics.from_trajectories(trajs)
