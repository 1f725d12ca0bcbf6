"""One multi-turn agent episode -> one token-faithful `Trajectory`.

    messages = env.reset()                                    # [system, user]
    ids      = render(messages, tools, generation prompt)     # tokenised ONCE       -> "prompt" span
    loop:
        result = engine.generate(ids, session)                # only the new ids are prefilled
        text   = decode(result.token_ids minus a final EOT/EOS)  # the model's turn  -> "assistant" span
        obs    = env.step(text)                               # tool messages / nudge
        ids    = [end_of_turn if the model did not emit it]   # (forced, loss_mask 0, in the assistant span)
               + encode_continuation(obs, generation prompt)  # only the new messages -> "observation" span
    until terminated, truncated, the turn cap or the episode token budget

History is never re-tokenised: the trajectory's tokens are exactly the ids fed to and sampled from
the engine, in order. The chat-format invariant of model/tokenizer.py makes them equal to the ids of
rendering the whole conversation, so the trainer sees the same sequence the policy saw.

Per token: loss_mask 1, rollout_logprobs and token_versions (the weights version that sampled it) on
sampled tokens (NaN / -1 elsewhere); routed_experts for every fed token (prompt, observations and
generated ones: R3 replays the whole sequence). A weight update during the episode (async training)
lets it continue on the new weights: the engine rebuilds its cache, the trajectory records both versions.
The decoded conversation goes to `metadata["messages"]` (the env's prompt messages, each assistant
turn's text, each observation message; `metadata["n_prompt_messages"]` of them are the prompt), so
reward functions read text without a tokenizer (rewards/text.py).

Images: a prompt or observation message may hold {"type": "image", "image": ...} content parts (encoded
bytes, a PIL image, a uint8 [H, W, 3] array, or a `model.image.PreparedImage`). The codec prepares each once
with the policy's vision settings (`ChatCodec(tokenizer, patch_size, max_pixels)`), the request carries them
to the engine (`GenerationRequest.images`), and the trajectory records them content-addressed
(`Trajectory.images`, `image_spans`); `metadata["messages"]` names each image by its sha256 instead of
holding its bytes. Images given to a text-only codec end the episode as an "env" infra error naming the fix.

Seeds: `seed` is the task's (env.reset); `sample_seed` (default: `seed`) seeds the sampling, so several
samples of one task (a GRPO group) draw different completions of the same problem.

Failures never lose an episode: a SandboxError the env reports (info["infra_error"]), an exception
from env.reset/step or from the engine, all end the episode with `Trajectory.infra_error` set and
whatever tokens were completed kept (tokens the engine never processed are dropped, so the record
stays exactly what the model saw). `metadata["infra_source"]` says whose failure it was:

    "sandbox"  a SandboxError (daemon, container), reported by the env or raised through it
    "engine"   the inference engine raised
    "env"      the env's own code raised (reset, step, or messages the tokenizer cannot encode)

Model text can never cause one: parsing, dispatch and observations are total functions of the text
(envs/base.py), and observation strings are made encodable here (lone surrogates replaced) before
they are tokenised. An env that raises on some input is still an infra error, counted per env by the
worker (`WorkerReport.infra_by_env`) and stopped by `rl.rollout.health` when it dominates a batch.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.tool_call import without_surrogates
from rl.rollout.engine import GenerationRequest, InferenceEngine, Session
from rl.rollout.sampling import SamplingParams
from rl.trajectory import ImageSpan, StepInfo, Trajectory, TurnSpan


@dataclass(frozen=True)
class EpisodeConfig:
    """Budgets and decoding for one episode.

    max_new_tokens: per assistant turn. max_episode_tokens: total tokens (prompt + all turns +
    observations); the episode is truncated when the next step would exceed it. max_turns: cap on
    assistant turns on top of the env's own (None = env decides). stop_on_tool_call: end a turn at
    the first `</tool_call>` (the env then runs it); otherwise only at end-of-turn / EOS.
    """

    max_new_tokens: int = 256
    max_episode_tokens: int = 4096
    max_turns: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_on_tool_call: bool = True


class ChatCodec:
    """The tokenizer side of the loop (model/tokenizer.py): prompt rendering, continuation encoding,
    stop tokens, decoding, and images (prepared with the policy's `patch_size` / `max_pixels`; 0 = the
    policy is text-only). The loop itself never touches template details."""

    def __init__(self, tokenizer: Any, patch_size: int = 0, max_pixels: int = 0):
        from model import tokenizer as tk

        self.tok = tokenizer
        self.patch_size, self.max_pixels = int(patch_size), int(max_pixels)
        self._tk = tk
        self.fingerprint = tk.tokenizer_fingerprint(tokenizer)  # recorded in every trajectory's metadata
        self.eot_id = int(tk.end_of_turn_id(tokenizer))
        self.stop_ids = tuple(int(i) for i in tk.stop_token_ids(tokenizer) if i is not None)
        close = tokenizer.encode(tk.TOOL_CALL_END, add_special_tokens=False)
        self.tool_close_id = int(close[0]) if len(close) == 1 else None
        self.tool_close = tk.TOOL_CALL_END

    def render_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """ids(render(messages, tools, add_generation_prompt=True)), BOS included."""
        return self.encode_prompt(messages, tools).ids

    def continuation(self, messages: list[dict]) -> list[int]:
        """ids of `messages` right after an assistant END_OF_TURN, ending with the next generation prompt."""
        return self.encode_observation(messages).ids

    def encode_prompt(self, messages: list[dict], tools: list[dict] | None) -> Any:
        """`render_prompt` with its images: model.tokenizer.ChatEncoding(ids, [(offset, PreparedImage)])."""
        enc = self._tk.encode_chat_images(self.tok, self.prepare(messages), tools or None,
                                          add_generation_prompt=True)
        enc.ids = [int(i) for i in enc.ids]
        return enc

    def turn_ids(self, text: str) -> list[int]:
        """Ids of an assistant turn's `text` (no end of turn) as the chat template's own tokenization holds
        them after its generation prompt: what a policy writing `text` samples, so that scripted and oracle
        turns (warm-up data, teacher forcing) equal the template's tokenization of the conversation. Odyssey's
        tokenizer encodes a turn on its own exactly; others may not (a Metaspace "first" or prefix-space
        tokenizer marks the start of a string, Llama 3's template trims): model.tokenizer.encode_turn."""
        if self._tk.chat_format(self.tok).slot_exact:
            return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]
        return [int(i) for i in self._tk.encode_turn(self.tok, text)]

    def encode_observation(self, messages: list[dict]) -> Any:
        """`continuation` with its images (offsets relative to the continuation)."""
        enc = self._tk.encode_continuation_images(self.tok, self.prepare(messages),
                                                  add_generation_prompt=True)
        enc.ids = [int(i) for i in enc.ids]
        return enc

    def prepare(self, messages: list[dict]) -> list[dict]:
        """Messages with every image part's image a PreparedImage (decoded and resized once)."""
        from model.image import PreparedImage, prepare_image

        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list) or not any(_is_image(p) for p in content):
                out.append(m)
                continue
            if not self.patch_size:
                raise ValueError("a message holds an image but the policy is text-only: build the codec with "
                                 "the model's vision settings, ChatCodec(tokenizer, patch_size="
                                 "config.vision_patch_size, max_pixels=config.vision_max_pixels)")
            parts = [
                {**p, "image": p["image"] if isinstance(p.get("image"), PreparedImage)
                 else prepare_image(p.get("image"), self.patch_size, self.max_pixels)}
                if _is_image(p) else p
                for p in content
            ]
            out.append({**m, "content": parts})
        return out

    @staticmethod
    def for_record(messages: list[dict]) -> list[dict]:
        """JSON-safe copies of messages: an image part becomes {"type": "image", "sha256": ...} (its content
        address in Trajectory.images)."""
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                m = {**m, "content": [{"type": "image", "sha256": getattr(p.get("image"), "sha256", None)}
                                      if _is_image(p) else p for p in content]}
            out.append(dict(m))
        return out

    def decode(self, ids: list[int]) -> str:
        """Text of ids, markup and special tokens kept (ids outside the tokenizer's vocab decode to "")."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stops(self, stop_on_tool_call: bool) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(stop token ids, stop strings) for one assistant turn."""
        if not stop_on_tool_call:
            return self.stop_ids, ()
        if self.tool_close_id is not None:  # </tool_call> is a single token in Odyssey's tokenizer
            return self.stop_ids + (self.tool_close_id,), ()
        return self.stop_ids, (self.tool_close,)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


