"""Hostile, malformed and unusual requests to the policy endpoint (rl/rollout/endpoint.py, agent_recorder.py).

Every request the endpoint cannot serve gets a JSON 4xx naming the problem: never a 500, never a stalled
event loop (deep nesting anywhere, lone surrogates in any string, wrong types, huge bodies; a seeded fuzz
over request shapes). The OpenAI request fields agents send are honoured (`stop`, `logprobs`, `tool_choice`
auto/none) or refused with a 400 (`top_logprobs` > 0, `tool_choice` required, `response_format` other
than text). A refused over-budget request does not mark an episode that recovers as truncated. Oracles:
the recorder's own record (token ids, log-probs), an unstopped run of the same seeded sampler, and the
trainer's forward.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from model.tokenizer import load_tokenizer
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig
from rl.rollout.agent_recorder import EpisodeRecorder
from rl.rollout.engine import GenerationRequest, GenerationResult, Session, TorchEngine
from rl.rollout.request_json import RequestError, bounded_json, loads_bounded, loads_stepwise
from rl.rollout.scripted import TeacherForcedEngine
from tests.test_agent_endpoint import _Served, _trainer_check

ROOT = Path(__file__).resolve().parents[1]
CFG = EpisodeConfig(max_new_tokens=24, max_episode_tokens=2048, temperature=1.0)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
USER = {"role": "user", "content": "What is 6 times 7?"}


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer())


@pytest.fixture(scope="module")
def model(codec: ChatCodec) -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


class QuickEngine:
    """An engine with no model: every request is answered at once with `text` and its end-of-turn token, each
    token's log-prob -0.5 (for probing request handling, where the policy's numbers do not matter)."""

    weight_version = 0

    def __init__(self, codec: ChatCodec, text: str = "The answer is 42.") -> None:
        self.detokenize = codec.decode  # stop strings are allowed (the text is cut by the recorder)
        self.ids = [int(i) for i in codec.tok.encode(text, add_special_tokens=False)] + [codec.eot_id]
        self.requests = 0

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """`text`, cut at the request's max_new_tokens."""
        self.requests += 1
        ids = self.ids[: request.sampling.max_new_tokens]
        finish = "stop_token" if ids[-1] == self.ids[-1] else "length"
        return GenerationResult(
            request.request_id,
            ids,
            [-0.5] * len(ids),
            finish,
            None,
            None,
            Session(),
            0,
            len(request.prompt_ids),
        )

    def release(self, session: Session) -> None:
        """Nothing to release."""


