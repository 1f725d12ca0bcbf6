"""Built-in reward names, and resolution of a spec name to its function."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from envs.dotted import is_dotted_name, resolve_name
from rewards.budget import token_budget, turn_penalty
from rewards.outcome import outcome
from rewards.overlong import overlong
from rewards.process import process
from rewards.subgoal import subgoal

BUILTINS: dict[str, Callable] = {
    "outcome": outcome,
    "subgoal": subgoal,
    "process": process,
    "overlong": overlong,
    "turn_penalty": turn_penalty,
    "token_budget": token_budget,
}


def list_builtins() -> list[str]:
    return sorted(BUILTINS)


def resolve_reward(name: str) -> Callable:
    """A built-in name, or "pkg.module:fn" for a user function. ValueError with a fix otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if name in BUILTINS:
        return BUILTINS[name]
    if is_dotted_name(name):
        return resolve_name(name, what="reward function")
    close = difflib.get_close_matches(name, BUILTINS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown built-in reward {name!r}.{hint} Built-ins: {', '.join(list_builtins())}. "
        "A custom reward is named 'pkg.module:function' (module path, a colon, the function)."
    )
