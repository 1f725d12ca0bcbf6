"""An agent's HTTP request body as bounded JSON (rl/rollout/endpoint.py, rl/rollout/agent_recorder.py).

The body is untrusted (the agent may be steered by the policy): every way it can fail is a `RequestError`,
an HTTP 4xx naming the field and the fix, never a 500 and never a stalled event loop.
- Nesting: at most MAX_JSON_DEPTH (envs/tool_call.py, the tool-call parser's bound, below what pickling
  through Ray can carry) levels anywhere; deeper is `nested_too_deep`, also past the C parser's recursion.
- Lone surrogates in any string or key become U+FFFD (the tokenizer cannot encode them).
- Size: a body with more than STEPWISE_TOKENS values is parsed by `loads_stepwise`, which gives the same
  result as `json.loads` without holding the interpreter for the whole parse.
- `off_loop` runs parsing and encoding on the endpoint's own threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from json.decoder import scanstring
from typing import Any, TypeVar

from envs.tool_call import MAX_JSON_DEPTH, without_surrogates

__all__ = ["MAX_JSON_DEPTH", "RequestError", "bounded_json", "loads_bounded", "loads_stepwise", "off_loop"]

_T = TypeVar("_T")
_POOL: ThreadPoolExecutor | None = None


class RequestError(ValueError):
    """The request cannot be served as sent (bad messages, budget spent): an HTTP 4xx for the agent.
    `code` is the OpenAI error code (e.g. "context_length_exceeded"), `param` the request field at fault."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` on the endpoint's own worker threads, so that parsing and encoding a large request never
    holds the event loop. Not the loop's default executor: agent threads wait there on their HTTP requests,
    and work that queued behind them could never run."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="odyssey-endpoint")
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)


def bounded_json(value: Any, where: str, depth: int = 0) -> Any:
    """A parsed JSON `value` checked and made safe for the tokenizer: nested at most MAX_JSON_DEPTH levels
    (else a RequestError `nested_too_deep`), every string and key with lone surrogates replaced by U+FFFD."""
    if isinstance(value, str):
        return without_surrogates(value)
    if isinstance(value, (list, dict)) and depth >= MAX_JSON_DEPTH:
        raise RequestError(
            f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels (arrays and objects inside each other); "
            "flatten it", "nested_too_deep")  # fmt: skip
    if isinstance(value, list):
        return [bounded_json(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        return {without_surrogates(k): bounded_json(v, where, depth + 1) for k, v in value.items()}
    return value


def loads_bounded(text: str | bytes, where: str) -> Any:
    """`json.loads(text)` through `bounded_json`; JSON nested past the parser's own recursion limit is the
    same RequestError `nested_too_deep`, malformed JSON a RequestError `invalid_json`. Text that may hold more
    than STEPWISE_TOKENS values (counting its commas and brackets) is parsed by `loads_stepwise` (the same
    result), which never holds the interpreter for long: Python's C parser holds it for the whole parse
    (about 1 s for 32 MiB of tiny objects), which would stall the event loop even from a worker thread."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")  # as json.loads does
        if text.count(",") + text.count("{") + text.count("[") > STEPWISE_TOKENS:
            return loads_stepwise(text, where)
        value = json.loads(text)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError(
            f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels (arrays and objects inside each other); "
            "flatten it", "nested_too_deep") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"{where} is not JSON: {err}", "invalid_json") from None
    return bounded_json(value, where)


STEPWISE_TOKENS = 50_000  # about 50 ms of the C parser
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?")
_CONSTANTS = (("true", True), ("false", False), ("null", None), ("NaN", math.nan), ("Infinity", math.inf),
              ("-Infinity", -math.inf))  # fmt: skip


def loads_stepwise(text: str, where: str) -> Any:
    """`bounded_json(json.loads(text))`, parsed one token at a time in Python (strings by json's own C
    `scanstring`) with an explicit stack: no recursion, containers nested past MAX_JSON_DEPTH are refused as
    they open, and the interpreter is free between tokens. Raises ValueError for malformed JSON."""
    ws, n = _WS.match, len(text)
    stack: list[list | dict] = []
    keys: list[str] = []

    def key(i: int) -> int:
        if text[i : i + 1] != '"':
            raise ValueError(f"Expecting property name enclosed in double quotes at char {i}")
        k, i = scanstring(text, i + 1)
        i = ws(text, i).end()
        if text[i : i + 1] != ":":
            raise ValueError(f"Expecting ':' delimiter at char {i}")
        keys.append(without_surrogates(k))
        return ws(text, i + 1).end()

    i = ws(text, 0).end()
    while True:
        c = text[i : i + 1]
        value: Any
        if c in ("{", "["):
            if len(stack) >= MAX_JSON_DEPTH:
                raise RequestError(
                    f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels (arrays and objects inside each "
                    "other); flatten it", "nested_too_deep")  # fmt: skip
            i = ws(text, i + 1).end()
            if text[i : i + 1] == ("}" if c == "{" else "]"):
                value, i = ({} if c == "{" else []), i + 1
            else:
                stack.append({} if c == "{" else [])
                if c == "{":
                    i = key(i)
                continue
        elif c == '"':
            value, i = scanstring(text, i + 1)
            value = without_surrogates(value)
        else:
            m = _NUMBER.match(text, i)
            if m:
                value = float(m.group()) if m.group(2) or m.group(3) else int(m.group())
                i = m.end()
            else:
                word = next(((w, v) for w, v in _CONSTANTS if text.startswith(w, i)), None)
                if word is None:
                    raise ValueError(f"Expecting value at char {i}")
                value, i = word[1], i + len(word[0])
        while True:  # put the value in its container; close finished containers
            if not stack:
                if ws(text, i).end() != n:
                    raise ValueError(f"Extra data at char {i}")
                return value
            top = stack[-1]
            if isinstance(top, list):
                top.append(value)
            else:
                top[keys.pop()] = value
            i = ws(text, i).end()
            c = text[i : i + 1]
            if c == ",":
                i = ws(text, i + 1).end()
                if isinstance(top, dict):
                    i = key(i)
                break
            if c != ("]" if isinstance(top, list) else "}"):
                raise ValueError(f"Expecting ',' delimiter or closing bracket at char {i}")
            value, i = stack.pop(), i + 1
