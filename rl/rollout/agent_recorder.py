"""`EpisodeRecorder`: the token-faithful record of one episode whose agent talks to the policy over the
OpenAI API (rl/rollout/endpoint.py). Token in, token out: the ids the policy was fed and the ids it
sampled are recorded as they were, never re-tokenised from the text the agent sends back.

    rec = EpisodeRecorder(engine, codec, cfg, sample_seed=7)
    turn = await rec.chat(messages, tools, max_tokens)     # one /v1/chat/completions request
    turn = await rec.complete(prompt, max_tokens)          # one /v1/completions request (str or ids)
    trajs = rec.trajectories(outcome, metadata)            # one Trajectory per segment

Chat requests. An agent resends its whole conversation each time. When the new request's messages
extend what the open segment already holds (the same tools, the same earlier messages, and each assistant
message the one this recorder returned: same content, same tool calls by name and arguments), only the new
messages are encoded (`ChatCodec.continuation`, after an end-of-turn the model did not emit itself) and
fed on the segment's engine session, exactly as `run_episode` does. Otherwise the agent rewrote its
history (dropped, edited or summarised messages, changed the tools): a new segment starts from the full
rendering of the request, and `metadata["context_replaced_at"]` records at which request.

Images: a system, user or tool message may hold OpenAI image parts, {"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}} (inline data URLs only: rollouts have no network). When the policy
reads images (a vision preset) each is prepared as env images are (model/image.py) and its token block
sits in the recorded tokens, the PNG in `Trajectory.images`; a text-only policy, a remote URL, bad base64
or undecodable bytes get a 400 naming the problem. Two requests hold the same image when its bytes are.

Completion requests (`prompt` as text or as token ids) extend the open segment when the prompt ids start
with all of its tokens; otherwise they start a new segment. They carry no images: image token ids in a
prompt are refused.

Each assistant turn's text is parsed with the env tool-call protocol (envs/tool_call.py): well-formed
`<tool_call>` blocks become OpenAI `tool_calls` (arguments as JSON text), the rest of the text is the
message content. Sampling is the run's (`EpisodeConfig`): a request's `temperature` / `top_p` do not
change it (the learner's importance ratios assume the run's distribution); `max_tokens` can only lower
the per-turn cap. `stop` strings end the turn where the sampled text first holds one (the engine stops
there; the returned text ends before it, the record keeps every sampled id). `tool_choice="none"` returns
the turn's text as content, tool-call markup included.

Requests are bounded before they are worked on: the turn limit and a cheap lower bound on the new tokens
(one template floor per message, characters over the longest token) refuse an over-budget request without
encoding it, and the canonicalising and encoding run on a worker thread (`off_loop`), never on the event
loop that serves every episode of the worker. `truncated` means the episode ran out: the budget was used up
by a generated turn, or the last request was refused for the budget or the turn limit (an agent that then
compacts its context and goes on within budget is not truncated).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError

from envs.tool_call import ToolCall, format_tool_call, parse_tool_calls, without_surrogates
from envs.tool_result import ImageLimits, check_image
from model.image_tokens import IMAGE_TOKEN_IDS
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, _Builder, _split_routing
from rl.rollout.engine import GenerationRequest, InferenceEngine, Session
from rl.rollout.request_json import RequestError, bounded_json, loads_bounded, off_loop
from rl.rollout.sampling import SamplingParams
from rl.trajectory import StepInfo, Trajectory, TurnSpan


class EngineFailure(RuntimeError):
    """The inference engine failed on a request: an infrastructure error of the episode (HTTP 500)."""


@dataclass
class TurnResult:
    """One generated assistant turn as the endpoint returns it."""

    text: str  # the model's text (stop token removed), tool-call markup included
    content: str | None  # text outside well-formed tool calls (None when empty)
    tool_calls: list[tuple[str, dict[str, Any]]]  # (name, arguments) of each well-formed call
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int  # tokens of the request's context (the whole segment so far)
    finish_reason: str  # "stop" | "tool_calls" | "length"


@dataclass
class _Segment:
    builder: _Builder = field(default_factory=_Builder)
    history: list[tuple] = field(default_factory=list)  # canonical messages the tokens encode (chat mode)
    messages: list[dict] = field(default_factory=list)  # the decoded conversation, for rewards
    session: Session | None = None
    needs_eot: bool = False  # the last assistant turn did not end with end-of-turn
    mode: str = "chat"  # "chat" | "completion"
    started_at: int = 0  # index of the request that opened it
    n_prompt_messages: int = 0
    step_infos: list[StepInfo] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)


def message_text(content: Any, where: str) -> str:
    """The text of an OpenAI message `content` that holds no images: a string, None, or text parts."""
    parts = message_parts(content, where, {})
    if any(kind == "image" for kind, _ in parts):
        raise RequestError(f"{where}.content: an image part in an assistant message; only system, user and "
                           "tool messages may hold images (the policy writes text)")
    return "".join(text for _, text in parts)


def message_parts(content: Any, where: str, images: dict[str, bytes]) -> list[tuple[str, str]]:
    """An OpenAI message `content` (a string, None, or a list of text and image_url parts) as
    [("text", text) | ("image", sha256 of the image's bytes)]; each image's bytes are put in `images`."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise RequestError(
            f"{where}.content must be a string, null or a list of text / image_url parts, got "
            f"{type(content).__name__}"
        )
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(("text", part["text"]))
        elif kind == "image_url":
            data = data_url_bytes(part.get("image_url"), f"{where}.content[{i}].image_url")
            sha = hashlib.sha256(data).hexdigest()
            images.setdefault(sha, data)
            out.append(("image", sha))
        else:
            raise RequestError(
                f"{where}.content[{i}]: a part must be {{'type': 'text', 'text': ...}} or {{'type': "
                f"'image_url', 'image_url': {{'url': 'data:image/png;base64,...'}}}}, got type {kind!r}"
            )
    return out


def data_url_bytes(image_url: Any, where: str) -> bytes:
    """The bytes of an OpenAI `image_url` ({"url": ..., "detail": ...} or the URL string) that is an inline
    base64 data URL; anything else is a RequestError naming the fix."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise RequestError(f"{where} must be {{'url': 'data:image/png;base64,...'}}")
    if not url.startswith("data:"):
        raise RequestError(
            f"{where}.url is {url[:40]!r}...: this endpoint fetches nothing (rollouts have no network); send "
            "the image inline as a base64 data URL, data:image/png;base64,<bytes>", "invalid_image_url"
        )
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise RequestError(f"{where}.url: a data URL must be base64 (data:image/png;base64,...)",
                           "invalid_image_url")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(f"{where}.url: the data URL's base64 does not decode: {err}",
                           "invalid_image_url") from None


def _tool_calls(message: dict, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of an assistant message's OpenAI `tool_calls`."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(
                f"{where}.tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
            )
        args = fn.get("arguments", "{}")
        where_args = f"{where}.tool_calls[{i}].function.arguments"
        parsed = loads_bounded(args, where_args) if isinstance(args, str) else bounded_json(args, where_args)
        out.append((fn["name"], parsed))
    return out


def canonical(messages: list[Any], tools: list[dict] | None, images: dict[str, bytes]) -> list[tuple]:
    """The request as comparable tuples: the tools first, then (role, content, tool calls) per message, the
    content its text, or with images a tuple of ("text", text) / ("image", sha256) parts (the image bytes
    put in `images`). Tool-call ids and other fields (name, refusal, annotations) do not take part."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of chat messages")
    out: list[tuple] = [("tools", json.dumps(tools or [], sort_keys=True))]
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(
                f"{where}.role must be system, developer, user, assistant or tool, got {role!r}"
            )
        calls = _tool_calls(m, where) if role == "assistant" else []
        if role == "assistant":
            content: str | tuple = without_surrogates(message_text(m.get("content"), where))
        else:
            parts = message_parts(m.get("content"), where, images)
            if any(kind == "image" for kind, _ in parts):
                content = tuple((k, without_surrogates(v) if k == "text" else v) for k, v in parts)
            else:
                content = without_surrogates("".join(v for _, v in parts))
        out.append((role, content, json.dumps(calls, sort_keys=True)))
    return out