def _is_json_error(r: httpx.Response) -> bool:
    """An OpenAI-shaped JSON error body with a message that says something."""
    if not r.headers.get("content-type", "").startswith("application/json"):
        return False
    err = r.json().get("error") if isinstance(r.json(), dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and len(err["message"]) > 10


def _open(s: _Served, engine: Any, cfg: EpisodeConfig = CFG) -> str:
    """A further episode on `s`'s endpoint; its api key."""
    return s.endpoint.open(EpisodeRecorder(engine, s.rec.codec, cfg, 0)).api_key


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


# ------------------------------------------------------------------------------------- nesting, surrogates
@pytest.mark.parametrize(
    "where", ["tools", "content", "arguments", "prompt", "stop", "tools-3000", "tools-500"]
)
def test_json_nested_past_any_limit_is_a_json_400(codec: ChatCodec, where: str) -> None:
    """100,000 levels deep anywhere in the body or inside a tool call's `arguments` text (parsed token by
    token), 3,000 levels (past the C parser's recursion limit), 500 levels (parses, but nests past the
    endpoint's limit): a JSON 400 `nested_too_deep`, and the server serves on."""
    s = _Served(QuickEngine(codec), codec)
    try:
        user = json.dumps(USER).encode()
        bodies = {
            "tools": b'{"messages": [' + user + b'], "tools": ' + _deep(100_000) + b"}",
            "tools-3000": b'{"messages": [' + user + b'], "tools": ' + _deep(3000) + b"}",
            "tools-500": b'{"messages": [' + user + b'], "tools": ' + _deep(500) + b"}",
            "content": b'{"messages": [{"role": "user", "content": ' + _deep(100_000) + b"}]}",
            "prompt": b'{"prompt": ' + _deep(100_000) + b"}",
            "stop": b'{"messages": [' + user + b'], "stop": ' + _deep(100_000) + b"}",
        }
        if where == "arguments":
            said = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "[" * 100_000}}
                ],
            }
            body = json.dumps({"messages": [USER, said, {"role": "tool", "content": "1"}]}).encode()
        else:
            body = bodies[where]
        r = s.post("/completions" if where == "prompt" else "/chat/completions", body)
        assert r.status_code == 400 and _is_json_error(r), (r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "nested_too_deep" and "nest" in r.json()["error"]["message"]
        assert s.post("/chat/completions", {"messages": [USER]}).status_code == 200
    finally:
        s.close()


def test_lone_surrogates_in_any_string_field_are_served(codec: ChatCodec) -> None:
    """A lone surrogate (`\\ud800`, escaped or as raw bytes) in a tool's name, description or schema keys, in
    a message, in a tool call's arguments, or in a /v1/completions prompt: the request is served (the
    surrogate stands for U+FFFD, as it does in message content), never a tokenizer crash."""
    s = _Served(QuickEngine(codec), codec, EpisodeConfig(max_new_tokens=8, max_episode_tokens=1 << 16))
    try:
        bad = "calc\ud800"
        tools = [
            {
                "type": "function",
                "function": {
                    "name": bad,
                    "description": "d\udfff",
                    "parameters": {"type": "object", "properties": {"x\ud800": {"type": "string"}}},
                },
            }
        ]
        said = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": bad, "arguments": json.dumps({"expression": "\ud800"})},
                }
            ],
        }
        bodies = [
            ("/chat/completions", {"messages": [USER], "tools": tools}),
            (
                "/chat/completions",
                {
                    "messages": [
                        {"role": "system", "content": "\ud800"},
                        USER,
                        said,
                        {"role": "tool", "content": "\udc00"},
                    ],
                    "tools": tools,
                },
            ),
            ("/chat/completions", {"messages": [USER], "stop": ["\ud800"], "user": "\ud800"}),
            ("/completions", {"prompt": "2 + 2 = \ud800"}),
            ("/completions", {"prompt": "\ud800"}),
        ]
        for path, body in bodies:
            r = s.post(path, body)
            assert r.status_code == 200, (path, r.status_code, r.text[:300])
        raw = b'{"prompt": "x \xed\xa0\x80 y"}'  # a surrogate as (invalid) UTF-8 bytes
        r = s.post("/completions", raw)
        assert r.status_code < 500 and r.headers["content-type"].startswith("application/json"), r.text[:300]
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------- fuzz
def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indexes) into a JSON value, the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _replaced(body: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


HOSTILE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**70,
    1.5,
    float("nan"),
    "",
    "x",
    "\ud800",
    "9" * 5000,
    [],
    {},
    [None],
    [[]],
    {"": 1},
    {"\ud800": "\udfff"},
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
    json.loads(_deep(200)),
]


