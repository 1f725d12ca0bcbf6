"""`agent`: episodes played by your own agent code, which talks to the policy through an OpenAI-compatible
endpoint (rl/rollout/endpoint.py); a verifier scores what the agent returns.

    env:
      id: agent
      dataset: examples/openai_agent/tasks.jsonl            # rows: prompt, answer (+ any columns)
      kwargs:
        agent: examples.openai_agent.agent:solve             # def solve(client, task) -> result
        verifier: exact-match                                 # or math-verify, or pkg.module:fn

Your function is called once per episode, on a thread of its own (envs/threads.py), with an
`openai.OpenAI` client whose `base_url` and `api_key` reach this episode only, and the task: a dict with
`task_id`, `prompt` and the row's other columns (never the answer column). It returns the episode's
result (anything `str()` can show); the verifier scores `str(result)` against the row's answer, and that
score is the outcome.
Tasks come from `env.dataset` rows, or from `tasks: pkg.module:fn` (`fn(seed) -> {"prompt": ...,
"answer": ...}`).

The policy is an adversary, and it writes what your agent reads: an agent that raises (say, on model
output it did not expect) or runs past `agent_timeout_s` has failed its task. The episode is scored as a
failure (outcome 0) and says why in `metadata["agent_error"]`, never dropped from scoring; only a failure
of the engine or of this env's own code is an infrastructure error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.base import ToolEnv
from envs.dataset import DatasetRow, TaskDataset
from envs.dotted import resolve_name
from envs.verifiers import DEFAULT_TIMEOUT_S, make_verifier


@dataclass(frozen=True)
class AgentTask:
    """One task: what the agent sees (`for_agent`) and the ground truth the verifier checks."""

    task_id: str
    prompt: Any
    answer: Any
    columns: dict[str, Any] = field(hash=False, compare=False)
    answer_field: str = "answer"

    @property
    def for_agent(self) -> dict[str, Any]:
        shown = {k: v for k, v in self.columns.items() if k != self.answer_field}
        return {**shown, "task_id": self.task_id, "prompt": self.prompt}


def _callable(spec: str | Callable[..., Any], what: str) -> Callable[..., Any]:
    fn = resolve_name(spec, what=what) if isinstance(spec, str) else spec
    if not callable(fn):
        raise TypeError(f"env.kwargs.{what} must name a function (pkg.module:fn), got {spec!r}")
    return fn


class AgentEnv(ToolEnv):
    """Episodes driven by `agent(client, task) -> result` (see the module docstring). Args: agent (a
    function or "pkg.module:fn"), verifier ("exact-match" | "math-verify" | "pkg.module:fn"), tasks
    (optional "pkg.module:fn", seed -> task dict, when there is no dataset), agent_timeout_s, and the
    ToolEnv arguments (accepted for the worker's sake; the agent owns its tools)."""

    env_id = "agent"
    instructions = ""

    def __init__(
        self,
        agent: str | Callable[..., Any] = "",
        verifier: str = "exact-match",
        tasks: str | Callable[[int], dict] | None = None,
        agent_timeout_s: float = 300.0,
        verifier_timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(max_turns=max_turns, sandbox_pool=sandbox_pool, tools_in_prompt=tools_in_prompt)
        if not agent:
            raise ValueError(
                "the agent env needs your agent function: env.kwargs.agent: pkg.module:fn, where "
                "fn(client, task) -> result (client: an openai.OpenAI for this episode)"
            )
        self.agent = _callable(agent, "agent")
        params = [p for p in inspect.signature(self.agent).parameters.values() if p.default is p.empty]
        if inspect.iscoroutinefunction(self.agent) or len(params) != 2:
            raise TypeError(
                f"env.kwargs.agent {agent!r} must be a plain function of two arguments, (client, task) -> "
                "result; it runs on a thread of its own with a synchronous openai.OpenAI client"
            )
        self.tasks = _callable(tasks, "tasks") if tasks is not None else None
        if agent_timeout_s <= 0:
            raise ValueError(f"agent_timeout_s must be > 0 seconds, got {agent_timeout_s}")
        self.agent_timeout_s = float(agent_timeout_s)
        self.verifier = make_verifier(verifier, verifier_timeout_s)

    @classmethod
    def dataset_problems(cls, data: TaskDataset | None) -> list[str]:
        if data is None:
            return []  # tasks from env.kwargs.tasks (checked when the env is built)
        missing = [i for i, r in enumerate(data.rows) if r.get(data.answer_field) is None]
        if missing:
            return [
                f"the agent env scores results against column {data.answer_field!r}, missing in "
                f"{len(missing)} rows (first: row {missing[0]}); set env.dataset.answer_field"
            ]
        return []

    def generate_task(self, seed: int, options: dict[str, Any]) -> AgentTask:
        if self.tasks is None:
            raise ValueError(
                "the agent env has no tasks: set env.dataset (rows with prompt and answer) or "
                "env.kwargs.tasks: pkg.module:fn (seed -> {'prompt': ..., 'answer': ...})"
            )
        task = self.tasks(seed)
        if not isinstance(task, dict) or "prompt" not in task or "answer" not in task:
            raise TypeError(f"env.kwargs.tasks must return a dict with 'prompt' and 'answer', got {task!r}")
        return AgentTask(f"seed-{seed}", task["prompt"], task["answer"], dict(task))

    def task_from_row(self, row: DatasetRow) -> AgentTask:
        return AgentTask(
            f"row-{row.index}", row.prompt, row.require_answer("agent"), row.columns, row.answer_field
        )

    async def score(self, result: Any) -> float:
        """The verifier's score of `str(result)` against the task's answer (None, and a result `str()`
        cannot show, such as an integer of more than 4300 digits, score 0)."""
        if result is None:
            return 0.0
        try:
            text = str(result)
        except Exception:  # the agent's result, shaped by the policy: a failed answer, not the env's error
            return 0.0
        return float((await self.verifier.averify(text, self.task.answer, self.task.columns)).score)
