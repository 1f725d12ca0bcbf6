"""`PolicyEndpoint`: an OpenAI-compatible HTTP server in front of the rollout engine, so agent code
written against the OpenAI client drives episodes unmodified.

    endpoint = PolicyEndpoint()                      # one per rollout worker, on the worker's event loop
    await endpoint.start()                           # 127.0.0.1, a free port
    handle = endpoint.open(recorder)                 # one per episode: base_url + api_key
    client = openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key)
    ...                                              # the agent's own loop
    endpoint.close(handle)                           # later requests with that key: 401

Routes (`/v1/...`, the OpenAI wire format; see docs/agents.md):

    POST /v1/chat/completions   messages (+ tools): the next assistant turn, tool calls as `tool_calls`
    POST /v1/completions        prompt (text or token ids): its continuation
    GET  /v1/models             the one model, `policy`

Each episode is reached only through its own key (the `Authorization: Bearer` header, 192 random bits),
and a key names one episode: an agent can neither list nor read other episodes. Every answer carries
the ids the policy produced (`choices[i].token_ids`) and the context's length (`usage.prompt_tokens`).

With `stream: true` the turn is generated whole, then sent as server-sent events (one delta chunk and a
closing chunk with the finish reason, then `[DONE]`), so streaming clients work unchanged.

Request fields: `messages`, `tools`, `max_tokens` / `max_completion_tokens`, `stop`, `logprobs` (the
sampled tokens' log-probs, the ones recorded for training), `tool_choice` "auto" / "none", `stream`, `n` = 1
and `response_format` {"type": "text"} are honoured; `temperature`, `top_p`, `seed`, the penalties and
`logit_bias` are accepted and do not change the run's sampling; `top_logprobs` > 0, `tool_choice`
"required" or a named function, JSON `response_format`s, `echo`, `suffix` and `best_of` > 1 are refused
(docs/agents.md lists them all).

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "code", "param"}}`) for every request, hostile
ones included: 400 for a request this server cannot serve as sent (malformed JSON, JSON nested deeper than
64 levels anywhere, wrong field types, bad messages or tools, `n` > 1, a refused field, a spent token budget:
`context_length_exceeded`), 401 for an unknown or closed episode, 404 for another model name or route, 405
for another method, 413 for a body over 32 MiB, 500 when the engine failed (the episode is then marked as an
infrastructure error) or on a bug here (`internal_error`). Lone surrogates in any string stand for U+FFFD.
Parsing (token by token for bodies of many values, `loads_stepwise`) and encoding run on worker threads,
and over-budget requests are refused by a cheap bound before encoding, so no request holds the event loop
that serves every episode of the worker.
A client that disconnects mid-request does not stop the turn: it is generated and recorded, and the
agent's next request either continues it or starts a new segment.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rl.rollout.agent_recorder import EngineFailure, EpisodeRecorder, TurnResult
from rl.rollout.request_json import RequestError, loads_bounded, off_loop

MODEL_NAME = "policy"
MAX_BODY_BYTES = 32 << 20
MAX_STOP_STRINGS = 4  # as OpenAI's API
_INLINE_PARSE_BYTES = 64 << 10  # larger bodies are parsed on a worker thread
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointHandle:
    """What one episode's agent needs: `openai.OpenAI(base_url=..., api_key=...)`."""

    base_url: str
    api_key: str
    model: str = MODEL_NAME