def test_fuzz_request_shapes_always_get_a_json_answer_below_500(codec: ChatCodec) -> None:
    """Seeded fuzz: every field of full chat and completion requests (every OpenAI field set) deleted,
    and replaced by four hostile values (a seeded draw per field), plus truncated bodies and non-object
    bodies: the status is < 500 and the body JSON (an OpenAI error object for every 4xx). Each probe is a
    fresh episode. Other routes and methods get JSON 404 / 405."""
    said = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expression": "6*7"}'},
            }
        ],
    }
    chat = {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
            said,
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 4,
        "max_completion_tokens": 4,
        "stop": ["\n\n"],
        "logprobs": True,
        "top_logprobs": 0,
        "seed": 1,
        "response_format": {"type": "text"},
        "stream": False,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 1,
        "user": "u",
        "parallel_tool_calls": True,
    }
    completion = {
        "model": "policy",
        "prompt": "1 2 3",
        "max_tokens": 4,
        "stop": "\n",
        "logprobs": 0,
        "echo": False,
        "seed": 1,
        "stream": False,
        "n": 1,
    }
    rng = random.Random(0)
    s = _Served(QuickEngine(codec), codec)
    statuses: dict[int, int] = {}
    http = httpx.Client(timeout=60)
    try:
        probes: list[tuple[str, Any]] = []
        for path, base in (("/chat/completions", chat), ("/completions", completion)):
            for p in _paths(base):
                probes.append((path, _replaced(base, p, None, delete=True)))
                for v in rng.sample(HOSTILE_VALUES, 4):
                    probes.append((path, _replaced(base, p, v)))
            raw = json.dumps(base).encode()
            probes += [(path, raw[: rng.randrange(len(raw))]) for _ in range(8)]
            probes.append((path, b""))
            probes += [(path, json.dumps(v).encode()) for v in (None, 5, "x", [base], [])]
            probes.append((path, {**base, "stream": True}))
        for path, body in probes:
            key = _open(s, s.rec.engine)
            if isinstance(body, bytes):
                data = body
            else:
                data = json.dumps(body, allow_nan=True).encode()
            r = http.post(s.handle.base_url + path, content=data, headers={"Authorization": f"Bearer {key}"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, data[:300], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert _is_json_error(r), (path, data[:300], r.text[:300])
            elif not r.headers["content-type"].startswith("text/event-stream"):
                assert r.json()["choices"][0]["token_ids"]
        assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 100, statuses  # both kinds were probed
        for method, path in (("GET", "/chat/completions"), ("POST", "/nope"), ("DELETE", "/models")):
            r = http.request(method, s.handle.base_url + path, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code in (404, 405) and _is_json_error(r), (method, path, r.status_code, r.text)
    finally:
        http.close()
        s.close()


# ------------------------------------------------------------------------------------ huge bodies, the loop
class _Heartbeat:
    """A task on the server's loop that ticks every 10 ms and keeps the longest gap between ticks."""

    def __init__(self, s: _Served) -> None:
        self.s, self.gap, self.stop = s, 0.0, False
        self.future = asyncio.run_coroutine_threadsafe(self._beat(), s.loop)

    async def _beat(self) -> None:
        last = time.perf_counter()
        while not self.stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.gap, last = max(self.gap, now - last), now

    def finish(self) -> float:
        self.stop = True
        self.future.result(10)
        return self.gap


@pytest.mark.parametrize("budget", [2048, 1 << 20])
def test_a_huge_request_never_stalls_the_loop_or_other_episodes(codec: ChatCodec, budget: int) -> None:
    """One request of many tiny messages (100,000, 3.4 MB, against a 2,048-token budget: refused by a cheap
    bound before any encoding; 20,000 within a 1M budget: encoded off the loop and served). Meanwhile another
    episode's request is served at once and the loop never stalls for more than a fraction of a second."""
    n = 100_000 if budget == 2048 else 20_000
    s = _Served(QuickEngine(codec), codec, EpisodeConfig(max_new_tokens=8, max_episode_tokens=budget))
    try:
        other = _open(s, QuickEngine(codec))
        huge = json.dumps({"messages": [{"role": "user", "content": "x"}] * n}).encode()
        box: dict[str, Any] = {}

        def send() -> None:
            box["r"] = s.post("/chat/completions", huge, timeout=120)
            box["done"] = time.perf_counter()

        beat = _Heartbeat(s)
        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        small = s.post("/chat/completions", {"messages": [USER]}, key=other)
        served = time.perf_counter()
        t.join(120)
        gap = beat.finish()
        assert small.status_code == 200 and served - t0 < 3.0, (small.text[:200], served - t0)
        r = box["r"]
        if budget == 2048:
            code = r.json()["error"]["code"]
            assert r.status_code == 400 and code == "context_length_exceeded", r.text[:300]
            assert s.rec.segments == [] and s.rec.engine.requests == 0
        else:
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 5 * n, r.text[:300]
            assert served < box["done"], "the other episode waited for the huge request"
        assert gap < 1.0, f"the event loop stalled for {gap:.2f} s"
    finally:
        s.close()


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    """A seeded random JSON value: numbers, strings (escapes, brackets, surrogates), nested containers."""
    kind = rng.randrange(9 if depth < 6 else 5)
    if kind == 0:
        return rng.randrange(-(10**6), 10**6)
    if kind == 1:
        return rng.choice([0.5, -1e-7, 1e300, 3.25, -0.0, 2.5e10])
    if kind == 2:
        return "".join(
            rng.choice('ab"\\/\n\t\u00e9\u4e2d\ud83d\ude00 {}[],:') for _ in range(rng.randrange(8))
        )
    if kind in (3, 4):
        return rng.choice([True, False, None, "\ud800"])
    if kind in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice('ab{:"') for _ in range(rng.randrange(4))): _random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}  # fmt: skip


def _outcome(parse: Any, text: str) -> tuple:
    """What `parse(text)` gives: ("ok", its JSON), ("refused", the RequestError's code) or ("malformed",)."""
    try:
        return ("ok", json.dumps(parse(text)))
    except RequestError as e:
        return ("refused", e.code)
    except ValueError:
        return ("malformed",)


def test_the_stepwise_parser_equals_json_loads_and_never_holds_the_interpreter() -> None:
    """Bodies with many values are parsed one token at a time (`loads_stepwise`). Oracle: `json.loads` then
    `bounded_json`, on 2,000 seeded random JSON values in several layouts, each also cut short or followed
    by junk: the same value, or malformed for both. Parsing 200,000 tiny messages (6.8 MB; Python's C parser
    holds the interpreter for the whole parse, 0.2 s and more) on a thread leaves this thread's 1 ms ticks
    no gap over 0.1 s."""
    rng = random.Random(1)
    for _ in range(2000):
        value = _random_json(rng)
        layout = {"indent": rng.choice([None, 1, "\t"]), "ensure_ascii": rng.random() < 0.5}
        text = json.dumps(value, **layout)
        cut = text[: rng.randrange(len(text) + 1)] + rng.choice(["", "x", ",", "]", "}", " 1"])
        for t in (text, cut):
            assert _outcome(lambda x: loads_stepwise(x, "b"), t) == _outcome(
                lambda x: bounded_json(json.loads(x), "b"), t
            ), t
    assert _outcome(lambda x: loads_stepwise(x, "b"), _deep(100).decode()) == ("refused", "nested_too_deep")
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 200_000}).encode()
    done = threading.Event()
    out: dict[str, Any] = {}

    def parse() -> None:
        try:
            out["value"] = loads_bounded(body, "the request body")
        finally:
            done.set()

    gap, t = 0.0, threading.Thread(target=parse)
    last = time.perf_counter()
    t.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    t.join()
    assert len(out["value"]["messages"]) == 200_000
    assert gap < 0.1, f"parsing held the interpreter for {gap:.3f} s"


