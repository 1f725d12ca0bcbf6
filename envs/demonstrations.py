"""Few-shot demonstrations: worked conversations placed between an env's system message and its task.

    env = envs.make("arith", demonstrations=[
        {"role": "user", "content": "Compute 2+3."},
        {"role": "assistant", "content": '<tool_call>{"name": "calc", ...}</tool_call>'},
        {"role": "tool", "content": "5"},
        ...])
    env.reset(seed=0)[0]      # [system, *demonstrations, user(task)]

A small instruct model whose chat template has no tool section (SmolLM2) rarely follows a tool-call
format described in words, and copies one shown as earlier turns of the same conversation
(docs/envs.md, "Demonstrations"). The demonstrations are part of every episode's prompt: the learner
never scores them, and a group computes them once with the rest of its shared prompt. They come from the
config (env.kwargs.demonstrations), never from the model, so a turn cannot add to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: roles a demonstration may hold: the system message stays the env's own, first
ROLES = ("user", "assistant", "tool")


def demonstration_problems(value: Any) -> list[str]:
    """What is wrong with `value` as env.kwargs.demonstrations (a list of {"role", "content"} messages,
    role in ROLES, content a non-empty string); [] when it is usable."""
    fix = ('; write it as a list of messages, e.g. [{role: user, content: "Compute 2+3."}, '
           '{role: assistant, content: "..."}]')
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        got = type(value).__name__
        return [f"env.kwargs.demonstrations must be a list of chat messages, got {got}" + fix]
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            out.append(f"env.kwargs.demonstrations[{i}] must be a message {{role, content}}, got "
                       f"{type(m).__name__}" + fix)
            continue
        if extra := sorted(set(m) - {"role", "content"}):
            out.append(f"env.kwargs.demonstrations[{i}] has unknown keys {extra}: a message has only role "
                       "and content")
        if m.get("role") not in ROLES:
            out.append(f"env.kwargs.demonstrations[{i}].role is {m.get('role')!r}; use one of {list(ROLES)} "
                       "(the system message is the env's own)")
        if not isinstance(m.get("content"), str) or not m.get("content"):
            out.append(f"env.kwargs.demonstrations[{i}].content must be a non-empty string")
    if not out and value and value[0]["role"] != "user":
        out.append("env.kwargs.demonstrations must start with a user message (the task of the worked "
                   f"example), got {value[0]['role']!r} first")
    return out


def check_demonstrations(value: Any) -> list[dict[str, str]]:
    """`value` as a list of plain message dicts (copied); ValueError naming every problem otherwise."""
    if value is None:
        return []
    if problems := demonstration_problems(value):
        raise ValueError("; ".join(problems))
    return [{"role": m["role"], "content": m["content"]} for m in value]


__all__ = ["ROLES", "check_demonstrations", "demonstration_problems"]