class _Builder:
    """Accumulates the trajectory's per-token arrays, turn spans and images."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.routed: list[np.ndarray | None] = []
        self.versions: list[int] = []
        self.turns: list[TurnSpan] = []
        self.images: dict[str, bytes] = {}
        self.image_spans: list[ImageSpan] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self,
        role: str,
        ids: list[int],
        logprobs: list[float] | None = None,
        routed: np.ndarray | None = None,
        versions: list[int] | None = None,
        images: list[tuple[int, Any]] = (),
    ) -> None:
        if not ids:
            return
        start = len(self.tokens)
        for o, img in images:  # (offset in ids, PreparedImage)
            self.images.setdefault(img.sha256, img.png)
            self.image_spans.append(ImageSpan(img.sha256, start + o, start + o + img.n_tokens, *img.grid))
        self.tokens += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [math.nan] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)
        self.routed.append(routed)
        last = self.turns[-1] if self.turns else None
        if last is not None and last.role == role and last.end == start:
            last.end = len(self.tokens)  # same message continues (e.g. forced end-of-turn)
        else:
            self.turns.append(TurnSpan(role, start, len(self.tokens)))

    def routed_array(self) -> np.ndarray | None:
        if not self.routed or any(r is None for r in self.routed):
            return None
        return np.concatenate(self.routed, 0).astype(np.uint16)


def _split_routing(r: np.ndarray | None, sizes: list[int]) -> list[np.ndarray | None]:
    if r is None:
        return [None] * len(sizes)
    out, a = [], 0
    for n in sizes:
        out.append(r[a : a + n])
        a += n
    return out


def _step_info(info: dict, reward: float) -> StepInfo:
    """The typed record of an env's step info (values that JSON cannot store become their repr)."""
    out = {}
    for k, v in info.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            v = repr(v)
        out[k] = v
    step = StepInfo.from_dict(out)
    step.env_reward = float(reward)
    return step


