"""Trusted verification: decide on the host from values the sandbox reports, never from its verdicts.

Anything that ran the agent's code (or ran next to it, as the agent's uid) is the agent's to forge: its
output, its exit code, any "PASS" line, any secret it holds in memory. So a check that decides a reward
works like this (docs/envs.md, "Verifying safely"):

    1. draw fresh inputs for this run on the host (the agent cannot know them in advance);
    2. compute the expected observations on the host, with reference code the sandbox never sees;
    3. have the sandbox run the agent's code on the inputs and print plain values (`observe.py`);
    4. compare here: `parse_observations` (total: any malformed output is simply a missing result) and
       `same` (exact JSON data, floats within a relative 1e-9).

A forged result line only passes if it holds the right values, which requires computing them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from envs.sandbox_scripts.observe import RESULT_PREFIX, public_names, run_check

MAX_LINE = 1 << 16  # longer result lines are ignored (a check's trace is small)
FLOAT_REL_TOL = 1e-9


def same(observed: Any, expected: Any) -> bool:
    """JSON values equal: bools only to bools, numbers within FLOAT_REL_TOL, lists/dicts element-wise."""
    if isinstance(observed, bool) or isinstance(expected, bool):
        return type(observed) is type(expected) and observed == expected
    if isinstance(observed, int | float) and isinstance(expected, int | float):
        return math.isclose(observed, expected, rel_tol=FLOAT_REL_TOL, abs_tol=1e-12)
    if isinstance(observed, list) and isinstance(expected, list):
        return len(observed) == len(expected) and all(same(a, b) for a, b in zip(observed, expected))
    if isinstance(observed, dict) and isinstance(expected, dict):
        return observed.keys() == expected.keys() and all(same(observed[k], expected[k]) for k in expected)
    return type(observed) is type(expected) and observed == expected


def parse_observations(stdout: str, ids: set[int]) -> tuple[dict[int, dict], list[str]]:
    """({check id: {"trace", "note"}}, other output lines) from the runner's stdout. The first well-formed
    line per id counts; anything malformed (bad JSON, deep nesting, huge numbers, wrong shapes) is ignored."""
    found: dict[int, dict] = {}
    other: list[str] = []
    for line in stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            if line.strip():
                other.append(line)
            continue
        if len(line) > MAX_LINE:
            continue
        try:
            item = json.loads(line[len(RESULT_PREFIX) :])
        except (ValueError, RecursionError):
            continue
        if not isinstance(item, dict) or type(item.get("id")) is not int or item["id"] not in ids:
            continue
        if item["id"] in found or not isinstance(item.get("trace"), list):
            continue
        note = item.get("note")
        found[item["id"]] = {"trace": item["trace"], "note": note if isinstance(note, str) else ""}
    return found, other


def reference_traces(source: str, module_name: str, codes: list[str]) -> list[list]:
    """The traces of `codes` against the reference `source`, computed in this (trusted) process."""
    namespace: dict[str, Any] = {"__name__": module_name}
    exec(compile(source, f"<reference {module_name}>", "exec"), namespace)  # our own template code
    names = public_names(namespace)
    return [run_check(names, code)[0] for code in codes]


def show(value: Any, limit: int = 120) -> str:
    """A short, printable rendering of a JSON value for a report (ASCII only: nothing can be smuggled)."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (ValueError, RecursionError, TypeError):
        text = "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."
