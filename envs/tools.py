"""`@tool`: declare an environment method as a tool; its JSON schema comes from type hints + docstring.

    class MyEnv(ToolEnv):
        @tool
        def calc(self, expression: str, precision: int = 6) -> str:
            '''Evaluate an arithmetic expression.

            Args:
                expression: the expression, e.g. "(3+4)*2".
                precision: digits after the decimal point.
            '''

Supported parameter types: int, float, str, bool, list[T], dict[str, T], Optional[T] / T | None,
Literal[...] (of str/int/bool). The description is the docstring text before its sections; each
parameter's description comes from the Google-style `Args:` section. Tools may be plain functions
(pure Python, run inline) or `async def` (anything that awaits the sandbox).

`ToolSpec.validate(arguments)` checks a model's arguments against the signature (missing, unexpected,
wrong type) and raises `ToolArgumentError` whose message names each problem and the expected call.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union

_SECTION_RE = re.compile(
    r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$"
)
_ARG_RE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


class ToolDefinitionError(TypeError):
    """A `@tool` function whose signature cannot be turned into a JSON schema."""


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's signature; the message is shown to the model."""


class ToolError(Exception):
    """Raise from a tool to report a failure the agent caused (bad path, bad value, ...).

    The env shows `error: <message>` to the model verbatim; any other exception is shown as
    `error: tool 'x' raised TypeName: message`.
    """


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _schema_for(tp: Any, where: str) -> dict[str, Any]:
    """JSON schema for one annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is list or origin is list:
        schema: dict[str, Any] = {"type": "array"}
        if args:
            schema["items"] = _schema_for(args[0], where)
        return schema
    if tp is dict or origin is dict:
        schema = {"type": "object"}
        if args:
            if args[0] is not str:
                raise ToolDefinitionError(
                    f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}"
                )
            schema["additionalProperties"] = _schema_for(args[1], where)
        return schema
    if origin is Literal:
        if not all(isinstance(a, (str, int, bool)) for a in args):
            raise ToolDefinitionError(f"{where}: Literal values must be str, int or bool, got {args!r}")
        kinds = sorted({_type_name(a) for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) == len(args) or len(members) != 1:
            raise ToolDefinitionError(
                f"{where}: only Optional[T] (T | None) unions are supported, got {tp!r}; "
                "use one type, or Literal[...] for a fixed set of values"
            )
        inner = _schema_for(members[0], where)
        return {"anyOf": [inner, {"type": "null"}]}
    raise ToolDefinitionError(
        f"{where}: unsupported type {tp!r}; use int, float, str, bool, list[T], dict[str, T], "
        "Optional[T] or Literal[...]"
    )


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    desc_lines: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        m = _SECTION_RE.match(line)
        if m:
            section, current, arg_indent = m.group(1), None, None
            continue
        if section is None:
            desc_lines.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            indent = len(line) - len(line.lstrip())
            am = _ARG_RE.match(line)
            if am and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = am.group(1).lstrip("*")
                params[current] = am.group(3).strip()
            elif current is not None:  # continuation line
                params[current] = (params[current] + " " + line.strip()).strip()
    description = " ".join(" ".join(desc_lines).split())
    return description, {k: " ".join(v.split()) for k, v in params.items()}


@dataclass(frozen=True)
class ToolParam:
    name: str
    annotation: Any
    schema: dict[str, Any]
    required: bool
    default: Any = None


@dataclass(frozen=True)
class ToolSpec:
    """A declared tool: its name, description, parameters and the underlying function."""

    name: str
    description: str
    params: tuple[ToolParam, ...]
    fn: Callable[..., Any]
    is_async: bool

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """JSON schema of the arguments object."""
        return {
            "type": "object",
            "properties": {p.name: p.schema for p in self.params},
            "required": [p.name for p in self.params if p.required],
            "additionalProperties": False,
        }

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema (what chat templates and `ToolEnv.tool_schemas()` use)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters_schema,
            },
        }

    def signature(self) -> str:
        """A one-line human-readable signature, e.g. `calc(expression: string)`."""
        parts = []
        for p in self.params:
            kind = _schema_label(p.schema)
            parts.append(f"{p.name}: {kind}" + ("" if p.required else f" = {json.dumps(p.default)}"))
        return f"{self.name}({', '.join(parts)})"

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Arguments checked against the signature, ints widened to float where a float is expected.

        Raises `ToolArgumentError` listing every problem (missing, unexpected, wrong type).
        """
        problems: list[str] = []
        known = {p.name: p for p in self.params}
        unexpected = sorted(set(arguments) - set(known))
        if unexpected:
            problems.append(f"unexpected argument(s) {unexpected}")
        missing = [p.name for p in self.params if p.required and p.name not in arguments]
        if missing:
            problems.append(f"missing required argument(s) {missing}")
        out: dict[str, Any] = {}
        for name, value in arguments.items():
            if name not in known:
                continue
            try:
                out[name] = _check(value, known[name].schema, name)
            except ToolArgumentError as err:
                problems.append(str(err))
        if problems:
            raise ToolArgumentError(
                f"bad arguments for tool '{self.name}': {'; '.join(problems)}. Expected: {self.signature()}"
            )
        return out