def _err(e: BaseException) -> str:
    tb = traceback.format_exception_only(type(e), e)[-1].strip()
    return tb[:2000]


def _source(e: BaseException) -> str:
    """Whose failure an exception raised by (or through) the env is: "sandbox" or "env"."""
    from sandbox.errors import SandboxError

    return "sandbox" if isinstance(e, SandboxError) else "env"


def _encodable(messages: list[dict]) -> list[dict]:
    """Observation messages with lone surrogates replaced in their string contents."""
    return [
        {k: without_surrogates(v) if isinstance(v, str) else v for k, v in m.items()}
        if isinstance(m, dict)
        else m
        for m in messages
    ]


class _EpisodeOver(Exception):
    """Internal: the episode ended with an infra error already recorded."""


async def run_episode(
    engine: InferenceEngine,
    env: Any,
    codec: ChatCodec,
    cfg: EpisodeConfig,
    *,
    seed: int,
    sample_seed: int | None = None,
    reset_options: dict | None = None,
    metadata: dict | None = None,
) -> Trajectory:
    """Play one episode of `env` with `engine` and return its Trajectory (never raises for env,
    sandbox or engine failures: they come back as `infra_error`).

    seed: the task (`env.areset(seed=seed, options=reset_options)`); sample_seed: the sampling draws
    (default `seed`)."""
    t0 = time.perf_counter()
    b = _Builder()
    draw = int(seed if sample_seed is None else sample_seed)
    meta: dict[str, Any] = {
        "seed": int(seed),
        "policy_version": int(engine.weight_version),
        "env_id": getattr(env, "env_id", type(env).__name__),
        "tokenizer": codec.fingerprint,
        **(metadata or {}),
    }
    step_infos: list[StepInfo] = []
    finish_reasons: list[str] = []
    outcome, terminated, truncated, infra, source = None, False, False, None, None
    stop_ids, stop_strs = codec.stops(cfg.stop_on_tool_call)
    session: Session | None = None
    try:
        try:
            messages, info = await env.areset(seed=seed, options=reset_options)
            meta["task_id"] = info.get("task_id")
            messages = codec.prepare(_encodable(messages))
            enc = codec.encode_prompt(messages, env.tool_schemas())
            pending = [("prompt", enc.ids, enc.images)]
            convo = codec.for_record(messages)  # the decoded conversation, for rewards (rewards/text.py)
            meta.update(messages=convo, n_prompt_messages=len(convo))
        except (Exception, SystemExit) as e:
            infra, source = f"env.reset: {_err(e)}", _source(e)
            raise _EpisodeOver from e
        turn = 0
        while True:
            n_pending = sum(len(ids) for _, ids, _ in pending)
            budget = cfg.max_episode_tokens - len(b) - n_pending
            if budget <= 0 or (cfg.max_turns is not None and turn >= cfg.max_turns):
                truncated = True
                meta["truncation"] = "token_budget" if budget <= 0 else "max_turns"
                break
            params = SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                max_new_tokens=min(cfg.max_new_tokens, budget),
                stop_token_ids=stop_ids,
                stop_strings=stop_strs,
                seed=hash((draw, turn)) & 0x7FFFFFFF,
            )
            prompt_ids = [t for _, ids, _ in pending for t in ids]
            images, offset = [], 0
            for _, ids, imgs in pending:
                images += [(offset + o, img) for o, img in imgs]
                offset += len(ids)
            try:
                res = await engine.agenerate(
                    GenerationRequest(prompt_ids, params, session, request_id=f"{draw}:{turn}", images=images)
                )
            except (Exception, SystemExit) as e:  # engine failure: the pending tokens were never seen
                infra, source = f"engine: {_err(e)}", "engine"
                break
            session = res.session
            for (role, ids, imgs), r in zip(
                pending, _split_routing(res.prompt_routed_experts, [len(ids) for _, ids, _ in pending])
            ):
                b.add(role, ids, routed=r, images=imgs)
            pending = []
            versions = list(getattr(res, "token_versions", None) or [res.weight_version] * len(res.token_ids))
            b.add(
                "assistant",
                res.token_ids,
                logprobs=res.logprobs,
                routed=res.routed_experts,
                versions=versions,
            )
            finish_reasons.append(res.finish_reason)
            turn += 1
            gen = list(res.token_ids)
            ended_turn = bool(gen) and gen[-1] == codec.eot_id
            stopped = bool(gen) and gen[-1] in codec.stop_ids  # end-of-turn or EOS: not part of the text
            text = codec.decode(gen[:-1] if stopped else gen)
            convo.append({"role": "assistant", "content": text})
            try:
                obs, reward, terminated, truncated, info = await env.astep(text)
                step = _step_info(info, reward)  # a malformed info is the env's fault: an infra error
            except (Exception, SystemExit) as e:
                infra, source = f"env.step: {_err(e)}", _source(e)
                step_infos.append(StepInfo(infra_error=infra))
                break
            step_infos.append(step)
            if step.infra_error:
                infra, source = step.infra_error, "sandbox"
                break
            if terminated:
                s = info.get("success")
                outcome = float(s) if s is not None else float(reward)
                break
            if truncated:
                meta["truncation"] = "env"
                break
            if not ended_turn:
                pending.append(("assistant", [codec.eot_id], []))  # close the turn as the template does
            try:
                obs = codec.prepare(_encodable(obs))
                enc = codec.encode_observation(obs)
                pending.append(("observation", enc.ids, enc.images))
                convo.extend(codec.for_record(obs))
            except Exception as e:  # the env returned messages that are not chat messages
                infra, source = f"env observation: {_err(e)}", "env"
                break
    except _EpisodeOver:
        pass
    except (Exception, SystemExit) as e:  # anything unexpected: still a marked, stored trajectory
        infra, source = infra or f"{type(e).__name__} in episode: {_err(e)}", source or "env"
    finally:
        if session is not None:
            engine.release(session)
        try:
            await env.aclose()
        except (Exception, SystemExit) as e:  # a failing close must not lose the episode
            meta["close_error"] = _err(e)
    if infra is not None:
        meta["infra_source"] = source
    meta.update(
        finish_reasons=finish_reasons,
        n_turns=len(finish_reasons),
        wall_s=round(time.perf_counter() - t0, 4),
        policy_version_end=int(engine.weight_version),
    )
    return Trajectory(
        tokens=np.asarray(b.tokens, dtype=np.int32),
        loss_mask=np.asarray(b.mask, dtype=np.uint8),
        rollout_logprobs=np.asarray(b.logprobs, dtype=np.float32),
        routed_experts=b.routed_array(),
        turns=b.turns,
        step_infos=step_infos,
        outcome=outcome if infra is None else None,
        terminated=bool(terminated) or infra is not None,
        truncated=bool(truncated) and infra is None,
        infra_error=infra,
        metadata=meta,
        token_versions=np.asarray(b.versions, dtype=np.int32),
        images=b.images,
        image_spans=b.image_spans,
    )
