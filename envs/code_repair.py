"""`code-repair`: fix a small buggy Python module so its tests pass, inside the sandbox.

    env = envs.make("code-repair", difficulty=1)    # 2 injected bugs
    tools: read_file(path), write_file(path, content), run_tests(), submit()

The module and its tests are written to the sandbox's /work at reset. `run_tests` runs
`envs/sandbox_scripts/run_tests.py` with python3 (no pytest in the image); the tests are fed from
the env on stdin, so only the module under repair matters (and only it may be written). Each test
that was failing and passes for the first time is a sub-goal `test:<name>`. The outcome is all
tests passing: `run_tests` ends the episode with success 1.0 as soon as every test passes
(`auto_finish=True`, the default), and `submit()` ends it with 1.0 if all pass, else 0.0.
"""

from __future__ import annotations

import secrets
from typing import Any

from envs.generated_task_env import GeneratedTaskEnv
from envs.sandbox_scripts import script_source
from envs.tasks import code_repair as code_repair_tasks
from envs.tools import ToolError, tool

WORKDIR = "/work"
MAX_FILE_CHARS = 100_000


class CodeRepairEnv(GeneratedTaskEnv):
    """Args: difficulty (0-2 = 1-3 bugs), config (CodeRepairConfig overrides: num_bugs, templates),
    auto_finish, test_timeout_s (per test), run_timeout_s (whole run), and the ToolEnv arguments."""

    tasks = code_repair_tasks
    env_id = "code-repair"
    uses_sandbox = True
    default_max_turns = 12
    instructions = (
        "You repair Python code. Read the module and its tests, fix the module with write_file "
        "(whole file content), and check with run_tests."
    )

    def __init__(
        self,
        difficulty: int = 0,
        config: dict[str, Any] | None = None,
        auto_finish: bool = True,
        test_timeout_s: int = 2,
        run_timeout_s: float = 20.0,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(
            difficulty,
            config,
            max_turns=max_turns,
            sandbox_pool=sandbox_pool,
            tools_in_prompt=tools_in_prompt,
        )
        self.auto_finish, self.test_timeout_s, self.run_timeout_s = auto_finish, test_timeout_s, run_timeout_s
        self._runner = script_source("run_tests")

    async def setup(self) -> None:
        task: code_repair_tasks.CodeRepairTask = self.task
        await self.sandbox.awrite_file(f"{WORKDIR}/{task.module_file}", task.buggy_source.encode())
        await self.sandbox.awrite_file(f"{WORKDIR}/{task.test_file}", task.template.tests.encode())

    def _name(self, path: str) -> str:
        name = path.strip().removeprefix(f"{WORKDIR}/").removeprefix("./")
        files = (self.task.module_file, self.task.test_file)
        if name not in files:
            raise ToolError(f"no file {path!r}; the files are {files[0]} and {files[1]}")
        return name

    async def run_suite(self) -> tuple[dict[str, bool], str]:
        """Run the tests in the sandbox: ({test: passed}, the report shown to the agent)."""
        task: code_repair_tasks.CodeRepairTask = self.task
        nonce = secrets.token_hex(8)
        names = task.template.test_names
        cmd = ["python3", "-c", self._runner, WORKDIR, task.test_file, str(self.test_timeout_s), *names]
        res = await self.sandbox.aexec(
            cmd, timeout_s=self.run_timeout_s, stdin=f"{nonce}\n{task.template.tests}".encode()
        )
        results: dict[str, bool] = {}
        report: list[str] = []
        other: list[str] = []
        for line in res.stdout.splitlines():
            if line.startswith(nonce + " "):
                body = line[len(nonce) + 1 :]
                kind, _, rest = body.partition(" ")
                if kind in ("PASS", "FAIL"):
                    results[rest.split(":", 1)[0]] = kind == "PASS"
                report.append(body)
            elif line.strip():
                other.append(line)
        if res.timed_out or not results:
            why = f"timed out after {self.run_timeout_s:g} s" if res.timed_out else "crashed"
            tail = (res.stderr.strip() or "\n".join(other))[-500:]
            return {n: False for n in names}, f"test run {why}; all tests count as failed.\n{tail}".strip()
        if other:
            report.append("output:\n" + "\n".join(other)[-1000:])
        return results, "\n".join(report)

    def _score(self, results: dict[str, bool]) -> bool:
        for name in self.task.failing_tests:
            if results.get(name):
                self.achieve(f"test:{name}")
        return bool(results) and all(results.values())

    @tool
    async def read_file(self, path: str) -> str:
        """Read a file of the task (the module or its tests).

        Args:
            path: file name, e.g. "stats.py".
        """
        data = await self.sandbox.aread_file(f"{WORKDIR}/{self._name(path)}")
        return data.decode("utf-8", errors="replace")

    @tool
    async def write_file(self, path: str, content: str) -> str:
        """Replace the whole content of the module under repair.

        Args:
            path: the module's file name.
            content: the complete new file content.
        """
        name = self._name(path)
        if name != self.task.module_file:
            raise ToolError(f"only {self.task.module_file} may be written; the tests are read-only")
        if len(content) > MAX_FILE_CHARS:
            raise ToolError(f"content is {len(content)} characters; the limit is {MAX_FILE_CHARS}")
        await self.sandbox.awrite_file(f"{WORKDIR}/{name}", content.encode())
        return f"wrote {len(content)} characters to {name}"

    @tool
    async def run_tests(self) -> str:
        """Run all tests and report each as PASS or FAIL."""
        results, report = await self.run_suite()
        if self._score(results) and self.auto_finish:
            self.finish(1.0)
        return report

    @tool
    async def submit(self) -> str:
        """Finish the episode: it succeeds if all tests pass."""
        results, report = await self.run_suite()
        ok = self._score(results)
        self.finish(1.0 if ok else 0.0)
        return report
