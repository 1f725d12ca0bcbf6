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

Per token: loss_mask 1 and rollout_logprobs on sampled tokens (NaN elsewhere); routed_experts for
every fed token (prompt, observations and generated ones: R3 replays the whole sequence).

Failures never lose an episode: a SandboxError the env reports (info["infra_error"]), an exception
from env.reset/step or from the engine, all end the episode with `Trajectory.infra_error` set and
whatever tokens were completed kept (tokens the engine never processed are dropped, so the record
stays exactly what the model saw).
"""

from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl.rollout.engine import GenerationRequest, InferenceEngine, Session
from rl.rollout.sampling import SamplingParams
from rl.trajectory import StepInfo, Trajectory, TurnSpan


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
    stop tokens, decoding. The loop itself never touches template details."""

    def __init__(self, tokenizer: Any):
        from model import tokenizer as tk

        self.tok = tokenizer
        self._tk = tk
        self.eot_id = int(tk.end_of_turn_id(tokenizer))
        self.stop_ids = tuple(int(i) for i in tk.stop_token_ids(tokenizer) if i is not None)
        close = tokenizer.encode(tk.TOOL_CALL_END, add_special_tokens=False)
        self.tool_close_id = int(close[0]) if len(close) == 1 else None
        self.tool_close = tk.TOOL_CALL_END

    def render_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """ids(render(messages, tools, add_generation_prompt=True)), BOS included."""
        return [
            int(i)
            for i in self._tk.encode_chat(self.tok, messages, tools or None, add_generation_prompt=True)
        ]

    def continuation(self, messages: list[dict]) -> list[int]:
        """ids of `messages` right after an assistant END_OF_TURN, ending with the next generation prompt."""
        return [int(i) for i in self._tk.encode_continuation(self.tok, messages, add_generation_prompt=True)]

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


class _Builder:
    """Accumulates the trajectory's per-token arrays and turn spans."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.routed: list[np.ndarray | None] = []
        self.turns: list[TurnSpan] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self, role: str, ids: list[int], logprobs: list[float] | None = None, routed: np.ndarray | None = None
    ) -> None:
        if not ids:
            return
        start = len(self.tokens)
        self.tokens += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [math.nan] * len(ids)
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


async def run_episode(
    engine: InferenceEngine,
    env: Any,
    codec: ChatCodec,
    cfg: EpisodeConfig,
    *,
    seed: int,
    metadata: dict | None = None,
) -> Trajectory:
    """Play one episode of `env` with `engine` and return its Trajectory (never raises for env,
    sandbox or engine failures: they come back as `infra_error`)."""
    t0 = time.perf_counter()
    b = _Builder()
    meta: dict[str, Any] = {
        "seed": int(seed),
        "policy_version": int(engine.weight_version),
        "env_id": getattr(env, "env_id", type(env).__name__),
        **(metadata or {}),
    }
    step_infos: list[StepInfo] = []
    finish_reasons: list[str] = []
    outcome, terminated, truncated, infra = None, False, False, None
    stop_ids, stop_strs = codec.stops(cfg.stop_on_tool_call)
    session: Session | None = None
    try:
        messages, info = await env.areset(seed=seed)
        meta["task_id"] = info.get("task_id")
        pending = [("prompt", codec.render_prompt(messages, env.tool_schemas()))]
        turn = 0
        while True:
            n_pending = sum(len(ids) for _, ids in pending)
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
                seed=hash((int(seed), turn)) & 0x7FFFFFFF,
            )
            prompt_ids = [t for _, ids in pending for t in ids]
            try:
                res = await engine.agenerate(
                    GenerationRequest(prompt_ids, params, session, request_id=f"{seed}:{turn}")
                )
            except Exception as e:  # engine failure: the pending tokens were never seen
                infra = f"engine: {_err(e)}"
                break
            session = res.session
            for (role, ids), r in zip(
                pending, _split_routing(res.prompt_routed_experts, [len(ids) for _, ids in pending])
            ):
                b.add(role, ids, routed=r)
            pending = []
            b.add("assistant", res.token_ids, logprobs=res.logprobs, routed=res.routed_experts)
            finish_reasons.append(res.finish_reason)
            turn += 1
            gen = list(res.token_ids)
            ended_turn = bool(gen) and gen[-1] == codec.eot_id
            stopped = bool(gen) and gen[-1] in codec.stop_ids  # end-of-turn or EOS: not part of the text
            text = codec.decode(gen[:-1] if stopped else gen)
            try:
                obs, reward, terminated, truncated, info = await env.astep(text)
                step = _step_info(info, reward)  # a malformed info is the env's fault: an infra error
            except Exception as e:
                infra = f"env.step: {_err(e)}"
                step_infos.append(StepInfo(infra_error=infra))
                break
            step_infos.append(step)
            if step.infra_error:
                infra = step.infra_error
                break
            if terminated:
                s = info.get("success")
                outcome = float(s) if s is not None else float(reward)
                break
            if truncated:
                meta["truncation"] = "env"
                break
            if not ended_turn:
                pending.append(("assistant", [codec.eot_id]))  # close the turn as the template does
            pending.append(("observation", codec.continuation(obs)))
    except Exception as e:  # env.reset or anything unexpected: a marked, stored trajectory
        infra = infra or f"{type(e).__name__} in episode: {_err(e)}"
    finally:
        if session is not None:
            engine.release(session)
        try:
            await env.aclose()
        except Exception as e:  # a failing close must not lose the episode
            meta["close_error"] = _err(e)
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
    )
