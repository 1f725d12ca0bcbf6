"""`@tool`: declare an environment method as a tool; its JSON schema comes from type hints + docstring.

    class MyEnv(ToolEnv):
        @tool
        def calc(self, expression: str, precision: int = 6) -> str:
            '''Evaluate an arithmetic expression.

            Args:
                expression: the expression, e.g. "(3+4)*2".
                precision: digits after the decimal point.
            '''

The schema is `transformers.utils.get_json_schema` of the function (the format chat templates take):
the description is the docstring text before its sections, each parameter's description comes from the
Google-style `Args:` section (`name: description`; every parameter needs one: the model reads them),
`Optional[T]` is `{"type": T, "nullable": true}`. Odyssey adds each optional parameter's `default` and
`additionalProperties: false`. Supported parameter types (what `validate` checks): int, float, str,
bool, list[T], dict[str, T], Optional[T] / T | None, Literal[...] (of str/int/bool). A bad signature
(no type hint, *args, another type) fails when the class is defined; the schema itself is built on
first use (`ToolEnv.__init__` forces it), so defining env classes does not import transformers.
Tools may be plain functions (pure Python, run inline) or `async def` (anything that awaits the sandbox).

`ToolSpec.validate(arguments)` checks a model's arguments against the signature (missing, unexpected,
wrong type) and raises `ToolArgumentError` whose message names each problem and the expected call.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union


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


def _check_type(tp: Any, where: str) -> None:
    """Raise ToolDefinitionError unless `validate` can check values of annotation `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float, str, bool, list, dict):
        return
    if origin is list:
        return _check_type(args[0], where)
    if origin is dict:
        if args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return _check_type(args[1], where)
    if origin is Literal:
        if not all(isinstance(a, (str, int, bool)) for a in args):
            raise ToolDefinitionError(f"{where}: Literal values must be str, int or bool, got {args!r}")
        return None
    if origin is Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) == len(args) or len(members) != 1:
            raise ToolDefinitionError(
                f"{where}: only Optional[T] (T | None) unions are supported, got {tp!r}; "
                "use one type, or Literal[...] for a fixed set of values"
            )
        return _check_type(members[0], where)
    raise ToolDefinitionError(
        f"{where}: unsupported type {tp!r}; use int, float, str, bool, list[T], dict[str, T], "
        "Optional[T] or Literal[...]"
    )


def _json_schema(fn: Callable[..., Any], tool_name: str) -> dict[str, Any]:
    """`transformers.utils.get_json_schema(fn)["function"]`; its errors become ToolDefinitionError + fix."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(fn)["function"]
    except DocstringParsingException as err:
        raise ToolDefinitionError(
            f"tool '{tool_name}': {err}. Give it a docstring: a description, then an `Args:` section with "
            "one `name: description` line per parameter (the model reads them)"
        ) from err
    except TypeHintParsingException as err:
        raise ToolDefinitionError(f"tool '{tool_name}': {err}") from err


@dataclass(frozen=True)
class ToolParam:
    name: str
    annotation: Any
    schema: dict[str, Any]
    required: bool
    default: Any = None


@dataclass(frozen=True)
class ToolSpec:
    """A declared tool: its name, the underlying function, and (built on first use from
    `transformers.utils.get_json_schema`) its description and parameters."""

    name: str
    fn: Callable[..., Any]
    is_async: bool
    description_override: str | None = None

    @functools.cached_property
    def _function_schema(self) -> dict[str, Any]:
        return _json_schema(self.fn, self.name)

    @property
    def description(self) -> str:
        if self.description_override is not None:
            return self.description_override
        return " ".join((self._function_schema.get("description") or "").split())

    @functools.cached_property
    def params(self) -> tuple[ToolParam, ...]:
        """The parameters in signature order; schemas from get_json_schema, plus `default` when optional."""
        props = self._function_schema["parameters"]["properties"]
        hints = typing.get_type_hints(self.fn)
        out = []
        for pname, p in _tool_parameters(self.fn):
            required = p.default is inspect.Parameter.empty
            schema = dict(props[pname])
            if not required:
                schema["default"] = p.default
            out.append(ToolParam(pname, hints[pname], schema, required, None if required else p.default))
        return tuple(out)

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

        Raises `ToolArgumentError` listing every problem (missing, unexpected, wrong type, a number
        beyond the float range). The arguments are model text: whatever else goes wrong while checking
        them is reported as a `ToolArgumentError` too, never raised as anything else.
        """
        try:
            return self._validate(arguments)
        except ToolArgumentError:
            raise
        except Exception as err:  # a value no check foresaw: still the model's bad argument
            raise ToolArgumentError(
                f"bad arguments for tool '{self.name}': cannot check them ({type(err).__name__}: "
                f"{str(err)[:200]}). Expected: {self.signature()}"
            ) from err

    def _validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
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
    if schema.get("nullable"):
        return _schema_label({k: v for k, v in schema.items() if k != "nullable"}) + " | null"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array" and "items" in schema:
        return f"array of {_schema_label(schema['items'])}"
    return kind if isinstance(kind, str) else " | ".join(kind)


def _check(value: Any, schema: dict[str, Any], where: str) -> Any:
    """`value` validated against a parameter schema of a `@tool` (types `_check_type` accepts)."""
    if schema.get("nullable"):
        if value is None:
            return None
        return _check(value, {k: v for k, v in schema.items() if k != "nullable"}, where)
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
        try:  # an integer literal beyond the float range (309+ digits) has no float value
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ToolArgumentError(
                f"'{where}' must be a finite number (at most about 1.8e308), got {_short(value)}"
            )
        return number
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


def _tool_parameters(fn: Callable[..., Any]) -> list[tuple[str, inspect.Parameter]]:
    """The parameters the model fills: all but a leading `self` / `cls`."""
    params = list(inspect.signature(fn).parameters.items())
    if params and params[0][0] in ("self", "cls"):
        params = params[1:]
    return params


def build_spec(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> ToolSpec:
    """The `ToolSpec` of `fn`; a leading `self` parameter is skipped (tools are usually methods).

    Checks the signature now (ToolDefinitionError naming the parameter and the fix); the JSON schema is
    built from it and the docstring on first use of the spec.
    """
    tool_name = name or fn.__name__
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must be an identifier (letters, digits, _ or -)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:
        raise ToolDefinitionError(f"tool '{tool_name}': cannot resolve type hints ({err})") from err
    for pname, p in _tool_parameters(fn):
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
        _check_type(hints[pname], where)
    return ToolSpec(tool_name, fn, inspect.iscoroutinefunction(fn), description)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Mark a function (usually a `ToolEnv` method) as a tool. Usable as `@tool` or `@tool(name=...)`.

    The schema is built at decoration time, so a bad signature fails at import, not mid-episode.
    """

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__tool_spec__ = build_spec(f, name=name, description=description)  # type: ignore[attr-defined]
        return f

    return wrap(fn) if fn is not None else wrap
