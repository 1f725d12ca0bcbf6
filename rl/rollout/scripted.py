"""A scripted policy scored by the real model: `TeacherForcedEngine`.

Each assistant turn's text comes from a script (`policy(request) -> text`), and the wrapped engine appends it
as teacher-forced tokens (`GenerationRequest.forced_ids`, TorchEngine): the turn carries the model's own
log-probs and routed experts of tokens it did not choose, so the trajectory is what a rollout of that text
would have recorded, and a learner can train on it (R3 included). The agent loop, env, rewards and store
see an ordinary engine.

    engine = TeacherForcedEngine(TorchEngine(model), codec, policy)
    traj = await run_episode(engine, env, codec, cfg, seed=...)

This is how the million-token long-docs episode is produced (bench/million_token_episode.py): a reader that
reads page after page until the conversation passes the target length, then answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rl.rollout.agent_loop import ChatCodec
from rl.rollout.engine import GenerationRequest, GenerationResult, Session


class TeacherForcedEngine:
    """InferenceEngine whose turns are `policy(request)`'s text, forced through `engine` (a TorchEngine).

    The turn's tokens are the text's ids; when they do not already end in one of the request's stop tokens
    (e.g. `</tool_call>` with stop_on_tool_call), the end-of-turn token is appended, as a model closing its
    turn would. Everything else (weights, sessions, release) is the wrapped engine's, and so is every other
    attribute a caller reads (`__getattr__`): `config` (the rollout worker sizes a vision policy's images from
    it, rl.rollout.worker.policy_vision), `model_dir`, `stats`, `aclose`, `shutdown`.
    """

    def __init__(self, engine, codec: ChatCodec, policy: Callable[[GenerationRequest], str]) -> None:
        self.engine, self.codec, self.policy = engine, codec, policy

    def forced_ids(self, request: GenerationRequest) -> list[int]:
        ids = self.codec.turn_ids(self.policy(request))
        if not ids or ids[-1] not in request.sampling.stop_token_ids:
            ids.append(self.codec.eot_id)
        return ids

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return self.engine.generate([dataclasses.replace(r, forced_ids=self.forced_ids(r)) for r in requests])

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.agenerate(dataclasses.replace(request, forced_ids=self.forced_ids(request)))

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def release(self, session: Session) -> None:
        self.engine.release(session)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def __getattr__(self, name: str) -> Any:
        """Any attribute this class does not define is the wrapped engine's (AttributeError when it has
        none, so `hasattr(engine, "stats")` answers for the wrapped engine)."""
        if name == "engine":  # not yet set (unpickling, a half-built object): never recurse
            raise AttributeError(name)
        return getattr(self.engine, name)


def conversation_tokens(request: GenerationRequest) -> int:
    """Tokens the conversation will hold once `request`'s prompt is in (its session's + the new ones)."""
    return (request.session.num_tokens if request.session is not None else 0) + len(request.prompt_ids)
