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

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "code"}}`): 400 for a request this server
cannot serve as sent (malformed JSON, bad messages, `n` > 1, a spent token budget:
`context_length_exceeded`), 401 for an unknown or closed episode, 404 for another model name, 413 for a
body over 32 MiB, 500 when the engine failed (the episode is then marked as an infrastructure error).
A client that disconnects mid-request does not stop the turn: it is generated and recorded, and the
agent's next request either continues it or starts a new segment.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rl.rollout.agent_recorder import EngineFailure, EpisodeRecorder, RequestError, TurnResult

MODEL_NAME = "policy"
MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True)
class EndpointHandle:
    """What one episode's agent needs: `openai.OpenAI(base_url=..., api_key=...)`."""

    base_url: str
    api_key: str
    model: str = MODEL_NAME


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


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
        app = web.Application(client_max_size=MAX_BODY_BYTES)
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
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", "request_too_large")
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not JSON: {err}", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request")
        model = body.get("model", self.model_name)
        if model != self.model_name:
            return _error(
                404, f"model {str(model)[:100]!r} does not exist; this endpoint serves {self.model_name!r}",
                "model_not_found",
            )  # fmt: skip
        if body.get("n", 1) != 1:
            return _error(400, "n must be 1 (sample several episodes instead)", "unsupported")
        return body

    @staticmethod
    def _max_tokens(body: dict[str, Any]) -> Any:
        value = body.get("max_completion_tokens")
        return body.get("max_tokens") if value is None else value

    async def _serve(self, request: web.Request, kind: str) -> web.Response:
        rec = self._recorder(request)
        if isinstance(rec, web.Response):
            return rec
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            if kind == "chat":
                tools = body.get("tools")
                if tools is not None and not isinstance(tools, list):
                    raise RequestError("'tools' must be a list of function tools")
                turn = await rec.chat(body.get("messages"), tools, self._max_tokens(body))
            else:
                turn = await rec.complete(body.get("prompt"), self._max_tokens(body))
        except RequestError as err:
            return _error(err.status, str(err), err.code)
        except EngineFailure as err:
            return _error(500, f"the policy engine failed: {err}", "engine_error", "server_error")
        make = _chat_response if kind == "chat" else _completion_response
        reply = make(turn, self.model_name, rec.turns)
        if body.get("stream"):
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
        chunks = [{"index": 0, "delta": delta, "finish_reason": None, "token_ids": choice["token_ids"]},
                  {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]  # fmt: skip
        obj = "chat.completion.chunk"
    else:
        first = {"index": 0, "text": choice["text"], "finish_reason": None, "token_ids": choice["token_ids"]}
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


def _chat_response(turn: TurnResult, model: str, index: int) -> dict[str, Any]:
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
                     "token_ids": turn.token_ids, "logprobs": None}],
        "usage": _usage(turn),
    }  # fmt: skip


def _completion_response(turn: TurnResult, model: str, index: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{secrets.token_hex(8)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
                     "token_ids": turn.token_ids, "logprobs": None}],
        "usage": _usage(turn),
    }  # fmt: skip
