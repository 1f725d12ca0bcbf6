"""`word-count`: tell how many words a sentence has.

A complete Odyssey env in one file: a deterministic task generator, two tools, a sub-goal, and an
optional sandbox (the `wc` tool runs `wc -w` in a Docker sandbox when `use_sandbox=True`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs import ToolEnv, ToolError, tool
from envs.tool_call import format_tool_call

WORDS = "the a quick lazy brown dog fox jumps over under river stone bright small old tree".split()


@dataclass(frozen=True)
class WordCountTask:
    task_id: str  # required by ToolEnv: identifies the task (same task -> same id)
    prompt: str  # required by ToolEnv: the user message that starts the episode
    sentence: str
    count: int


class WordCountEnv(ToolEnv):
    """Count the words of a sentence. Args: max_words (sentence length up to this), use_sandbox
    (run `wc -w` in a sandbox instead of Python), and the ToolEnv arguments (max_turns, sandbox_pool)."""

    env_id = "word-count"
    default_max_turns = 4
    instructions = "Count the words of the sentence with the wc tool, then give the number with answer."

    def __init__(self, max_words: int = 8, use_sandbox: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1, got {max_words}")
        self.max_words = max_words
        self.uses_sandbox = use_sandbox  # True: reset() leases a sandbox, available as self.sandbox

    def generate_task(self, seed: int, options: dict[str, Any]) -> WordCountTask:
        rng = np.random.default_rng(seed)  # everything random comes from the seed
        n = int(rng.integers(1, self.max_words + 1))
        sentence = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))
        return WordCountTask(f"word-count/{sentence}", f"Sentence: {sentence}", sentence, n)

    def oracle_actions(self) -> list[str]:
        """A scripted perfect policy (used by tests and SFT warm-up data)."""
        return [
            format_tool_call("wc", {"text": self.task.sentence}),  # <tool_call>{...}</tool_call>
            format_tool_call("answer", {"count": self.task.count}),
        ]

    @tool
    async def wc(self, text: str) -> str:
        """Count the words of a text.

        Args:
            text: the text to count.
        """
        if self.uses_sandbox:
            res = await self.sandbox.aexec(["wc", "-w"], timeout_s=5, stdin=text.encode())
            if res.exit_code != 0:
                raise ToolError(f"wc failed: {res.stderr.strip()}")
            count = res.stdout.strip()
        else:
            count = str(len(text.split()))
        if text.strip() == self.task.sentence:
            self.achieve("counted")  # a sub-goal: credited once, at the step it happens
        return count

    @tool
    def answer(self, count: int) -> str:
        """Give the final word count; this ends the episode.

        Args:
            count: the number of words.
        """
        self.finish(1.0 if count == self.task.count else 0.0)
        return "correct" if count == self.task.count else "incorrect"
