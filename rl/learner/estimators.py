"""Advantage estimators as objects, in one registry: `learner.advantage` names one.

    est = estimator("grpo")                         # a built-in: grpo | rloo | raft | gae
    est = estimator("my_pkg.adv:median_baseline")   # or a user's Estimator, resolved like reward functions
    est.grouped, est.needs_values                   # what the driver, the config checks and the learner read

An estimator is one of two kinds (formulas: rl/learner/advantages.py):

- grouped (`grouped=True`): one advantage per episode, relative to its task group. The driver samples
  `learner.group_size` episodes per task (at least `min_group_size`); `rl.learner.selection` drops groups
  with fewer than 2 valid members or all-equal rewards (with `successes_only`: keeps each group's best
  successes instead, any group size); then
  `compute(rewards, groups, lcfg)` maps the kept episodes' rewards [N] (float64) and their group keys [N]
  to advantages [N] (float64) on the driver side of the batch (`rl.learner.batch.prepare_batch`).
- value-based (`needs_values=True`): one advantage per generated token. The learner builds a value model
  and, after its first pass has the values, calls `compute(rewards, values, lcfg)` per episode: token rewards
  [m] and values [m] -> (advantages [m], value targets [m]), float64.

`check(cfg)` returns the estimator's own config problems ("key: problem; fix" lines) for `rl.config`.

To add one: write an `Estimator` here (a built-in: add it to `BUILTIN`) or in your own module (name it as
`learner.advantage: pkg.module:attr`), with its test and a line in docs/learner.md. This module imports
nothing of the repo at load time (torch and the formulas are imported when an estimator computes), so the
config checks can read an estimator's traits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator (module docstring). name: what `learner.advantage` says; compute: the
    grouped or value-based signature; grouped / needs_values: its kind; min_group_size: the least
    `learner.group_size` it accepts; successes_only: selection keeps each group's
    best successes only; turn_credit: adds `learner.turn_credit`'s per-turn returns to its advantages;
    check: its own config problems."""

    name: str
    compute: Callable[..., Any]
    grouped: bool = True
    needs_values: bool = False
    min_group_size: int = 1
    successes_only: bool = False
    turn_credit: bool = True
    check: Callable[[Any], list[str]] | None = None

    def __post_init__(self) -> None:
        if self.grouped == self.needs_values:
            raise ValueError(f"estimator {self.name!r}: set exactly one of grouped=True (one advantage per "
                             "episode, from its group) or needs_values=True (per-token, from a value model)")

    def problems(self, cfg: Any) -> list[str]:
        """This estimator's config problems for an rl.config.RunConfig: the group size it needs, then
        `check(cfg)`."""
        lr = cfg.learner
        out = []
        if self.grouped and lr.group_size < self.min_group_size:
            out.append(
                f"learner.group_size ({lr.group_size}) must be >= {self.min_group_size} for {self.name} "
                f"(advantages are relative to the group); use {self.min_group_size} or more, or "
                "learner.advantage=gae"
            )
        return out + (self.check(cfg) if self.check else [])


# ------------------------------------------------------------------------------------------------ built-ins
def _group_mean(rewards: Sequence[float], groups: Sequence[Hashable], lcfg: Any) -> Any:
    from rl.learner.advantages import group_advantages

    return group_advantages(rewards, groups, baseline="mean", scale=lcfg.scale_rewards)


def _leave_one_out(rewards: Sequence[float], groups: Sequence[Hashable], lcfg: Any) -> Any:
    from rl.learner.advantages import group_advantages

    return group_advantages(rewards, groups, baseline="rloo", scale=lcfg.scale_rewards)


def _raft(rewards: Sequence[float], groups: Sequence[Hashable], lcfg: Any) -> Any:
    from rl.learner.advantages import raft_advantages

    return raft_advantages(groups)


def _gae(rewards: Any, values: Any, lcfg: Any) -> tuple[Any, Any]:
    from rl.learner.advantages import gae

    return gae(rewards, values, lcfg.gamma, lcfg.gae_lambda)


def _raft_check(cfg: Any) -> list[str]:
    out = []
    if cfg.orchestrator.dynamic_sampling:
        out.append(
            "orchestrator.dynamic_sampling discards groups whose rewards are all equal, and raft trains "
            "on the all-success ones; set orchestrator.dynamic_sampling=false with learner.advantage=raft"
        )
    if cfg.learner.turn_credit:
        out.append(
            "learner.turn_credit applies to grpo/rloo; raft trains successful episodes with one weight each. "
            "Set learner.turn_credit=false"
        )
    return out


def _gae_check(cfg: Any) -> list[str]:
    if not cfg.learner.turn_credit:
        return []
    return ["learner.turn_credit applies to grpo/rloo; with advantage=gae per-turn rewards already land on "
            "their turn's tokens. Set learner.turn_credit=false"]


BUILTIN: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("grpo", _group_mean, min_group_size=2),
        Estimator("rloo", _leave_one_out, min_group_size=2),
        # raft needs no baseline: any group size
        Estimator("raft", _raft, successes_only=True, turn_credit=False, check=_raft_check),
        Estimator("gae", _gae, grouped=False, needs_values=True, turn_credit=False, check=_gae_check),
    )
}


def estimator(name: str) -> Estimator:
    """The estimator `name` names: a built-in (`BUILTIN`) or `pkg.module:attr` holding an `Estimator`.
    Raises ValueError naming the choices."""
    from envs.dotted import builtin_or_dotted

    obj = builtin_or_dotted(name, BUILTIN, "advantage estimator", "rl.learner.estimators.Estimator",
                            callable_=False)  # fmt: skip
    if not isinstance(obj, Estimator):
        raise ValueError(f"advantage estimator {name!r} is a {type(obj).__name__}; it must be an "
                         "rl.learner.estimators.Estimator (see that module's docstring)")
    return obj


__all__ = ["Estimator", "BUILTIN", "estimator"]