# ------------------------------------------------------------------------------------------- truncation
def test_truncated_means_the_budget_was_spent(codec: ChatCodec) -> None:
    """A refused over-budget request marks the episode truncated only while it is the last word: an agent that
    then compacts its context and finishes within budget has a terminated, untruncated episode (which
    learner.overlong_filter keeps). An episode that ends on the refusal, whose turn was cut by the budget, or
    that hit the turn limit is truncated."""
    cfg = EpisodeConfig(max_new_tokens=8, max_episode_tokens=300)

    async def play() -> dict[str, Any]:
        out: dict[str, Any] = {}
        rec = EpisodeRecorder(QuickEngine(codec), codec, cfg, 0)
        turn = await rec.chat([USER], None, None)
        long = [
            USER,
            {"role": "assistant", "content": turn.content},
            {"role": "user", "content": "word " * 400},
        ]
        with pytest.raises(RequestError, match="budget"):
            await rec.chat(long, None, None)
        out["refused"] = rec.truncated
        await rec.chat([{"role": "user", "content": "Summary: 6 times 7. Answer now."}], None, None)
        out["recovered"] = rec.trajectories(1.0, {})
        roomy = dataclasses_replace(cfg, max_new_tokens=4096)  # the turn's cap is what is left of the budget
        cut = EpisodeRecorder(QuickEngine(codec, "word " * 300), codec, roomy, 0)
        await cut.chat([USER], None, None)  # the turn runs into the budget: cut at "length"
        out["cut"] = cut.trajectories(0.0, {})
        turns = EpisodeRecorder(QuickEngine(codec), codec, dataclasses_replace(cfg, max_turns=1), 0)
        turn = await turns.chat([USER], None, None)
        with pytest.raises(RequestError, match="turn limit"):
            await turns.chat([USER, {"role": "assistant", "content": turn.content}, USER], None, None)
        out["turns"] = turns.trajectories(0.0, {})
        return out

    out = asyncio.run(play())
    assert out["refused"] == "token_budget"
    assert [(t.truncated, t.terminated, "truncation" in t.metadata) for t in out["recovered"]] == [
        (False, True, False)
    ] * 2
    assert out["cut"][0].truncated and out["cut"][0].metadata["truncation"] == "token_budget"
    assert out["turns"][0].truncated and out["turns"][0].metadata["truncation"] == "max_turns"


