"""`vision-arith`: arithmetic whose expression exists only in an image a tool returns.

    env = envs.make("vision-arith", difficulty=0)   # "Compute the value of the expression shown in ..."
    tools: look() -> the expression as a PNG, calc(expression) -> value, answer(value) -> ends the episode

The task text never contains the expression (envs/tasks/vision_arith.py): a policy that does not read the
image cannot do better than guessing. `look` renders the expression with `envs/sandbox_scripts/glyphs.py`:
in the sandbox (`python3 -c` writes /work/problem.png, read back with `Sandbox.aread_file`) or, with
`use_sandbox=False`, in-process (the same code, the same bytes; tests/test_vision_env.py compares them).
Either way the PNG goes through the `ToolResult` image checks (envs/tool_result.py) like any tool image.
`blank_images=True` makes `look` return a white image of the same size (the ablation a learning proof
compares against). `calc` and `answer` are arith's (envs/arith.py: calc in the sandbox or in-process,
sub-goals step1..stepN decided on the host).
"""

from __future__ import annotations

from typing import Any, ClassVar

from envs.arith import ArithEnv
from envs.sandbox_scripts import script_source
from envs.tasks import vision_arith as vision_arith_tasks
from envs.tool_result import ToolResult
from envs.tools import tool

PNG_PATH = "/work/problem.png"


class VisionArithEnv(ArithEnv):
    """Args: difficulty (0-3, arith's levels), config (VisionArithConfig overrides: arith's fields, cols,
    cell), use_sandbox (render and calc in the sandbox; default True), blank_images (look returns a blank
    image of the same size), calc_timeout_s, and the ToolEnv arguments."""

    tasks = vision_arith_tasks
    env_id = "vision-arith"
    observes_images: ClassVar[bool] = True
    default_max_turns = 8
    instructions = (
        "Solve the arithmetic task. Call look to see the expression, use calc to compute, then give the "
        "result with answer."
    )

    def __init__(
        self,
        difficulty: int = 0,
        config: dict[str, Any] | None = None,
        use_sandbox: bool = True,
        blank_images: bool = False,
        calc_timeout_s: float = 5.0,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(
            difficulty,
            config,
            use_sandbox,
            calc_timeout_s,
            max_turns=max_turns,
            sandbox_pool=sandbox_pool,
            tools_in_prompt=tools_in_prompt,
        )
        self.blank_images = bool(blank_images)
        self._render_script = script_source("glyphs")

    async def render(self) -> bytes:
        """The PNG `look` shows: rendered in the sandbox, or in-process with `use_sandbox=False`."""
        task = self.task
        if self.blank_images or not self.uses_sandbox:
            return task.image(blank=self.blank_images)
        from sandbox.errors import SandboxError

        cmd = ["python3", "-c", self._render_script, PNG_PATH, str(task.cols), str(task.cell)]
        res = await self.sandbox.aexec(cmd, timeout_s=30, stdin=task.expression.encode())
        if res.exit_code != 0 or res.timed_out:  # our own script on our own text: not the agent's fault
            raise SandboxError(f"vision-arith could not render its image in the sandbox: {res.stderr[-300:]}")
        try:
            return await self.sandbox.aread_file(PNG_PATH, max_bytes=self.image_limits.max_bytes)
        except OSError as e:
            raise SandboxError(f"vision-arith could not read back its image: {e}") from None

    @tool
    async def look(self) -> ToolResult:
        """Show the image of the expression to compute."""
        return ToolResult("The expression:", [await self.render()])