def _schema_label(schema: dict[str, Any]) -> str:
    if "anyOf" in schema:
        return _schema_label(schema["anyOf"][0]) + " | null"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array" and "items" in schema:
        return f"array of {_schema_label(schema['items'])}"
    return kind if isinstance(kind, str) else " | ".join(kind)


def _check(value: Any, schema: dict[str, Any], where: str) -> Any:
    """`value` validated against the (restricted) schema produced by `_schema_for`."""
    if "anyOf" in schema:
        if value is None:
            return None
        return _check(value, schema["anyOf"][0], where)
    if "enum" in schema:
        # bool is an int subclass: 1 must not match True
        if not any(value == v and type(value) is type(v) for v in schema["enum"]):
            raise ToolArgumentError(
                f"'{where}' must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
            )
        return value
    kind = schema["type"]
    bad = ToolArgumentError(
        f"'{where}' must be {_schema_label(schema)}, got {_type_name(value)} {_short(value)}"
    )
    if kind == "integer":
        if isinstance(value, bool):
            raise bad
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise bad
        return value
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if kind == "string":
        if not isinstance(value, str):
            raise bad
        return value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise bad
        return value
    if kind == "array":
        if not isinstance(value, list):
            raise bad
        items = schema.get("items")
        return [_check(v, items, f"{where}[{i}]") for i, v in enumerate(value)] if items else list(value)
    if kind == "object":
        if not isinstance(value, dict):
            raise bad
        inner = schema.get("additionalProperties")
        return {k: _check(v, inner, f"{where}.{k}") for k, v in value.items()} if inner else dict(value)
    raise ToolArgumentError(f"'{where}': unsupported schema {schema}")  # unreachable for @tool schemas


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:60] + "..."


def build_spec(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> ToolSpec:
    """The `ToolSpec` of `fn`; a leading `self` parameter is skipped (tools are usually methods)."""
    tool_name = name or fn.__name__
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must be an identifier (letters, digits, _ or -)")
    doc_desc, doc_params = _parse_docstring(fn.__doc__)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:
        raise ToolDefinitionError(f"tool '{tool_name}': cannot resolve type hints ({err})") from err
    params: list[ToolParam] = []
    sig = inspect.signature(fn)
    for i, (pname, p) in enumerate(sig.parameters.items()):
        if i == 0 and pname in ("self", "cls"):
            continue
        where = f"tool '{tool_name}' parameter '{pname}'"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"{where}: *args/**kwargs cannot be described by a JSON schema; name each one"
            )
        if pname not in hints:
            raise ToolDefinitionError(
                f"{where} has no type hint; annotate it "
                "(int, float, str, bool, list[T], Optional[T], Literal[...])"
            )
        schema = _schema_for(hints[pname], where)
        if doc_params.get(pname):
            schema = {**schema, "description": doc_params[pname]}
        required = p.default is inspect.Parameter.empty
        default = None if required else p.default
        if not required:
            schema = {**schema, "default": default}
        params.append(ToolParam(pname, hints[pname], schema, required, default))
    return ToolSpec(
        name=tool_name,
        description=description if description is not None else doc_desc,
        params=tuple(params),
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
    )


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Mark a function (usually a `ToolEnv` method) as a tool. Usable as `@tool` or `@tool(name=...)`.

    The schema is built at decoration time, so a bad signature fails at import, not mid-episode.
    """

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__tool_spec__ = build_spec(f, name=name, description=description)  # type: ignore[attr-defined]
        return f

    return wrap(fn) if fn is not None else wrap