def _error(
    status: int, message: str, code: str, kind: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    """An OpenAI-shaped JSON error answer."""
    body = {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return web.json_response(body, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every answer JSON: aiohttp's own errors (an unknown route, another method, a body over the limit) and
    any bug in a handler (a JSON 500 `internal_error`, logged) get OpenAI-shaped bodies, never text/plain."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()))) or "another method"
        hint = {404: f": the routes are POST /v1/chat/completions, POST /v1/completions, GET /v1/models "
                     f"(not {request.method} {request.path[:200]!r})",
                405: f": {request.path[:200]!r} takes {allowed}"}.get(exc.status, "")  # fmt: skip
        return _error(exc.status, f"{exc.reason}{hint}", codes.get(exc.status, "http_error"))
    except Exception as exc:  # noqa: BLE001 - a bug here must still answer JSON (and is logged)
        log.exception("the policy endpoint failed on %s %s", request.method, request.path)
        return _error(500, f"the endpoint failed on this request ({type(exc).__name__}: {str(exc)[:500]}); "
                      "this is a bug in Odyssey: please report it with the request", "internal_error",
                      "server_error")  # fmt: skip


class PolicyEndpoint:
    """The HTTP server; `open` / `close` register episodes. Runs on the event loop that calls `start`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = MODEL_NAME) -> None:
        self.host, self.port, self.model_name = host, port, model_name
        self._episodes: dict[str, EpisodeRecorder] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the free port the OS chose
        self._runner = runner

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._episodes.clear()

    def open(self, recorder: EpisodeRecorder) -> EndpointHandle:
        if self._runner is None:
            raise RuntimeError("PolicyEndpoint.open before start(): await endpoint.start() first")
        key = "ody-" + secrets.token_urlsafe(24)
        self._episodes[key] = recorder
        return EndpointHandle(self.url, key, self.model_name)

    def close(self, handle: EndpointHandle) -> None:
        self._episodes.pop(handle.api_key, None)

    @property
    def open_episodes(self) -> int:
        return len(self._episodes)

    # ------------------------------------------------------------------ request plumbing
    def _recorder(self, request: web.Request) -> EpisodeRecorder | web.Response:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.startswith("Bearer ") else ""
        rec = self._episodes.get(key)
        if rec is None:
            return _error(
                401,
                "unknown or finished episode: use the base_url and api_key the episode was given "
                "(each key serves one episode while it runs)",
                "invalid_api_key",
                "authentication_error",
            )
        return rec

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", "request_too_large")
        if len(raw) > _INLINE_PARSE_BYTES:
            body = await off_loop(loads_bounded, raw, "the request body")
        else:
            body = loads_bounded(raw, "the request body")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request")
        model = body.get("model", self.model_name)
        if model != self.model_name:
            return _error(
                404, f"model {str(model)[:100]!r} does not exist; this endpoint serves {self.model_name!r}",
                "model_not_found", param="model",
            )  # fmt: skip
        return body

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        rec = self._recorder(request)
        if isinstance(rec, web.Response):
            return rec
        try:
            body = await self._body(request)
            if isinstance(body, web.Response):
                return body
            opts = _options(body, kind)
            if kind == "chat":
                turn = await rec.chat(body.get("messages"), opts["tools"], opts["max_tokens"], opts["stop"],
                                      opts["tool_choice"])  # fmt: skip
            else:
                turn = await rec.complete(body.get("prompt"), opts["max_tokens"], opts["stop"])
        except RequestError as err:
            return _error(err.status, str(err), err.code, param=err.param)
        except RecursionError:  # a safety net: request JSON is bounded (MAX_JSON_DEPTH) before it is used
            return _error(400, "the request nests JSON too deeply to process; flatten it", "nested_too_deep")
        except EngineFailure as err:
            return _error(500, f"the policy engine failed: {err}", "engine_error", "server_error")
        logprobs = _logprobs(turn, rec, kind) if opts["logprobs"] else None
        make = _chat_response if kind == "chat" else _completion_response
        reply = make(turn, self.model_name, rec.turns, logprobs)
        if opts["stream"]:
            return await _stream(request, reply, kind)
        return web.json_response(reply)

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, "chat")

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, "completion")

    async def _models(self, request: web.Request) -> web.Response:
        rec = self._recorder(request)
        if isinstance(rec, web.Response):
            return rec
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "odyssey"}]}
        )


def _refuse(param: str, message: str, code: str = "unsupported") -> RequestError:
    return RequestError(f"'{param}': {message}", code, param=param)


def _options(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The request's fields other than `messages` / `prompt`, checked: each is honoured, accepted without
    effect on sampling (temperature, top_p, seed, penalties, logit_bias: the run's sampling decides), or
    refused with a RequestError naming the field and what to send instead. Unknown fields are ignored, as
    OpenAI-compatible servers do (clients add new ones)."""
    get = body.get
    if get("n") not in (None, 1) or type(get("n")) is bool:
        raise _refuse("n", "must be 1: each request samples one turn (sample several episodes instead)")
    if get("best_of") not in (None, 1) or type(get("best_of")) is bool:
        raise _refuse("best_of", "must be 1 (the policy samples one completion per request)")
    if get("stream") is not None and type(get("stream")) is not bool:
        raise _refuse("stream", f"must be true or false, got {get('stream')!r:.60}", "invalid_request")
    max_tokens = get("max_completion_tokens")
    max_tokens = get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise _refuse("max_tokens", f"must be a positive integer, got {max_tokens!r:.60}", "invalid_request")
    stop = get("stop")
    stop = [stop] if isinstance(stop, str) else (None if stop == [] else stop)
    if stop is not None and (
        not isinstance(stop, list) or not 0 < len(stop) <= MAX_STOP_STRINGS
        or not all(isinstance(x, str) and x for x in stop)
    ):  # fmt: skip
        raise _refuse("stop", f"must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty "
                      f"strings, got {json.dumps(stop)[:80]}", "invalid_request")  # fmt: skip
    seed = get("seed")
    if seed is not None and type(seed) is not int:
        raise _refuse("seed", f"must be an integer, got {seed!r:.60}", "invalid_request")
    fmt = get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise _refuse("response_format", 'must be {"type": "text"}', "invalid_request")
        if fmt["type"] != "text":
            raise _refuse("response_format", f"{fmt['type'][:40]!r} is not served: the policy's output is "
                          "not constrained; ask for JSON in the prompt and parse it, or send "
                          '{"type": "text"}')  # fmt: skip
    if kind == "completion":
        for name in ("echo", "suffix"):
            if get(name) not in (None, False, ""):
                raise _refuse(name, "is not served: send the prompt's continuation only")
        lp = get("logprobs")
        if lp is not None and (type(lp) is not int or lp < 0):
            raise _refuse("logprobs", "must be an integer >= 0 (0: the sampled tokens' log-probs)",
                          "invalid_request")  # fmt: skip
        if lp:
            raise _refuse("logprobs", f"{lp}: the engine reports only each sampled token's log-prob, not the "
                          "most likely alternatives; send logprobs: 0")  # fmt: skip
        return {"max_tokens": max_tokens, "stop": stop, "stream": bool(get("stream")),
                "logprobs": lp is not None, "tools": None, "tool_choice": "auto"}  # fmt: skip
    lp, top = get("logprobs"), get("top_logprobs")
    if lp is not None and type(lp) is not bool:
        raise _refuse("logprobs", f"must be true or false (the sampled tokens' log-probs), got {lp!r:.60}",
                      "invalid_request")  # fmt: skip
    if top is not None and (type(top) is not int or top < 0):
        raise _refuse("top_logprobs", "must be an integer >= 0 (only 0 is served)", "invalid_request")
    if top:
        raise _refuse("top_logprobs", f"{top}: the engine reports only each sampled token's log-prob, not "
                      "the most likely alternatives; send logprobs: true with top_logprobs 0 or unset")
    choice = get("tool_choice")
    if choice not in (None, "auto", "none"):
        if choice == "required" or isinstance(choice, dict):
            raise _refuse("tool_choice", "'required' and a named function are not served: the policy decides "
                          "whether to call a tool (sampling is not constrained); send 'auto' or 'none'")
        raise _refuse("tool_choice", f"must be 'auto' or 'none', got {choice!r:.60}", "invalid_request")
    return {"max_tokens": max_tokens, "stop": stop, "stream": bool(get("stream")), "logprobs": bool(lp),
            "tools": _tools(get("tools")), "tool_choice": choice or "auto"}  # fmt: skip


def _tools(tools: Any) -> list[dict] | None:
    """`tools` checked as OpenAI function tools: [{"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: object}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _refuse("tools", "must be a list of function tools", "invalid_request")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(fn, dict) or t.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str) or not fn["name"]
            or not isinstance(fn.get("description", ""), (str, type(None)))
            or not isinstance(fn.get("parameters", {}), (dict, type(None)))
        ):  # fmt: skip
            raise _refuse("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                          "'description': str, 'parameters': JSON schema object}}", "invalid_request")
    return tools


def _logprobs(turn: TurnResult, rec: EpisodeRecorder, kind: str) -> dict[str, Any]:
    """The turn's log-probs in OpenAI's format: one entry per sampled token (`token_ids`, the end-of-turn
    token included), each the log-prob recorded for training. Chat: {"content": [{"token", "logprob",
    "bytes", "top_logprobs": []}]}; completions: {"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}."""
    texts = [rec.codec.decode([i]) for i in turn.token_ids]
    if kind == "chat":
        content = [{"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8", "replace")),
                    "top_logprobs": []} for t, lp in zip(texts, turn.logprobs)]  # fmt: skip
        return {"content": content, "refusal": None}
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [float(x) for x in turn.logprobs], "top_logprobs": None,
            "text_offset": offsets}  # fmt: skip


async def _stream(request: web.Request, reply: dict[str, Any], kind: str) -> web.StreamResponse:
    """`reply` as server-sent events, the way OpenAI streams: the turn is generated whole first, then sent
    as one content (and tool-call) delta and a closing chunk with the finish reason, then `[DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    choice = reply["choices"][0]
    head = {k: reply[k] for k in ("id", "created", "model")}
    if kind == "chat":
        msg = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
        if "tool_calls" in msg:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        chunks = [{"index": 0, "delta": delta, "finish_reason": None, "token_ids": choice["token_ids"],
                   "logprobs": choice["logprobs"]},
                  {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]  # fmt: skip
        obj = "chat.completion.chunk"
    else:
        first = {"index": 0, "text": choice["text"], "finish_reason": None, "token_ids": choice["token_ids"],
                 "logprobs": choice["logprobs"]}  # fmt: skip
        chunks = [first, {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]
        obj = "text_completion"
    for i, c in enumerate(chunks):
        event = {**head, "object": obj, "choices": [c]}
        if i == len(chunks) - 1:
            event["usage"] = reply["usage"]
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _usage(turn: TurnResult) -> dict[str, int]:
    n = len(turn.token_ids)
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": turn.prompt_tokens + n,
    }


def _chat_response(turn: TurnResult, model: str, index: int, logprobs: dict | None = None) -> dict[str, Any]:
    calls = [
        {"id": f"call_{index}_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(turn.tool_calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason,
                     "token_ids": turn.token_ids, "logprobs": logprobs}],
        "usage": _usage(turn),
    }  # fmt: skip


def _completion_response(turn: TurnResult, model: str, index: int, logprobs: dict | None = None
                         ) -> dict[str, Any]:
    return {
        "id": f"cmpl-{secrets.token_hex(8)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
                     "token_ids": turn.token_ids, "logprobs": logprobs}],
        "usage": _usage(turn),
    }  # fmt: skip
