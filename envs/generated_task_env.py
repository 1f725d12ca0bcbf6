"""`GeneratedTaskEnv`: a ToolEnv whose tasks come from a generator module in `envs/tasks/`.

A task module provides `resolve_config(difficulty, overrides) -> Config`, `generate(seed, config) -> Task`
and `oracle_actions(task) -> list[str]` (the scripted perfect policy). This class wires those three into
ToolEnv's hooks, so a built-in env only declares its tools and sandbox setup.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

from envs.base import ToolEnv


class GeneratedTaskEnv(ToolEnv):
    """ToolEnv + a seeded task generator with difficulty presets (`tasks`: the generator module)."""

    tasks: ClassVar[ModuleType]

    def __init__(
        self,
        difficulty: int = 0,
        config: dict[str, Any] | None = None,
        **tool_env_kwargs: Any,
    ) -> None:
        super().__init__(**tool_env_kwargs)  # max_turns, sandbox_pool, tools_in_prompt, demonstrations
        self.tasks.resolve_config(difficulty, config)  # fail fast on bad settings
        self.difficulty, self.config_overrides = difficulty, dict(config or {})

    def task_config(self, options: dict[str, Any]) -> Any:
        """The config for one episode: `options["difficulty"]` (a curriculum) overrides the env's own."""
        difficulty = int(options.get("difficulty", self.difficulty))
        return self.tasks.resolve_config(difficulty, self.config_overrides)

    def generate_task(self, seed: int, options: dict[str, Any]) -> Any:
        return self.tasks.generate(seed, self.task_config(options))

    def oracle_actions(self) -> list[str]:
        """The scripted perfect policy's turns for the current task."""
        return self.tasks.oracle_actions(self.task)
