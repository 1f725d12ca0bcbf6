"""`CalcOracleEngine`: a scripted arith policy behind the InferenceEngine protocol, for sandbox tests and
`bench/rollout.py` (it measures the agent loop + Docker without model cost).

Turn 1 calls `calc` on the task's expression; turn 2 answers calc's result, read back from the
observation tokens. It is a test double: the real engines are in rl/rollout/engine.py.
"""

from __future__ import annotations

import json
import re

from rl.rollout.engine import GenerationResult, Session


class CalcOracleEngine:
    weight_version = 0

    def __init__(self) -> None:
        self.stats: dict = {}
        self._codec = None

    @property
    def codec(self):
        if self._codec is None:  # built lazily: the engine is pickled into Ray actors
            from model.tokenizer import load_tokenizer
            from rl.rollout.agent_loop import ChatCodec

            self._codec = ChatCodec(load_tokenizer())
        return self._codec

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_codec": None}

    async def agenerate(self, req) -> GenerationResult:
        seen = self.codec.decode(list(req.prompt_ids))
        if req.session is None:
            expr = re.search(r"Compute (.+)\.<\|im_end\|>", seen).group(1)
            call = {"name": "calc", "arguments": {"expression": expr}}
        else:
            value = re.search(r"<tool_response>(.*?)</tool_response>", seen, re.S).group(1)
            call = {"name": "answer", "arguments": {"value": json.loads(value)}}
        ids = self.codec.tok.encode(f"<tool_call>{json.dumps(call)}</tool_call>", add_special_tokens=False)
        return GenerationResult(
            req.request_id,
            ids,
            [-1.0] * len(ids),
            "stop_token",
            None,
            None,
            req.session or Session(),
            0,
            len(req.prompt_ids),
        )

    def release(self, session) -> None:
        pass
