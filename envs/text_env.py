"""`TextEnv`: a ToolEnv whose action is the turn's whole text: no tools, no tool-call protocol.

    class MyQA(TextEnv):
        def generate_task(self, seed, options): ...          # or task_from_row(self, row)
        async def respond(self, text) -> TextReply:           # what the env answers to one turn
            return TextReply(observations=[], reward=1.0, done=True)

Each step hands the turn's text to `respond` and turns its `TextReply` into the gymnasium step: the
observations, the reward (`info["env_reward"]`), `terminated = done` (with `info["success"]`: the reply's
success, or its reward), `truncated` once `max_turns` turns have passed without `done`. Keys of
`TextReply.info` go to the step info as extra keys. An exception from `respond` propagates: the agent loop
records it as the env's own failure (an infra error), never as the policy's.

Everything else (reset, seeds, dataset rows through `task_from_row`, the sync and async APIs, max_turns)
is ToolEnv's. Used by dataset-qa (envs/dataset_qa.py) and the reasoning-gym and SkyRL-gym adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.base import Message, ToolEnv
from envs.trajectory import StepInfo


@dataclass
class TextReply:
    """What a TextEnv answers to one turn. success: the episode's score when done (None = the reward)."""

    observations: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    success: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(ToolEnv):
    """ToolEnv without tools: subclasses implement `respond(text)` and `generate_task` / `task_from_row`."""

    instructions = "Answer the user."

    def system_prompt(self) -> str:
        return self.instructions.strip()

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def __init__(self, **kwargs: Any) -> None:
        if type(self).respond is TextEnv.respond:
            raise TypeError(f"{type(self).__name__} must implement async respond(self, text) -> TextReply")
        super().__init__(**kwargs)

    async def respond(self, text: str) -> TextReply:
        """The env's answer to one assistant turn (its whole text). Every subclass overrides it (checked in
        `__init__`)."""
        raise TypeError(f"{type(self).__name__} must implement async respond(self, text) -> TextReply")

    async def _step(self, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        self._begin_turn(text)
        reply = await self.respond(text)
        info = StepInfo(turn=self._turn, env_reward=reply.reward, extra=dict(reply.info))
        terminated = bool(reply.done)
        if terminated:
            info.success = reply.reward if reply.success is None else reply.success
        truncated = not terminated and self._turn >= self.max_turns
        self._over = terminated or truncated
        return list(reply.observations), float(reply.reward), terminated, truncated, info.to_dict()
