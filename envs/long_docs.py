"""`long-docs`: answer a question whose facts are buried in a large synthetic document set.

    env = envs.make("long-docs", difficulty=2)     # 64 docs x 1000 lines, ~1.4M tokens of text
    tools: list_docs(page), read_doc(name, page), grep(pattern, page), answer(code)

The documents are written into the sandbox's /work/docs at reset (one tar archive, unpacked there);
the tools run `envs/sandbox_scripts/docs.py` with python3 and page their output
(`page_lines`, `grep_page_matches`, `list_page_docs`). Sub-goals: `found_location` when a tool output
shows the fact placing the artifact in its vault, `found_code` when one shows that vault's code.
`answer(code)` ends the episode with success 1.0 / 0.0. Trajectory length scales with the config:
a policy reading everything (`envs.tasks.long_docs.reader_actions`) sees the whole set.
With `use_sandbox=False` the documents go to a private temporary folder and the same script runs
in a killable child process (`envs.child_process.call_in_child` of `docs.run`, `tool_timeout_s` as in the
sandbox, so a catastrophic regex times out), with the same output: for the SFT warm-up's oracle
transcripts, its evaluation and Docker-free smoke runs.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from envs.child_process import call_in_child
from envs.generated_task_env import GeneratedTaskEnv
from envs.sandbox_scripts import docs as docs_script
from envs.sandbox_scripts import script_source
from envs.sandbox_scripts.docs import MAX_PATTERN as MAX_PATTERN_CHARS
from envs.tasks import long_docs as long_docs_tasks
from envs.threads import run_in_own_thread
from envs.tool_call import echo
from envs.tools import ToolError, tool

DOCS_DIR = "/work/docs"


def _tar(docs: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in docs.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o444
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class LongDocsEnv(GeneratedTaskEnv):
    """Args: difficulty (0-3, see envs.tasks.long_docs.DIFFICULTIES), config (LongDocsConfig overrides:
    num_docs, lines_per_doc, words_per_line, num_vaults, page_lines, grep_page_matches, list_page_docs),
    use_sandbox (run the tools in the sandbox; default True), tool_timeout_s, and the ToolEnv arguments."""

    tasks = long_docs_tasks
    env_id = "long-docs"
    uses_sandbox = True
    default_max_turns = 40
    instructions = (
        "Answer the question using the documents. Search them with grep, read pages with read_doc, "
        "and give the final code with answer."
    )

    def __init__(
        self,
        difficulty: int = 0,
        config: dict[str, Any] | None = None,
        use_sandbox: bool = True,
        tool_timeout_s: float = 20.0,
        **tool_env_kwargs: Any,
    ) -> None:
        super().__init__(difficulty, config, **tool_env_kwargs)
        self.uses_sandbox = use_sandbox
        self.tool_timeout_s = tool_timeout_s
        self._script = script_source("docs")
        self._local: tempfile.TemporaryDirectory | None = None  # the documents when use_sandbox=False

    async def setup(self) -> None:
        if not self.uses_sandbox:
            await run_in_own_thread(self._write_local, self.task.docs, timeout_s=None, what="task")
            return
        archive = await run_in_own_thread(_tar, self.task.docs, timeout_s=None, what="task")
        await self.sandbox.awrite_file("/work/docs.tar", archive)
        cmd = f"mkdir -p {DOCS_DIR} && tar -xf /work/docs.tar -C {DOCS_DIR} && rm /work/docs.tar"
        res = await self.sandbox.aexec(["sh", "-c", cmd], timeout_s=60)
        if res.exit_code != 0:
            # the sandbox cannot hold the documents: an infrastructure problem, not the agent's
            from sandbox.errors import SandboxError

            raise SandboxError(
                f"long-docs setup failed to unpack documents: {res.stdout}{res.stderr}".strip()
            )

    def close(self) -> None:
        super().close()
        self._remove_local()

    async def aclose(self) -> None:
        await super().aclose()
        self._remove_local()

    def _remove_local(self) -> None:
        if self._local is not None:
            self._local.cleanup()
            self._local = None

    def _write_local(self, docs: dict[str, str]) -> None:
        self._remove_local()
        self._local = tempfile.TemporaryDirectory(prefix="odyssey-long-docs-")
        for name, text in docs.items():
            (Path(self._local.name) / name).write_text(text, encoding="utf-8")

    async def _docs(self, *args: str) -> str:
        if not self.uses_sandbox:
            result, timed_out = await call_in_child(
                docs_script.run, [self._local.name, *args], timeout_s=self.tool_timeout_s
            )
            if timed_out:
                raise ToolError(f"timed out after {self.tool_timeout_s:g} s (simplify the pattern)")
            code, out = result
            if code != 0:
                raise ToolError(out.removeprefix("error: "))
            return self._credit(out)
        res = await self.sandbox.aexec(
            ["python3", "-c", self._script, DOCS_DIR, *args], timeout_s=self.tool_timeout_s
        )
        if res.timed_out:
            raise ToolError(f"timed out after {self.tool_timeout_s:g} s (simplify the pattern)")
        out = res.stdout.rstrip("\n")
        if res.truncated:
            out += "\n[output truncated by the sandbox's output limit: ask for a smaller page]"
        if res.exit_code != 0:
            raise ToolError(out.removeprefix("error: ") or res.stderr.strip()[-300:])
        return self._credit(out)

    def _credit(self, out: str) -> str:
        """Achieve the sub-goals whose facts tool output `out` shows below its header line (the header echoes
        a grep pattern: model text must not earn a sub-goal); returns `out`."""
        task: long_docs_tasks.LongDocsTask = self.task
        body = out.partition("\n")[2]
        if task.location_fact.text in body:
            self.achieve("found_location")
        if task.code_fact.text in body:
            self.achieve("found_code")
        return out

    @tool
    async def list_docs(self, page: int = 1) -> str:
        """List the documents with their sizes.

        Args:
            page: page of the listing, starting at 1.
        """
        return await self._docs("list", str(page), str(self.task.config.list_page_docs))

    @tool
    async def read_doc(self, name: str, page: int = 1) -> str:
        """Read one page of a document (lines are numbered).

        Args:
            name: document name from list_docs, e.g. "doc_000.txt".
            page: page number, starting at 1.
        """
        if "/" in name or name.startswith(".") or len(name) > 200:
            raise ToolError(f"bad document name {echo(name, 60)!r}: use a name from list_docs (doc_000.txt)")
        return await self._docs("read", name, str(page), str(self.task.config.page_lines))

    @tool
    async def grep(self, pattern: str, page: int = 1) -> str:
        """Search all documents for lines matching a regular expression (case-insensitive).

        Args:
            pattern: Python regular expression, e.g. "jade compass".
            page: page of the matches, starting at 1.
        """
        if len(pattern) > MAX_PATTERN_CHARS:  # checked here too: a huge argument never reaches the sandbox
            raise ToolError(f"pattern is {len(pattern)} characters long; the limit is {MAX_PATTERN_CHARS}")
        return await self._docs("grep", pattern, str(page), str(self.task.config.grep_page_matches))

    @tool
    def answer(self, code: int) -> str:
        """Give the final answer; this ends the episode.

        Args:
            code: the 4-digit access code.
        """
        correct = code == self.task.code
        self.finish(1.0 if correct else 0.0)
        return "correct" if correct else "incorrect"
