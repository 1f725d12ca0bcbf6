"""`arith`: multi-step arithmetic with a calculator that runs in the sandbox.

    env = envs.make("arith", difficulty=1)     # "Compute (3+4)*2."
    tools: calc(expression) -> value, answer(value) -> ends the episode (success 1.0 / 0.0)

Sub-goals are the intermediate results `step1..stepN` (stepN is the answer): one is achieved when a
calc result (or a correct answer) equals it, earliest unachieved step first. Both are decided on the host:
the calc result for crediting is the expression's value computed by the env itself, not the sandbox output.
`calc` runs `envs/sandbox_scripts/calc.py` with `python3` in the sandbox: it walks the expression's AST and
allows only numbers and arithmetic operators, so nothing the model writes is run as code. With
`use_sandbox=False` the same evaluator runs in-process (for Docker-free smoke runs and SFT data).
"""

from __future__ import annotations

import math
from typing import Any

from envs.generated_task_env import GeneratedTaskEnv
from envs.sandbox_scripts import calc as calc_script
from envs.sandbox_scripts import script_source
from envs.tasks import arith as arith_tasks
from envs.tools import ToolError, tool


class ArithEnv(GeneratedTaskEnv):
    """Multi-step arithmetic. Args: difficulty (0-3, see envs.tasks.arith.DIFFICULTIES), config
    (ArithConfig field overrides), use_sandbox (run calc in the sandbox; default True), calc_timeout_s,
    instructions (the system message's first paragraph; default the class's), and the ToolEnv arguments
    (max_turns, sandbox_pool, ...)."""

    tasks = arith_tasks
    env_id = "arith"
    uses_sandbox = True
    default_max_turns = 8
    instructions = "Solve the arithmetic task. Use calc to compute, then give the result with answer."

    def __init__(
        self,
        difficulty: int = 0,
        config: dict[str, Any] | None = None,
        use_sandbox: bool = True,
        calc_timeout_s: float = 5.0,
        instructions: str | None = None,
        **tool_env_kwargs: Any,
    ) -> None:
        super().__init__(difficulty, config, **tool_env_kwargs)
        self.uses_sandbox = use_sandbox
        if instructions is not None:
            self.instructions = instructions
        self.calc_timeout_s = calc_timeout_s
        self._script = script_source("calc")

    def _credit(self, value: float) -> None:
        for i, target in enumerate(self.task.intermediates):
            name = f"step{i + 1}"
            if name not in self.achieved_subgoals and math.isclose(value, target, rel_tol=0, abs_tol=1e-9):
                self.achieve(name)
                return

    @tool
    async def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

        Args:
            expression: the expression, e.g. "(3+4)*2".
        """
        if not self.uses_sandbox:
            try:
                value = calc_script.evaluate(expression)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except (ValueError, OverflowError, TypeError, RecursionError) as err:
                raise ToolError(str(err)) from None
            text = str(value)
        else:
            res = await self.sandbox.aexec(
                ["python3", "-c", self._script], timeout_s=self.calc_timeout_s, stdin=expression.encode()
            )
            if res.timed_out:
                raise ToolError(f"calc timed out after {self.calc_timeout_s:g} s")
            text = res.stdout.strip()
            if res.exit_code != 0:
                raise ToolError(text.removeprefix("error: ") or f"calc failed: {res.stderr.strip()[-300:]}")
        # Sub-goal credit is decided here, from the expression's value computed by this process, never from
        # the sandbox's output (docs/envs.md, "Verifying safely").
        try:
            self._credit(float(calc_script.evaluate(expression)))
        except (ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
            pass
        return text

    @tool
    def answer(self, value: float) -> str:
        """Submit the final result; this ends the episode.

        Args:
            value: the value of the whole expression.
        """
        correct = math.isclose(value, self.task.answer, rel_tol=0, abs_tol=1e-6)
        if correct:
            self.achieve(f"step{len(self.task.intermediates)}")
        self.finish(1.0 if correct else 0.0)
        return "correct" if correct else "incorrect"
