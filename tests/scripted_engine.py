"""`ScriptedEngine`: an InferenceEngine that "generates" given texts, for agent-loop tests (a test double:
the real engines are in rl/rollout/engine.py)."""

from __future__ import annotations

import asyncio

from rl.rollout.agent_loop import ChatCodec
from rl.rollout.engine import GenerationResult, Session


class ScriptedEngine:
    """InferenceEngine that 'generates' scripted texts (a turn ending in </tool_call> stops on that token,
    like the real engine; other turns end with END_OF_TURN). Records every prompt it was sent."""

    def __init__(self, codec: ChatCodec, turns, fail_on_turn: int | None = None):
        self.codec, self.turns, self.fail_on_turn = codec, turns, fail_on_turn
        self.prompts: list[list[int]] = []
        self.weight_version = 0
        self.released = 0

    async def agenerate(self, req):
        turn = len(self.prompts)
        self.prompts.append(list(req.prompt_ids))
        if turn == self.fail_on_turn:
            raise RuntimeError("engine exploded")
        turns = self.turns() if callable(self.turns) else self.turns
        text = turns[turn] if turn < len(turns) else "I am done."
        ids = self.codec.tok.encode(text, add_special_tokens=False)
        stop = text.endswith(self.codec.tool_close)
        if not stop:
            ids = ids + [self.codec.eot_id]
        return GenerationResult(
            req.request_id,
            ids,
            [-0.5] * len(ids),
            "stop_token",
            None,
            None,
            req.session or Session(),
            0,
            len(req.prompt_ids),
        )

    def generate(self, requests):
        return [asyncio.run(self.agenerate(r)) for r in requests]

    def update_weights(self, state_dict, version):
        self.weight_version = version

    def release(self, session):
        self.released += 1
