"""The tool-call protocol: finding `<tool_call>{...}</tool_call>` blocks in one model turn.

A model turn is free text that may contain any number of tool calls:

    I will add the numbers first.
    <tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>

Each block's body must be one JSON object with a string `"name"` and an object `"arguments"`
(`"arguments"` may be omitted for a tool without parameters). Text outside the blocks is allowed
and ignored. Parsing is a total function of the text: it never raises, whatever the model wrote
(nesting deep enough to exhaust the recursion limit, integers of any length, NaN/Infinity, lone
surrogates, duplicate keys, megabytes of anything). A block nested deeper than `MAX_JSON_DEPTH` (64)
levels is refused before it is parsed: nothing deeper reaches the step info, Ray's pickling or the
store (`text_depth` / `value_depth` are the checks, for any other place that takes JSON from a model).
Each block becomes either a `ToolCall` or a `ToolCallError` whose `message` says exactly what was wrong
and shows the expected format, so the environment can hand it back to the model as an observation.
Every piece of model text quoted in a message goes through `echo`: truncated, with lone surrogates and
control characters escaped.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
EXPECTED_FORMAT = f'{OPEN_TAG}{{"name": "<tool name>", "arguments": {{...}}}}{CLOSE_TAG}'

_TAG_RE = re.compile(r"<tool_call>|</tool_call>")
_MAX_ECHO = 200  # characters of a bad block quoted back in an error message
_SURROGATE_RE = re.compile("[\ud800-\udfff]")

#: The deepest nesting of arrays and objects a tool-call block may have (the block's own object is level 1,
#: its "arguments" level 2). Far below what every later stage carries: Ray pickles a step info whose value
#: is ~495 levels deep no more (PicklingError), json.dumps stops near the recursion limit (~1000), and the
#: JSON parser itself near there. A deeper block is the model's malformed call (an agent error).
MAX_JSON_DEPTH = 64
_ESCAPE_RE = re.compile(r"\\.", re.S)
_STRING_RE = re.compile(r'"[^"]*"')
_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool `name` and its JSON `arguments` (not yet checked against a schema)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolCallError:
    """A block that is not a well-formed call.

    kind: "unclosed_tag" | "stray_close_tag" | "malformed_json" | "not_an_object" | "bad_name" |
          "bad_arguments" | "unexpected_keys"
    """

    kind: str
    message: str
    raw: str = ""


def echo(text: str, limit: int = _MAX_ECHO) -> str:
    """Model (or agent-controlled) text made safe to quote back: at most `limit` characters (the rest is
    counted), lone surrogates, control and format characters (NUL, ESC, bidi overrides, zero-width) shown
    as escapes, so the quote is printable, unambiguous and always encodable by the tokenizer."""
    if not isinstance(text, str):
        text = repr(text)
    more = len(text) - limit
    text = text[:limit] if more > 0 else text
    out = []
    for ch in text:
        if ch in "\n\t":
            out.append(ch)
        elif _SURROGATE_RE.match(ch) or unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "".join(out) + (f"... [{more} more characters]" if more > 0 else "")


def without_surrogates(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD: what any observation must be, since the
    tokenizer (UTF-8) cannot encode them."""
    return _SURROGATE_RE.sub("\ufffd", text)


def _echo(text: str) -> str:
    return echo(text.strip())


def _show(value: Any, limit: int = 60) -> str:
    """A parsed JSON value quoted back (its JSON text, echoed); total even for values nested near the
    recursion limit."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return echo(text, limit)


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {echo(dup, 40)!r}")
    return dict(pairs)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {echo(text, 40)} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate, anywhere in `obj` (iterative walk)."""
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if _SURROGATE_RE.search(item):
                return item
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return None