def _template_message(item: tuple, images: dict[str, bytes]) -> dict:
    """A canonical message as the chat template takes it: tool calls inline in the assistant content, image
    parts as {"type": "image", "image": bytes} (the codec prepares them)."""
    role, content, calls = item
    if role == "assistant":
        content = content + "".join(format_tool_call(n, a) for n, a in json.loads(calls))
    elif isinstance(content, tuple):
        content = [{"type": "text", "text": v} if k == "text" else {"type": "image", "image": images[v]}
                   for k, v in content]
    return {"role": role, "content": content}


def _serialisable(arguments: dict[str, Any]) -> bool:
    """Can the call's arguments travel as OpenAI's JSON text? (Not when nested near the recursion limit:
    such a block stays in the message content, as text the model wrote.)"""
    try:
        json.dumps(arguments)
    except (ValueError, RecursionError):
        return False
    return True


@functools.lru_cache(maxsize=16)
def _message_floor(codec: ChatCodec) -> int:
    """The fewest tokens the chat template spends on one more message of any role (empty content, alone or
    after one of its role), measured once per codec; 0 when the template cannot say (a bound, never more)."""
    try:
        base = len(codec.encode_observation([]).ids)
        costs = []
        for role in ("system", "user", "assistant", "tool"):
            m = {"role": role, "content": ""}
            one = len(codec.encode_observation([m]).ids)
            costs += [one - base, len(codec.encode_observation([m, m]).ids) - one]
        return max(0, min(costs))
    except Exception:  # noqa: BLE001 - a checkpoint's template raises whatever its author wrote
        return 0


