"""One episode of an `agent` env (envs/agent_env.py): the user's agent function drives the policy through
the OpenAI-compatible endpoint, and the recorder's segments become the episode's trajectory.

    traj = await run_agent_episode(engine, env, codec, cfg, endpoint, seed=7, sample_seed=8)

The agent runs on a thread of its own (envs/threads.py: never the engine's, never a pool other code waits
on) with its own `openai.OpenAI` client (this episode's base_url and key, no retries, a per-request
timeout) while the endpoint serves its requests on this event loop. When it returns, raises or runs out
of time the key is closed (later requests get 401), the result is scored by the env's verifier, and the
segments are assembled (rl/rollout/agent_recorder.py).

Who failed: an agent that raises or hangs failed its task (outcome 0, `metadata["agent_error"]`; the
policy writes what the agent reads, so it could crash it on purpose); the engine failing, or the env's
own code (task generation, the verifier), is an infrastructure error (`infra_error`, not scored); so is
an agent not started because too many earlier ones are still hung (envs/threads.py bounds them).

Segments: when the agent rewrote its history, the trajectory holds every segment one after another and
`metadata["segment_starts"]` says where each later one begins (`context_replaced_at`: at which request);
the learner restarts the context at each start, so every segment is trained as it was sampled.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from envs.threads import HungThreadsError, OwnThreadTimeout, run_in_own_thread
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig
from rl.rollout.agent_recorder import EpisodeRecorder
from rl.rollout.endpoint import PolicyEndpoint
from rl.rollout.engine import InferenceEngine
from rl.trajectory import Trajectory


def _short(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip()[:2000]


async def run_agent_episode(
    engine: InferenceEngine,
    env: Any,
    codec: ChatCodec,
    cfg: EpisodeConfig,
    endpoint: PolicyEndpoint,
    *,
    seed: int,
    sample_seed: int | None = None,
    reset_options: dict | None = None,
    metadata: dict | None = None,
) -> Trajectory:
    """Play one episode of the agent env `env`; never raises for agent, engine or env failures."""
    import openai

    t0 = time.perf_counter()
    draw = int(seed if sample_seed is None else sample_seed)
    meta: dict[str, Any] = {
        "seed": int(seed),
        "policy_version": int(engine.weight_version),
        "env_id": getattr(env, "env_id", "agent"),
        "tokenizer": codec.fingerprint,
        **(metadata or {}),
    }
    rec = EpisodeRecorder(engine, codec, cfg, draw)
    outcome: float | None = None
    infra, source = None, None
    try:
        _, info = await env.areset(seed=seed, options=reset_options)
        meta["task_id"] = info.get("task_id")
    except Exception as e:
        infra, source = f"env.reset: {_short(e)}", "env"
    if infra is None:
        handle = endpoint.open(rec)
        client = openai.OpenAI(
            base_url=handle.base_url, api_key=handle.api_key, max_retries=0, timeout=env.agent_timeout_s
        )
        task = env.task.for_agent
        result, agent_error, returned = None, None, False
        try:  # on a thread of its own (envs/threads.py): never the engine's, never shared with other agents
            result = await run_in_own_thread(
                env.agent, client, task, timeout_s=env.agent_timeout_s, what="agent"
            )
            returned = True
        except OwnThreadTimeout:  # its thread is abandoned (Python cannot kill it) and counted as hung
            agent_error = f"the agent ran past agent_timeout_s={env.agent_timeout_s:g} s"
        except HungThreadsError as e:  # too many earlier agents still hung: this one was never started
            infra, source, returned = f"agent not started: {e}", "env", True
        except Exception as e:  # the agent's own failure (perhaps provoked by the policy): scored
            agent_error, returned = f"the agent raised {_short(e)}", True
        finally:
            endpoint.close(handle)  # a straggling agent thread gets 401 from now on
            client.close() if returned else None
        meta["agent_result"] = None if result is None else _shown(result)
        if agent_error is not None:
            meta["agent_error"] = agent_error
        if rec.infra_error is not None:
            infra, source = rec.infra_error, "engine"
        elif agent_error is not None:
            outcome = 0.0
        elif infra is None:
            try:
                outcome = await env.score(result)
            except Exception as e:  # the verifier's (the env's) failure
                infra, source = f"env.score: {_short(e)}", "env"
    rec.close()
    try:
        await env.aclose()
    except Exception as e:
        meta["close_error"] = _short(e)
    if infra is not None:
        meta["infra_source"] = source
    meta["wall_s"] = round(time.perf_counter() - t0, 4)
    traj = rec.episode_trajectory(outcome, meta)
    if traj is None:  # no turn was generated (the agent never called, or failed first)
        return _empty(infra, outcome, rec, meta)
    return traj


def _empty(infra: str | None, outcome: float | None, rec: EpisodeRecorder, meta: dict) -> Trajectory:
    """The record of an episode in which the policy generated nothing: no tokens to train, still scored
    (0 unless the verifier said otherwise) or marked, so that the sample is accounted for."""
    meta = {**meta, "n_segments": 0, "requests": rec.requests, "n_turns": 0}
    return Trajectory.empty(meta, infra, 0.0 if outcome is None else outcome)


def _shown(result: object) -> str:
    """At most 10,000 characters of `str(result)` for the record; a result that cannot be shown (str()
    raising, e.g. an int past Python's 4300-digit limit) is recorded as such: the verifier scores it."""
    try:
        return str(result)[:10_000]
    except Exception as e:  # noqa: BLE001 - the agent's value, not our failure
        return f"<unprintable {type(result).__name__}: {_short(e)}>"
