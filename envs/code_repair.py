"""`code-repair`: fix a small buggy Python module so its tests pass, inside the sandbox.

    env = envs.make("code-repair", difficulty=1)    # 2 injected bugs
    tools: read_file(path), write_file(path, content), run_tests(), submit()

The module and its tests are written to the sandbox's /work at reset; the test file is the spec the agent
reads. Tests are decided by trusted verification (envs/observations.py): every `run_tests` draws fresh
inputs for each test (`envs.tasks.code_repair.draw_checks`), the sandbox runs the agent's module on them
with `envs/sandbox_scripts/observe.py` and reports the values it observed, and the env compares them here
with the values of the correct module. Nothing printed, exited or patched in the sandbox can pass a test;
only computing the right values can. Each test that was failing and passes for the first time is a sub-goal
`test:<name>`. The outcome is all tests passing: `run_tests` ends the episode with success 1.0 as soon as
every test passes (`auto_finish=True`, the default), and `submit()` ends it with 1.0 if all pass, else 0.0.
"""

from __future__ import annotations

import json
from typing import Any

from envs.generated_task_env import GeneratedTaskEnv
from envs.observations import parse_observations, same, show
from envs.sandbox_scripts import script_source
from envs.tasks import code_repair as code_repair_tasks
from envs.tools import ToolError, tool

WORKDIR = "/work"
MAX_FILE_CHARS = 100_000
MAX_READ_BYTES = 4 * MAX_FILE_CHARS  # read_file refuses larger files (e.g. a symlink to /dev/zero)


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
        **tool_env_kwargs: Any,
    ) -> None:
        super().__init__(difficulty, config, **tool_env_kwargs)
        self.auto_finish, self.test_timeout_s, self.run_timeout_s = auto_finish, test_timeout_s, run_timeout_s
        self._runner = script_source("observe")
        self._runs = 0

    async def setup(self) -> None:
        task: code_repair_tasks.CodeRepairTask = self.task
        self._runs = 0
        await self.sandbox.awrite_file(f"{WORKDIR}/{task.module_file}", task.buggy_source.encode())
        await self.sandbox.awrite_file(f"{WORKDIR}/{task.test_file}", task.template.tests.encode())

    def _name(self, path: str) -> str:
        name = path.strip().removeprefix(f"{WORKDIR}/").removeprefix("./")
        files = (self.task.module_file, self.task.test_file)
        if name not in files:
            raise ToolError(f"no file {path!r}; the files are {files[0]} and {files[1]}")
        return name

    async def run_suite(self) -> tuple[dict[str, bool], str]:
        """Run this run's checks in the sandbox, decide here: ({test: passed}, the report for the agent)."""
        task: code_repair_tasks.CodeRepairTask = self.task
        checks = code_repair_tasks.draw_checks(task, self._runs)
        self._runs += 1
        cmd = ["python3", "-c", self._runner, WORKDIR, task.template.name, str(self.test_timeout_s)]
        payload = json.dumps([{"id": c.id, "code": c.code} for c in checks]).encode()
        res = await self.sandbox.aexec(cmd, timeout_s=self.run_timeout_s, stdin=payload)
        results, why, other = decide(checks, res.stdout)
        passed = sum(results.values())
        report = [f"PASS {n}" if results[n] else f"FAIL {n}: {why[n]}" for n in task.template.test_names]
        report.append(f"SUMMARY {passed} passed, {len(results) - passed} failed")
        if res.timed_out:
            report.append(f"the test run timed out after {self.run_timeout_s:g} s")
        if other:
            report.append("output:\n" + "\n".join(other)[-1000:])
        if res.stderr.strip():
            report.append("stderr:\n" + res.stderr.strip()[-500:])
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
        try:
            data = await self.sandbox.aread_file(f"{WORKDIR}/{self._name(path)}", max_bytes=MAX_READ_BYTES)
        except FileNotFoundError:
            raise ToolError(f"{path!r} does not exist (the module's code may have deleted it)") from None
        except OSError as err:
            raise ToolError(str(err)) from None
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


def decide(
    checks: list[code_repair_tasks.Check], stdout: str
) -> tuple[dict[str, bool], dict[str, str], list[str]]:
    """The verdict, on the host: ({test: passed}, {failed test: why}, other output lines) from the
    observations the sandbox printed. A test passes when every one of its checks observed its expected
    trace; a missing or malformed result fails the check."""
    observed, other = parse_observations(stdout, {c.id for c in checks})
    results: dict[str, bool] = {}
    why: dict[str, str] = {}
    for c in checks:
        got = observed.get(c.id)
        ok = got is not None and same(got["trace"], c.expected)
        if not ok and c.test not in why:
            why[c.test] = _failure(c, got)
        results[c.test] = results.get(c.test, True) and ok
    return results, why, other


def _failure(check: code_repair_tasks.Check, got: dict | None) -> str:
    """Why a check failed, for the agent: the call, what came back, what was expected (ASCII, bounded)."""
    code = " ".join(check.code.split())[:200]
    if got is None:
        return f"`{code}` reported no result (the run crashed, timed out or printed no result line)"
    note = f" ({got['note'][:200]})" if got["note"] else ""
    return f"`{code}` observed {show(got['trace'])}, expected {show(check.expected)}{note}"
