"""TRL's reward-function signature, next to Odyssey's per-trajectory form.

    def accuracy(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]: ...
    async def judge(prompts, completions, **kwargs) -> list[float]: ...        # awaited, with a timeout

A reward function is in TRL's form when it has a parameter named `prompts`, `completions` or
`completion_ids` (TRL calls them by keyword; so do we); otherwise it takes the trajectory first. A TRL-form
function scores a batch: for trajectories t_1..t_n it is called once with

    prompts[i]         the dataset row's prompt as written in the file (a string, or a list of chat
                       messages), or the env's prompt messages for a generated task
    completions[i]     string prompt: the text of the last assistant turn;
                       messages prompt: every message after the prompt (assistant turns and observations)
    completion_ids[i]  the token ids after the prompt (assistant turns and observations)
    <column>=[...]     every other column of the dataset rows (TRL's **dataset_columns), one value per
                       trajectory (None where a row lacks it); nothing for generated tasks
    <param>=value      the spec's `params`, as constants

and returns one float per trajectory, or None for "no reward for this one" (TRL's convention), which
here is a reward error for that trajectory: never a silent 0. TRL's trainer-only keyword arguments
(`trainer_state`, `log_extra`, `log_metric`) are not passed; give them defaults or take **kwargs.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from envs.trajectory import Trajectory
from rewards import text

TRL_ARGS = ("prompts", "completions", "completion_ids")


def is_trl_form(fn: Callable) -> bool:
    """True when `fn` names `prompts`, `completions` or `completion_ids` among its parameters."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name in TRL_ARGS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def const_params(fn: Callable) -> list[inspect.Parameter]:
    """The parameters a spec's `params` may fill: everything but TRL's three arguments."""
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in TRL_ARGS]


def _row_prompt(traj: Trajectory) -> Any:
    row = traj.metadata.get("dataset_row")
    if row and row.get("prompt_field") in row.get("columns", {}):
        return row["columns"][row["prompt_field"]]
    return text.prompt_messages(traj)


def batch_inputs(trajs: Sequence[Trajectory], params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one TRL-form call over `trajs` (see the module docstring). ValueError when a
    column or a param would collide with TRL's arguments, or a param shadows a dataset column."""
    prompts = [_row_prompt(t) for t in trajs]
    completions = [
        text.completion_text(t) if isinstance(p, str) else text.completion_messages(t)
        for t, p in zip(trajs, prompts)
    ]
    kwargs: dict[str, Any] = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [text.completion_ids(t) for t in trajs],
    }
    rows = [t.metadata.get("dataset_row") or {} for t in trajs]
    columns: list[str] = []
    for row in rows:
        for c in row.get("columns", {}):
            if c != row.get("prompt_field") and c not in columns:
                columns.append(c)
    for c in columns:
        if c in TRL_ARGS:
            raise ValueError(
                f"dataset column {c!r} collides with TRL's argument of that name; rename the column"
            )
        if c in params:
            raise ValueError(f"param {c!r} shadows the dataset column {c!r}; rename the param")
        kwargs[c] = [row.get("columns", {}).get(c) for row in rows]
    for k in params:
        if k in TRL_ARGS:
            raise ValueError(f"param {k!r} collides with TRL's argument of that name")
    return kwargs | params


def batch_values(out: Any, n: int) -> list[float | str]:
    """One entry per trajectory: the reward, or the text of what is wrong with it. TypeError/ValueError
    when the whole return value is unusable (not a list of n values)."""
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
        raise TypeError(
            f"returned {type(out).__name__}; a TRL-form reward returns a list of floats, one per completion"
        )
    values = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(values) != n:
        raise ValueError(
            f"returned {len(values)} rewards for {n} completions; return exactly one per completion"
        )
    res: list[float | str] = []
    for v in values:
        if v is None:
            res.append("returned None for this completion (TRL's 'no reward'); it is not trained on")
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            res.append(f"returned {v!r} ({type(v).__name__}); expected a float")
        elif not math.isfinite(float(v)):
            res.append(f"returned a non-finite value {v}")
        else:
            res.append(float(v))
    return res
