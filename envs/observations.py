"""Trusted verification: decide on the host from values the sandbox reports, never from its verdicts.

Anything that ran the agent's code (or ran next to it, as the agent's uid) is the agent's to forge: its
output, its exit code, any "PASS" line, any secret it holds in memory. So a check that decides a reward
works like this (docs/envs.md, "Verifying safely"):

    1. draw fresh inputs for this run on the host (the agent cannot know them in advance);
    2. compute the expected observations on the host, with reference code the sandbox never sees;
    3. have the sandbox run the agent's code on the inputs and print plain values (`observe.py`);
    4. compare here: `parse_observations` (total: any malformed output is simply a missing result) and
       `same` (exact JSON data, floats within a relative 1e-9; total too: a value it cannot compare, such
       as a 400-digit integer where a float is expected, is not the same).

A forged result line only passes if it holds the right values, which requires computing them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from envs.sandbox_scripts.observe import RESULT_PREFIX, public_names, run_check
from envs.tool_call import MAX_JSON_DEPTH, text_depth

MAX_LINE = 1 << 16  # longer result lines are ignored (a check's trace is small)
FLOAT_REL_TOL = 1e-9


def _same_number(observed: int | float, expected: int | float) -> bool:
    if type(observed) is int and type(expected) is int and max(abs(observed), abs(expected)) >= 2**53:
        return observed == expected  # exact: no float holds them (and a 400-digit one overflows float())
    try:
        return math.isclose(observed, expected, rel_tol=FLOAT_REL_TOL, abs_tol=1e-12)
    except (OverflowError, TypeError, ValueError):  # an integer beyond the float range vs a float
        return False


def _same(observed: Any, expected: Any) -> bool:
    if isinstance(observed, bool) or isinstance(expected, bool):
        return type(observed) is type(expected) and observed == expected
    if isinstance(observed, int | float) and isinstance(expected, int | float):
        return _same_number(observed, expected)
    if isinstance(observed, list) and isinstance(expected, list):
        return len(observed) == len(expected) and all(_same(a, b) for a, b in zip(observed, expected))
    if isinstance(observed, dict) and isinstance(expected, dict):
        return observed.keys() == expected.keys() and all(_same(observed[k], expected[k]) for k in expected)
    return type(observed) is type(expected) and observed == expected


def same(observed: Any, expected: Any) -> bool:
    """JSON values equal: bools only to bools, numbers within FLOAT_REL_TOL (integers beyond 2**53 exactly),
    lists/dicts element-wise. Total: whatever `observed` is (huge integers, NaN, nesting past the recursion
    limit, a value that contains itself, objects whose comparison raises), the answer is True or False, and
    anything that cannot be compared is not the same."""
    try:
        return bool(_same(observed, expected))
    except Exception:  # RecursionError, a hostile __eq__, anything unforeseen: a failed check
        return False


def parse_observations(stdout: str, ids: set[int]) -> tuple[dict[int, dict], list[str]]:
    """({check id: {"trace", "note"}}, other output lines) from the runner's stdout. The first well-formed
    line per id counts; anything malformed (bad JSON, nesting past MAX_JSON_DEPTH, huge numbers, wrong
    shapes) is ignored. Total: it never raises, whatever `stdout` holds."""
    found: dict[int, dict] = {}
    other: list[str] = []
    if isinstance(stdout, bytes | bytearray):
        stdout = bytes(stdout).decode("utf-8", errors="replace")
    if not isinstance(stdout, str):
        return found, other
    for line in stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            if line.strip():
                other.append(line)
            continue
        body = line[len(RESULT_PREFIX) :]
        if len(line) > MAX_LINE or text_depth(body) > MAX_JSON_DEPTH:
            continue
        try:
            item = json.loads(body)
        except (ValueError, RecursionError):  # bad JSON, an integer of 4300+ digits
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