def text_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text, found without parsing it (linear time, no
    recursion, whatever the text): brackets inside strings do not count. For text that is not valid JSON
    the number is only an estimate, which is all a bound needs (such text fails to parse anyway)."""
    if text.count("[") + text.count("{") == 0:
        return 0
    bare = _NOT_BRACKET_RE.sub("", _STRING_RE.sub("", _ESCAPE_RE.sub("", text)))
    return max(0, max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, bare)), default=0))


def value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of lists, tuples and dicts in `value` (0 for a scalar, 1 for `[1]`), walked
    iteratively; the walk stops as soon as the depth passes `limit` (so a value that contains itself ends
    too, reported as `limit + 1`)."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children)
    return deepest


def too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    """The reason given for JSON nested deeper than `limit`."""
    return f"nested too deeply (more than {limit} levels of arrays and objects)"


def loads_strict(body: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for model text: ValueError (with a short reason) for anything that is not plain, finite,
    valid-Unicode JSON with unique keys, nested at most `max_depth` levels (checked before parsing, so
    no depth reaches the parser). Never raises anything else."""
    if not isinstance(body, str):
        raise ValueError(f"expected JSON text, got {type(body).__name__}")
    if body.count("[") + body.count("{") > max_depth and text_depth(body) > max_depth:
        raise ValueError(too_deep_message(max_depth))
    try:
        obj = json.loads(
            body, object_pairs_hook=_no_dup_keys, parse_float=_finite, parse_constant=_no_constant
        )
    except json.JSONDecodeError as err:
        raise ValueError(f"{err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise ValueError(too_deep_message(max_depth)) from None
    except ValueError as err:  # our hooks, or an integer longer than Python converts (4300 digits)
        msg = str(err)
        raise ValueError("an integer is too long" if "digits" in msg else msg) from None
    bad = _lone_surrogate(obj)
    if bad is not None:
        raise ValueError(f"string {echo(bad, 40)!r} holds a lone surrogate (not valid Unicode)")
    return obj


def _parse_block(body: str, index: int) -> ToolCall | ToolCallError:
    where = f"tool call #{index}"
    try:
        obj = loads_strict(body)
    except ValueError as err:
        return ToolCallError(
            "malformed_json",
            f"{where} is not valid JSON ({err}): {_echo(body)!r}. Expected format: {EXPECTED_FORMAT}",
            body,
        )
    if not isinstance(obj, dict):
        return ToolCallError(
            "not_an_object",
            f"{where} must be a JSON object, got {type(obj).__name__}: {_echo(body)!r}. "
            f"Expected format: {EXPECTED_FORMAT}",
            body,
        )
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ToolCallError(
            "unexpected_keys",
            f'{where} has unexpected key(s) {echo(str(extra))}; only "name" and "arguments" are allowed. '
            f"Expected format: {EXPECTED_FORMAT}",
            body,
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        got = 'no "name" key' if "name" not in obj else f'"name" = {_show(name)}'
        return ToolCallError(
            "bad_name",
            f'{where} needs a non-empty string "name" (got {got}). Expected format: {EXPECTED_FORMAT}',
            body,
        )
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(
            "bad_arguments",
            f'{where} ({echo(name, 60)}): "arguments" must be a JSON object mapping parameter names to '
            f"values, got {type(arguments).__name__} {_show(arguments)}. "
            f"Expected format: {EXPECTED_FORMAT}",
            body,
        )
    return ToolCall(name, arguments, body)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """All tool-call blocks of one turn, in order; never raises.

    An opening tag without a closing tag, and a closing tag without an opening tag, are errors.
    Nested opening tags are reported as an unclosed block followed by the inner block.
    """
    items: list[ToolCall | ToolCallError] = []
    open_at: int | None = None  # index just after the currently open <tool_call>
    for m in _TAG_RE.finditer(text):
        if m.group() == OPEN_TAG:
            if open_at is not None:
                items.append(_unclosed(text[open_at : m.start()], len(items) + 1))
            open_at = m.end()
        elif open_at is None:
            items.append(
                ToolCallError(
                    "stray_close_tag",
                    f"tool call #{len(items) + 1}: found {CLOSE_TAG} without a matching {OPEN_TAG}. "
                    f"Expected format: {EXPECTED_FORMAT}",
                    text[max(0, m.start() - _MAX_ECHO) : m.end()],
                )
            )
        else:
            items.append(_parse_block(text[open_at : m.start()], len(items) + 1))
            open_at = None
    if open_at is not None:
        items.append(_unclosed(text[open_at:], len(items) + 1))
    return items


def _unclosed(body: str, index: int) -> ToolCallError:
    return ToolCallError(
        "unclosed_tag",
        f"tool call #{index}: {OPEN_TAG} was never closed with {CLOSE_TAG} (body {_echo(body)!r}). "
        f"Expected format: {EXPECTED_FORMAT}",
        body,
    )


def format_tool_call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """The canonical text of one call, as the model should write it (used by scripted policies)."""
    return f"{OPEN_TAG}{json.dumps({'name': name, 'arguments': arguments or {}})}{CLOSE_TAG}"