def dataclasses_replace(cfg: EpisodeConfig, **kw: Any) -> EpisodeConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# ---------------------------------------------------------------------------------------- request fields
def _client(s: _Served, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=s.handle.base_url, api_key=key or s.handle.api_key, max_retries=0, timeout=60
    )


def _in_thread(fn: Any) -> Any:
    """`fn()` run in a thread (the openai client is synchronous; the endpoint's loop runs in another)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _cuttable(pieces: list[str], k: int) -> bool:
    """Is the text token k + 1 adds to `pieces[k]` a good stop string (two or more characters, not blank,
    not already in the text before it)?"""
    added = pieces[k + 1][len(pieces[k]) :]
    return len(added) >= 2 and bool(added.strip()) and added not in pieces[k]


def test_stop_sequences_stop_the_engine_cut_the_text_and_keep_the_record_faithful(
    model: OdysseyForCausalLM, codec: ChatCodec
) -> None:
    """`stop`: generation stops at the first stop string, the text the agent gets ends before it, the finish
    reason is "stop". Oracle: an unstopped run of the same seeded sampler, whose ids the stopped run's are a
    strict prefix of. The record keeps every sampled id (the stop string's too), the agent's next request,
    which sends the cut text back, continues the segment, and the trainer's forward equals the record."""
    cfg = EpisodeConfig(max_new_tokens=24, max_episode_tokens=2048, temperature=1.0, stop_on_tool_call=False)
    engine = TorchEngine(model, detokenize=codec.decode)

    async def turn(draw: int, stop: list[str] | None) -> tuple[EpisodeRecorder, Any]:
        rec = EpisodeRecorder(engine, codec, cfg, draw)
        return rec, await rec.chat([USER], None, None, stop=stop)

    for draw in range(20):  # a draw whose unstopped turn is long enough to cut in the middle
        _, full = asyncio.run(turn(draw, None))
        pieces = [codec.decode(full.token_ids[:k]) for k in range(len(full.token_ids))]
        k = next((k for k in range(4, len(pieces) - 2) if _cuttable(pieces, k)), None)
        if k is not None:
            break
    assert k is not None, "no sampled turn to cut"
    stop = pieces[k + 1][len(pieces[k]) :]
    rec, cut = asyncio.run(turn(draw, [stop, "\x00never"]))
    assert cut.finish_reason == "stop" and cut.text == pieces[k], (cut.text, pieces[k], stop)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    assert stop in codec.decode(cut.token_ids)  # the record keeps what was sampled

    async def go_on() -> Any:
        said = {"role": "assistant", "content": cut.content}
        await rec.chat([USER, said, {"role": "user", "content": "And 7 times 8?"}], None, None)
        return rec.episode_trajectory(1.0, {})

    traj = asyncio.run(go_on())
    assert traj.metadata["n_segments"] == 1 and traj.metadata["requests"] == 2
    _trainer_check(model, traj)

    s = _Served(engine, codec, cfg)  # over HTTP with the OpenAI client, and the refusals
    try:
        reply = _in_thread(
            lambda: _client(s).chat.completions.create(model="policy", messages=[USER], stop=stop)
        )
        assert reply.choices[0].finish_reason in ("stop", "length") and stop not in (
            reply.choices[0].message.content or ""
        )
        for bad in (5, [""], ["a"] * 5, [["a"]]):
            r = s.post("/chat/completions", {"messages": [USER], "stop": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    finally:
        s.close()
    blind = QuickEngine(codec)
    blind.detokenize = None  # an engine that cannot stop at strings: a 400, not an engine error
    s = _Served(blind, codec)
    try:
        r = s.post("/chat/completions", {"messages": [USER], "stop": "x"})
        assert (
            r.status_code == 400
            and "detokenize" in r.json()["error"]["message"]
            and s.rec.infra_error is None
        )
    finally:
        s.close()


def test_logprobs_are_the_recorded_ones_in_openais_format(
    model: OdysseyForCausalLM, codec: ChatCodec
) -> None:
    """`logprobs: true` (chat) and `logprobs: 0` (completions): one entry per sampled token (`token_ids`),
    each log-prob the one recorded for training, parsed by the OpenAI client; streamed too. `top_logprobs`
    > 0 and completions `logprobs` > 0 (the engine reports the sampled token only) are 400s."""
    s = _Served(TorchEngine(model), codec, CFG)
    try:
        client = _client(s)
        reply = _in_thread(
            lambda: client.chat.completions.create(
                model="policy", messages=[USER], logprobs=True, top_logprobs=0
            )
        )
        choice = reply.choices[0]
        recorded = s.rec.segments[-1].builder.logprobs[-len(choice.token_ids) :]
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(recorded, abs=1e-6)
        assert "".join(e.token for e in choice.logprobs.content) == codec.decode(choice.token_ids)
        assert all(
            e.top_logprobs == [] and bytes(e.bytes).decode() == e.token for e in choice.logprobs.content
        )
        plain = _in_thread(lambda: client.chat.completions.create(model="policy", messages=[USER]))
        assert plain.choices[0].logprobs is None  # only when asked
        r = s.post("/completions", {"prompt": "1 2 3", "logprobs": 0})
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == pytest.approx(
            s.rec.segments[-1].builder.logprobs[-len(lp["tokens"]) :]
        )
        assert lp["text_offset"][0] == 0 and len(lp["tokens"]) == len(r.json()["choices"][0]["token_ids"])
        stream = _in_thread(
            lambda: list(
                client.chat.completions.create(model="policy", messages=[USER], logprobs=True, stream=True)
            )
        )
        assert len(stream[0].choices[0].logprobs.content) == len(
            stream[0].choices[0].model_extra["token_ids"]
        )
        for path, body, code in (
            ("/chat/completions", {"messages": [USER], "logprobs": True, "top_logprobs": 3}, "unsupported"),
            ("/chat/completions", {"messages": [USER], "logprobs": "yes"}, "invalid_request"),
            ("/completions", {"prompt": "1", "logprobs": 2}, "unsupported"),
        ):
            r = s.post(path, body)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
            assert "log-prob" in r.json()["error"]["message"]
    finally:
        s.close()


def test_tool_choice_seed_and_response_format_are_honoured_or_refused(
    model: OdysseyForCausalLM, codec: ChatCodec
) -> None:
    """`tool_choice`: "auto" parses tool calls, "none" returns the model's text as content (no `tool_calls`),
    "required" and a named function are 400s (the policy is not constrained). `seed`: an integer is accepted
    (the run's seeding decides, so a group's episodes still differ), anything else a 400. `response_format`:
    {"type": "text"} is served, JSON modes are 400s."""
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    engine = TeacherForcedEngine(TorchEngine(model), codec, lambda request: call)
    s = _Served(engine, codec, CFG)
    try:
        client = _client(s)
        auto = _in_thread(
            lambda: client.chat.completions.create(
                model="policy", messages=[USER], tools=TOOLS, tool_choice="auto", seed=7
            )
        )
        assert auto.choices[0].message.tool_calls[0].function.name == "calc"
        assert auto.choices[0].finish_reason == "tool_calls"
        key = _open(s, engine)
        none = _in_thread(
            lambda: _client(s, key).chat.completions.create(
                model="policy",
                messages=[USER],
                tools=TOOLS,
                tool_choice="none",
                response_format={"type": "text"},
            )
        )
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == call
        assert none.choices[0].finish_reason == "stop"
        refused = [
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tool_choice": {"type": "function", "function": {"name": "calc"}}}, "tool_choice"),
            ({"tool_choice": 3}, "tool_choice"),
            ({"seed": "7"}, "seed"),
            ({"seed": 1.5}, "seed"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
            ({"stream": "yes"}, "stream"),
        ]
        for extra, param in refused:
            r = s.post("/chat/completions", {"messages": [USER], "tools": TOOLS, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
            assert param in r.json()["error"]["message"]
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------- docs
def _error_codes() -> set[str]:
    """Every error code the endpoint, the recorder and the body parser can answer with, read off the source:
    the code argument of each RequestError(...), _error(...) and _refuse(...) call (and _refuse's default),
    and the codes the middleware gives aiohttp's own errors."""
    codes = {"unsupported"}  # _refuse's default
    where = {"RequestError": 1, "_error": 2, "_refuse": 2}
    for name in ("rl/rollout/endpoint.py", "rl/rollout/agent_recorder.py", "rl/rollout/request_json.py"):
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "_json_errors":
                codes |= {v.value for d in ast.walk(node) if isinstance(d, ast.Dict) for v in d.values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str)}  # fmt: skip
            if (
                not isinstance(node, ast.Call)
                or not isinstance(node.func, ast.Name)
                or node.func.id not in where
            ):
                continue
            pos = where[node.func.id]
            args = [*node.args[pos : pos + 1], *[k.value for k in node.keywords if k.arg == "code"]]
            args += [
                a.args[1] for a in args if isinstance(a, ast.Call) and len(a.args) == 2
            ]  # d.get(k, default)
            codes |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return codes


def test_docs_name_every_endpoint_error_and_no_stale_image_claim() -> None:
    """docs/agents.md's "Endpoint errors" table names every error code the code can answer with; its
    "Request fields" section says what happens to each field the issue found ignored; the stale "images get
    a 400" line is gone."""
    docs = (ROOT / "docs/agents.md").read_text()

    def section(title: str) -> str:
        assert f"\n## {title}\n" in docs, title
        return docs.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]

    codes = _error_codes()
    assert {"invalid_json", "nested_too_deep", "context_length_exceeded", "not_found", "unsupported"} <= codes
    table = section("Endpoint errors")
    missing = sorted(c for c in codes if f"`{c}`" not in table)
    assert not missing, f"error codes missing from docs/agents.md's Endpoint errors table: {missing}"
    fields = section("Request fields")
    for field in (
        "stop",
        "logprobs",
        "top_logprobs",
        "tool_choice",
        "seed",
        "response_format",
        "temperature",
    ):
        assert f"`{field}`" in fields, field
    assert "Images in messages (400)" not in docs and "image parts, `n` > 1" not in docs
