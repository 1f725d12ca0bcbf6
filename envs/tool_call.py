"""The tool-call protocol: finding `<tool_call>{...}</tool_call>` blocks in one model turn.

A model turn is free text that may contain any number of tool calls:

    I will add the numbers first.
    <tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>

Each block's body must be one JSON object with a string `"name"` and an object `"arguments"`
(`"arguments"` may be omitted for a tool without parameters). Text outside the blocks is allowed
and ignored. Parsing never raises: each block becomes either a `ToolCall` or a `ToolCallError`
whose `message` says exactly what was wrong and shows the expected format, so the environment can
hand it back to the model as an observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
EXPECTED_FORMAT = f'{OPEN_TAG}{{"name": "<tool name>", "arguments": {{...}}}}{CLOSE_TAG}'

_TAG_RE = re.compile(r"<tool_call>|</tool_call>")
_MAX_ECHO = 200  # characters of a bad block quoted back in an error message


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


def _echo(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "..."


def _parse_block(body: str, index: int) -> ToolCall | ToolCallError:
    where = f"tool call #{index}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCallError(
            "malformed_json",
            f"{where} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): "
            f"{_echo(body)!r}. Expected format: {EXPECTED_FORMAT}",
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
            f'{where} has unexpected key(s) {extra}; only "name" and "arguments" are allowed. '
            f"Expected format: {EXPECTED_FORMAT}",
            body,
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        got = 'no "name" key' if "name" not in obj else f'"name" = {json.dumps(name)}'
        return ToolCallError(
            "bad_name",
            f'{where} needs a non-empty string "name" (got {got}). Expected format: {EXPECTED_FORMAT}',
            body,
        )
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(
            "bad_arguments",
            f'{where} ({name}): "arguments" must be a JSON object mapping parameter names to values, '
            f"got {type(arguments).__name__} {_echo(json.dumps(arguments))}. "
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