@functools.lru_cache(maxsize=16)
def _chars_per_token(codec: ChatCodec) -> int:
    """More characters than any token of the codec's tokenizer decodes to: the longest vocabulary entry (a
    byte-level or metaspace token is at least as long as its text), times 4 for normalisation."""
    return 4 * max(1, max((len(t) for t in codec.tok.get_vocab()), default=1))


def _plain_ids(codec: ChatCodec, text: str) -> list[int]:
    """`text` encoded without special tokens (a /v1/completions prompt)."""
    return [int(i) for i in codec.tok.encode(text, add_special_tokens=False)]


def _split_turn(text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """(content, tool calls) of a model turn: well-formed blocks become calls, the rest stays content. A call
    nested deeper than a request may be (MAX_JSON_DEPTH) stays content too, so that the agent can send every
    call it got back; names and arguments are surrogate-free, as the agent's request will be."""
    calls, content = [], text
    for item in parse_tool_calls(text):
        if not isinstance(item, ToolCall):
            continue
        try:
            arguments = bounded_json(item.arguments, "")
        except RequestError:
            continue
        if _serialisable(arguments):
            calls.append((without_surrogates(item.name), arguments))
            content = content.replace(f"<tool_call>{item.raw}</tool_call>", "", 1)
    content = content.strip() if calls else content
    return (content or None), calls


class EpisodeRecorder:
    """Serves one episode's requests on `engine` and records them (see the module docstring).
    Requests are served one at a time, in arrival order."""

    def __init__(self, engine: InferenceEngine, codec: ChatCodec, cfg: EpisodeConfig, sample_seed: int):
        self.engine, self.codec, self.cfg = engine, codec, cfg
        self.draw = int(sample_seed)
        self.segments: list[_Segment] = []
        self.requests = 0
        self.turns = 0
        self._refused: str | None = None  # "token_budget" | "max_turns": the last refusal, until a turn
        self._spent: str | None = None  # "token_budget" once generated turns used the whole budget
        self.infra_error: str | None = None
        self.weight_version = int(engine.weight_version)
        self._lock = asyncio.Lock()

    @property
    def total_tokens(self) -> int:
        return sum(len(s.builder) for s in self.segments)

    @property
    def truncated(self) -> str | None:
        """Why the episode ran out ("token_budget" | "max_turns"), or None: generated turns used the whole
        budget, or the last request was refused for the budget or the turn limit. A refusal the agent
        recovered from (it compacted its context, and a later turn was generated) does not count."""
        return self._spent or self._refused

    # ------------------------------------------------------------------ requests
    async def chat(
        self,
        messages: list[Any],
        tools: list[dict] | None,
        max_tokens: int | None,
        stop: list[str] | None = None,
        tool_choice: str = "auto",
    ) -> TurnResult:
        """Serve one chat request: generate the next assistant turn of `messages`. `stop`: strings that end
        the turn; `tool_choice`: "auto" (tool calls parsed) or "none" (the turn's text is the content)."""
        async with self._lock:
            self.requests += 1
            stops = self._check_request(max_tokens, stop)
            self._chat_bound(messages)
            images: dict[str, bytes] = {}  # this request's image bytes by sha256 of the bytes sent
            new = await off_loop(canonical, messages, tools, images)
            images = await self._sanitized(images)
            seg, pending, added = await off_loop(self._chat_pending, new, tools, images)
            turn = await self._generate(seg, pending, max_tokens, tool_choice != "none", stops)
            content, calls = _split_turn(turn.text) if tool_choice != "none" else (turn.text or None, [])
            turn.content, turn.tool_calls = content, calls
            if calls and turn.finish_reason == "stop":
                turn.finish_reason = "tool_calls"
            said = ("assistant", without_surrogates(content or ""), json.dumps(calls, sort_keys=True))
            seg.history = [*new, said]
            seg.messages += [*self.codec.for_record(added), {"role": "assistant", "content": turn.text}]
            tool_calls = [{"name": n, "arguments": a} for n, a in calls]
            seg.step_infos.append(StepInfo(turn=self.turns, tool_calls=tool_calls))
            return turn

    async def complete(
        self, prompt: str | list[int], max_tokens: int | None, stop: list[str] | None = None
    ) -> TurnResult:
        """Serve one completion request: continue `prompt` (text, encoded without special tokens, or ids)."""
        async with self._lock:
            self.requests += 1
            stops = self._check_request(max_tokens, stop)
            seg = self.segments[-1] if self.segments else None
            held = seg.builder.tokens if seg is not None and seg.mode == "completion" else None
            if isinstance(prompt, str) and prompt:
                at_least = len(prompt) // _chars_per_token(self.codec)  # tokens of the whole prompt
                self._check_budget(at_least - len(held or ()), at_least=True)
                ids = await off_loop(_plain_ids, self.codec, prompt)
            elif isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
                self._check_budget(len(prompt) - len(held or ()), at_least=True)
                ids = list(prompt)
            else:
                raise RequestError("'prompt' must be a non-empty string or a non-empty list of token ids "
                                   "(ints)", param="prompt")  # fmt: skip
            vocab = len(self.codec.tok)
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
            if self.codec.patch_size and any(i in IMAGE_TOKEN_IDS for i in ids):  # a vision policy's blocks
                raise RequestError(f"the prompt holds image tokens (ids {sorted(IMAGE_TOKEN_IDS)}); a "
                                   "completion carries no image: send images as image_url parts to "
                                   "/v1/chat/completions")
            if held is not None and len(ids) > len(held) and ids[: len(held)] == held:
                pending = [("observation", ids[len(held) :], [])]
            else:
                seg = _Segment(mode="completion", started_at=self.requests, n_prompt_messages=1)
                pending = [("prompt", ids, [])]
            turn = await self._generate(seg, pending, max_tokens, False, stops)
            seg.messages += [
                {"role": "user", "content": self.codec.decode(pending[0][1])},
                {"role": "assistant", "content": turn.text},
            ]
            seg.step_infos.append(StepInfo(turn=self.turns))
            return turn

    # ------------------------------------------------------------------ internals
    def _check_request(self, max_tokens: Any, stop: list[str] | None) -> tuple[str, ...]:
        """What is cheap to check before any work: the episode is still open (no engine failure, turns left),
        `max_tokens` is a positive integer, the engine can stop at strings. The stop strings, as a tuple."""
        if self.infra_error is not None:
            raise EngineFailure(f"the episode already failed: {self.infra_error}")
        if self.cfg.max_turns is not None and self.turns >= self.cfg.max_turns:
            self._refused = "max_turns"
            raise RequestError(
                f"this episode's turn limit ({self.cfg.max_turns} generations) is reached; finish the task",
                "turn_limit_exceeded",
            )
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}",
                               param="max_tokens")  # fmt: skip
        stops = tuple(stop or ())
        if stops and getattr(self.engine, "detokenize", None) is None:
            raise RequestError(
                "'stop' is not supported by this engine: it was built without a detokenizer (build it with "
                "detokenize=tokenizer.decode, as the rollout worker does), or send no 'stop'", "unsupported",
                param="stop",
            )  # fmt: skip
        return stops

    def _check_budget(self, n_new: int, at_least: bool = False) -> None:
        """Refuse (context_length_exceeded) a request whose `n_new` tokens leave no token of the episode's
        budget to generate; `at_least`: `n_new` is a lower bound, known before encoding."""
        if self.cfg.max_episode_tokens - self.total_tokens - n_new > 0:
            return
        self._refused = "token_budget"
        needs = f"at least {n_new}" if at_least else str(n_new)
        raise RequestError(
            f"this episode's token budget ({self.cfg.max_episode_tokens} tokens in all) is spent: the "
            f"request needs {needs} more tokens with {self.total_tokens} used; send a shorter context or "
            "finish the task",
            "context_length_exceeded",
        )

    def _chat_bound(self, messages: Any) -> None:
        """Refuse a chat request that cannot fit the budget, before canonicalising or encoding it: the new
        messages (those past the open segment's, or all when the request cannot extend it) cost at least the
        template's floor per message, and at least their text's characters over the longest token."""
        if not isinstance(messages, list):
            return  # canonical() says what is wrong
        seg = self.segments[-1] if self.segments else None
        first = 0
        if seg is not None and seg.mode == "chat" and len(messages) >= len(seg.history):
            first = len(seg.history) - 1
        new = messages[first:]
        chars = 0
        for m in new:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p["text"]) for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))  # fmt: skip
        floor = _message_floor(self.codec)
        self._check_budget(max(len(new) * floor, chars // _chars_per_token(self.codec)), at_least=True)

    async def _sanitized(self, images: dict[str, bytes]) -> dict[str, bytes]:
        """`images` decoded and re-encoded as RGB PNGs by the tool-image decoder (envs/tool_result.py
        `check_image` with a tool image's limits: PNG or JPEG only, at most 8 MiB and 4096² pixels counted
        from the header, decoded in a child process killed with its whole process group on timeout), keyed as
        sent, so that a resent conversation still matches. The
        agent's bytes are never decoded in the worker's own process. A text-only policy's images are left
        for `_prepared` to refuse."""
        if not images or not self.codec.patch_size:
            return images
        out = {}
        for sha, data in images.items():
            try:
                out[sha], _, _ = await check_image(data, ImageLimits())
            except ValueError as err:
                raise RequestError(f"an image_url part: {err}", "invalid_image", param="messages") from None
        return out

    def _chat_pending(
        self, new: list[tuple], tools: list[dict] | None, images: dict[str, bytes]
    ) -> tuple[_Segment, list, list]:
        """(segment, pending (role, ids, images) parts, added template messages) of a chat request, given
        its canonical form `new` and its (sanitised) image bytes by sha256: the open segment's continuation
        when the request extends it, else a new segment. Pure (reads the open segment only): runs on a
        worker thread (`off_loop`)."""
        if new[-1][0] == "assistant":
            raise RequestError(
                "the last message is an assistant message; end with a user or tool message", param="messages"
            )
        seg = self.segments[-1] if self.segments else None
        try:
            if (
                seg is not None
                and seg.mode == "chat"
                and len(new) > len(seg.history)
                and new[: len(seg.history)] == seg.history
            ):
                first = len(seg.history) - 1  # messages[first] is the first new one
                added = self._prepared([_template_message(m, images) for m in new[len(seg.history) :]], first)
                pending = [("assistant", [self.codec.eot_id], [])] if seg.needs_eot else []
                enc = self.codec.encode_observation(added)
                pending.append(("observation", enc.ids, enc.images))
            else:
                added = self._prepared([_template_message(m, images) for m in new[1:]], 0)
                seg = _Segment(mode="chat", started_at=self.requests, n_prompt_messages=len(added))
                enc = self.codec.encode_prompt(added, tools)
                pending = [("prompt", enc.ids, enc.images)]
        except TemplateError as err:  # a checkpoint's chat template refusing the conversation
            raise RequestError(f"the policy's chat template refuses this conversation: {err}",
                               "template_error", param="messages") from None  # fmt: skip
        return seg, pending, added

    def _prepared(self, messages: list[dict], first: int) -> list[dict]:
        """`messages` (request messages[first:]) with each image decoded and sized for the policy
        (ChatCodec.prepare); a text-only policy or a bad image is the request's error."""
        out = []
        for j, m in enumerate(messages):
            if not isinstance(m["content"], list):
                out.append(m)
                continue
            if not self.codec.patch_size:
                raise RequestError(f"messages[{first + j}] holds an image but this policy reads text only "
                                   "(its model has no vision_patch_size): send text", "images_not_supported")
            try:
                out += self.codec.prepare([m])
            except ValueError as err:  # model.image.ImageError: not an image, too large, ...
                raise RequestError(f"messages[{first + j}]: {err}", "invalid_image") from None
        return out

    def _open(self, seg: _Segment) -> None:
        """Make `seg` the open segment (when its first turn was generated): the previous one's engine
        session is released, since the agent left that context."""
        if self.segments and self.segments[-1] is not seg:
            prev = self.segments[-1]
            if prev.session is not None:
                self.engine.release(prev.session)
                prev.session = None
        if not self.segments or self.segments[-1] is not seg:
            self.segments.append(seg)

    async def _generate(
        self,
        seg: _Segment,
        pending: list[tuple[str, list[int], list]],
        max_tokens: int | None,
        stop_on_tool_call: bool = True,
        stop: tuple[str, ...] = (),
    ) -> TurnResult:
        cfg = self.cfg
        self._check_request(max_tokens, None)
        n_new = sum(len(ids) for _, ids, _ in pending)
        self._check_budget(n_new)
        budget = cfg.max_episode_tokens - self.total_tokens - n_new
        stop_ids, stop_strs = self.codec.stops(stop_on_tool_call and cfg.stop_on_tool_call)
        stop_strs = stop_strs + tuple(s for s in stop if s not in stop_strs)
        params = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=min(cfg.max_new_tokens, budget, max_tokens or cfg.max_new_tokens),
            stop_token_ids=stop_ids,
            stop_strings=stop_strs,
            seed=hash((self.draw, self.turns)) & 0x7FFFFFFF,
        )
        prompt_ids = [t for _, ids, _ in pending for t in ids]
        images, offset = [], 0  # (offset in prompt_ids, PreparedImage)
        for _, ids, imgs in pending:
            images += [(offset + o, img) for o, img in imgs]
            offset += len(ids)
        request = GenerationRequest(prompt_ids, params, seg.session, request_id=f"{self.draw}:{self.turns}",
                                    images=images)
        try:
            res = await self.engine.agenerate(request)
        except Exception as e:  # the engine's failure, never the agent's: the pending tokens were not seen
            self.infra_error = f"engine: {type(e).__name__}: {e}"[:2000]
            raise EngineFailure(self.infra_error) from e
        self._open(seg)
        seg.session = res.session
        for (role, ids, imgs), r in zip(
            pending, _split_routing(res.prompt_routed_experts, [len(i) for _, i, _ in pending])
        ):
            seg.builder.add(role, ids, routed=r, images=imgs)
        versions = list(getattr(res, "token_versions", None) or [res.weight_version] * len(res.token_ids))
        seg.builder.add(
            "assistant", res.token_ids, logprobs=res.logprobs, routed=res.routed_experts, versions=versions
        )
        self.turns += 1
        self._refused = None  # the agent got back within its limits
        if self.total_tokens >= cfg.max_episode_tokens:
            self._spent = "token_budget"
        gen = list(res.token_ids)
        stopped = bool(gen) and gen[-1] in self.codec.stop_ids
        seg.needs_eot = not (bool(gen) and gen[-1] == self.codec.eot_id)
        seg.finish_reasons.append(res.finish_reason)
        finish = "length" if res.finish_reason == "length" else "stop"
        text = self.codec.decode(gen[:-1] if stopped else gen)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:  # the text ends before the first stop string, as OpenAI's does; the ids stay as sampled
            text, finish = text[:cut], "stop"
        return TurnResult(
            text=text,
            content=None,
            tool_calls=[],
            token_ids=gen,
            logprobs=list(res.logprobs),
            prompt_tokens=len(seg.builder) - len(gen),
            finish_reason=finish,
        )

    def close(self) -> None:
        """Release the engine session of the open segment (the others were released when they closed)."""
        for seg in self.segments:
            if seg.session is not None:
                self.engine.release(seg.session)
                seg.session = None

    # ------------------------------------------------------------------ the record
    def episode_trajectory(self, outcome: float | None, metadata: dict[str, Any]) -> Trajectory | None:
        """The whole episode as one Trajectory (None when no turn was generated): the segments one after
        another, `metadata["segment_starts"]` the token positions where segments 2.. begin (their prompt
        turns). The learner restarts the context there (rl/learner/packing.py), so each segment is trained
        exactly as it was sampled, and the episode's advantage reaches every segment."""
        segs = self.trajectories(outcome, metadata)
        if not segs:
            return None
        starts = np.cumsum([0] + [len(t.tokens) for t in segs])
        turns = [
            TurnSpan(s.role, s.start + int(o), s.end + int(o)) for t, o in zip(segs, starts) for s in t.turns
        ]
        routed = [t.routed_experts for t in segs]
        spans = [dataclasses.replace(sp, start=sp.start + int(o), end=sp.end + int(o))
                 for t, o in zip(segs, starts) for sp in t.image_spans]
        last = segs[-1]
        meta = {
            **last.metadata,
            "messages": [m for t in segs for m in t.metadata["messages"]],
            "n_prompt_messages": segs[0].metadata["n_prompt_messages"],
            "segment_starts": [int(o) for o in starts[1:-1]],
            "context_replaced_at": [t.metadata["context_replaced_at"] for t in segs[1:]],
            "finish_reasons": [r for t in segs for r in t.metadata["finish_reasons"]],
            "n_turns": sum(t.metadata["n_turns"] for t in segs),
        }
        meta.pop("segment", None)
        return Trajectory(
            tokens=np.concatenate([t.tokens for t in segs]),
            loss_mask=np.concatenate([t.loss_mask for t in segs]),
            rollout_logprobs=np.concatenate([t.rollout_logprobs for t in segs]),
            routed_experts=None if any(r is None for r in routed) else np.concatenate(routed),
            turns=turns,
            step_infos=[i for t in segs for i in t.step_infos],
            outcome=last.outcome,
            terminated=last.terminated,
            truncated=last.truncated,
            infra_error=last.infra_error,
            metadata=meta,
            token_versions=np.concatenate([t.token_versions for t in segs]),
            images={k: v for t in segs for k, v in t.images.items()},
            image_spans=spans,
        )

    def trajectories(self, outcome: float | None, metadata: dict[str, Any]) -> list[Trajectory]:
        """One Trajectory per segment (in order), each with the episode's outcome and infra error."""
        out = []
        n = len(self.segments)
        for k, seg in enumerate(self.segments):
            b = seg.builder
            meta = {
                **metadata,
                "messages": seg.messages,
                "n_prompt_messages": seg.n_prompt_messages,
                "segment": k,
                "n_segments": n,
                "context_replaced_at": seg.started_at if k > 0 else None,
                "requests": self.requests,
                "finish_reasons": seg.finish_reasons,
                "n_turns": len(seg.finish_reasons),
                "policy_version_end": int(self.engine.weight_version),
            }
            if self.truncated:
                meta["truncation"] = self.truncated
            out.append(
                Trajectory(
                    tokens=np.asarray(b.tokens, dtype=np.int32),
                    loss_mask=np.asarray(b.mask, dtype=np.uint8),
                    rollout_logprobs=np.asarray(b.logprobs, dtype=np.float32),
                    routed_experts=b.routed_array(),
                    turns=b.turns,
                    step_infos=seg.step_infos,
                    outcome=outcome if self.infra_error is None else None,
                    terminated=self.truncated is None or self.infra_error is not None,
                    truncated=self.truncated is not None and self.infra_error is None,
                    infra_error=self.infra_error,
                    metadata=meta,
                    token_versions=np.asarray(b.versions, dtype=np.int32),
                    images=b.images,
                    image_spans=b.image_spans,
                )
            )
        return out
