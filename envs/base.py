"""`ToolEnv`: a gymnasium environment whose observations are chat messages and whose action is the
model's raw text for one turn.

Episode:

    messages, info = env.reset(seed=7)          # [system (instructions + tools), user (task)]
    while True:
        text = policy(messages)                 # one assistant turn, may hold several <tool_call>s
        obs, reward, terminated, truncated, info = env.step(text)
        messages += [{"role": "assistant", "content": text}, *obs]
        if terminated or truncated: break

Each step parses the turn's tool calls (`envs.tool_call`), validates each call against its `@tool`
schema (`envs.tools`), runs it, and returns one `{"role": "tool", "content": ...}` message per
call. Malformed JSON, an unknown tool, bad arguments, a tool that raises and more than
`max_tool_calls_per_turn` calls all become an `error: ...` tool message the model can read plus an
entry in `info["tool_errors"]`; none raises. Parsing, dispatch and the observation are total
functions of the model's text: error messages quote it through `envs.tool_call.echo` (truncated,
escaped) and every observation is free of lone surrogates, so no turn can make the step (or the
tokenizer after it) fail. Only the env's own code, the sandbox or the engine can cause an infra error.
A turn without any tool call gets `on_no_tool_call(text)` (default: a user nudge restating the format).

Images. A tool may return `envs.tool_result.ToolResult(text, images=[png_bytes, ...])` in an env with
`observes_images = True`: its tool message content is then a list of parts `[{"type": "text", "text"},
{"type": "image", "image": png}, ...]`. Each image is decoded with limits in a killable child process and
re-encoded; a bad one (corrupt, truncated, a bomb, too many pixels, an unknown mode, a decoder that hangs
or crashes) becomes an `error: image i: ...` text part and a tool error, never an exception (the episode
goes on and is scored).

Step info (every step; built as an `envs.trajectory.StepInfo`, returned as its dict per gymnasium, and
stored as the `step_infos` of `envs.trajectory.Trajectory`):
    tool_calls   list[{"name", "arguments"}]  every call whose JSON parsed (valid or not)
    tool_results list[str]  one per tool_calls entry, same order: the tool's output, or its error text
                            (a `ToolResult`'s text plus one `<image i: WxH sha256 ...>` line per image)
    tool_errors  list[str]  every problem this turn (parse errors included), without the "error: " prefix
    subgoals     list[str]  sub-goals first achieved at this step (`self.achieve(name)`)
    env_reward   float      the reward returned by step (the success score at termination, else 0.0)
    infra_error  str | None set when a SandboxError ended the episode (never the agent's fault)
    turn         int        1-based index of this step in the episode
    no_tool_call bool       the turn held no tool call at all
    success      float      only when terminated by the env (not on infra errors or truncation)
Every value is nested at most `MAX_INFO_DEPTH` levels (`bound_info_depth`: a deeper one is replaced), and a
tool call's JSON at most `envs.tool_call.MAX_JSON_DEPTH`: a step info always crosses Ray and the store.

Dataset rows. `reset(options={"row": row})` (a DatasetRow or a mapping of columns; envs/dataset.py) builds
the task with `task_from_row(row)` instead of `generate_task(seed, options)`; envs that take rows
implement it (a task whose prompt is a list of chat messages starts the conversation with them).

Sandbox leases. An env with `uses_sandbox = True` holds one sandbox per episode: leased at reset,
returned when the episode ends (terminated/truncated), at the next reset, or at close. The sync API
(`reset/step/close`) uses `pool.lease_sync()`; the async API (`areset/astep/aclose`) uses
`pool.lease()`, and its tools await the sandbox's async methods, so nothing blocks the event loop.
Tools are `async def` when they touch the sandbox; the sync API drives them on a private event loop
owned by the env (the sandbox's async methods run Docker calls on its thread pool, in any loop).
Pass a started `sandbox_pool` shared across envs, or None for the process-wide
`sandbox.pool.default_pool()`. A lease taken by `areset` may be returned by `close()` and vice versa.
A `SandboxError` during a step ends the episode: terminated=True, reward 0.0, `info["infra_error"]`
set, no `success`. During reset it is raised after the lease is returned (there is no episode to mark).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, Protocol

import gymnasium

from envs.dataset import DatasetRow, TaskDataset, as_row
from envs.demonstrations import check_demonstrations
from envs.spaces import ChatMessages, ChatText
from envs.threads import run_in_own_thread
from envs.tool_call import (
    EXPECTED_FORMAT,
    MAX_JSON_DEPTH,
    ToolCallError,
    echo,
    parse_tool_calls,
    value_depth,
    without_surrogates,
)
from envs.tool_result import ImageLimits, ToolResult, tool_result_content
from envs.tools import ToolArgumentError, ToolDefinitionError, ToolError, ToolSpec
from envs.trajectory import StepInfo
from sandbox.errors import SandboxError

Message = dict[str, str]
MAX_ERROR_CHARS = 1000  # an error observation (which may quote the model) is cut at this length
#: the deepest a step info's value may nest (its tool calls' arguments: at most MAX_JSON_DEPTH + 2 levels);
#: a deeper value is replaced by a marker, since Ray cannot pickle values nested ~495 levels deep
MAX_INFO_DEPTH = 2 * MAX_JSON_DEPTH


def bound_info_depth(info: dict[str, Any], limit: int = MAX_INFO_DEPTH) -> dict[str, Any]:
    """`info` (a step's info dict, changed in place and returned) with every value nested deeper than `limit`
    levels replaced: a tool call's arguments by {"dropped": why}, any other value by a string saying why.
    So whatever an env (or the model text it parsed) put there can be pickled, stored and read back."""
    why = f"nested deeper than {limit} levels: dropped"
    for key, value in list(info.items()):
        if value_depth(value, limit) <= limit:
            continue
        if key == "tool_calls" and isinstance(value, list):
            info[key] = [
                c if value_depth(c, limit) <= limit else {
                    "name": echo(c.get("name") if isinstance(c, dict) else "?"), "arguments": {"dropped": why}
                }
                for c in value
            ]
        else:
            info[key] = f"<{why}>"
    return info


class TaskLike(Protocol):
    """What `ToolEnv.generate_task` returns: any object with these two attributes."""

    task_id: str
    prompt: str


class ToolEnv(gymnasium.Env):
    """Base class of Odyssey environments. Subclasses declare `@tool` methods and implement
    `generate_task`; sandbox envs set `uses_sandbox = True` and usually override `setup`.

    Args:
        max_turns: steps before the episode is truncated (default: the class's `default_max_turns`).
        sandbox_pool: a started `sandbox.pool.SandboxPool` shared by many envs; None = the process-wide
            `sandbox.pool.default_pool()` (started on first use, closed at exit).
        tools_in_prompt: list the tools in the system message (off when the chat template renders them).
        demonstrations: worked example turns placed between the system message and the task
            (envs/demonstrations.py); None = none.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    #: class-wide defaults a subclass overrides
    env_id: str = "tool-env"
    uses_sandbox: bool = False  # a subclass (or an instance, before reset) may switch it on
    default_max_turns: ClassVar[int] = 10
    max_tool_calls_per_turn: ClassVar[int] = 32  # calls beyond this in one turn are not run (one error)
    rows_only: ClassVar[bool] = False  # tasks come only from dataset rows (env.dataset is required)
    instructions: ClassVar[str] = "You solve the task by calling tools."
    #: tool messages may hold image parts (a tool returns `envs.tool_result.ToolResult`); the observation
    #: space says so (`ChatMessages(images=True)`)
    observes_images: ClassVar[bool] = False
    image_limits: ClassVar[ImageLimits] = ImageLimits()  # checks on every tool image (envs/tool_result.py)
    #: filled by __init_subclass__: tool name -> spec, in declaration order (base classes first)
    _tool_specs: ClassVar[dict[str, ToolSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: list[str] = []  # attributes that are tools somewhere in the MRO, base classes first
        for klass in reversed(cls.__mro__):
            names += [n for n, a in vars(klass).items() if hasattr(a, "__tool_spec__") and n not in names]
        specs: dict[str, ToolSpec] = {}
        for attr in names:  # the most-derived definition wins; overriding without @tool removes the tool
            spec = getattr(getattr(cls, attr, None), "__tool_spec__", None)
            if not isinstance(spec, ToolSpec):
                continue
            if spec.name in specs:
                raise ToolDefinitionError(f"{cls.__name__}: two methods declare the tool name '{spec.name}'")
            specs[spec.name] = spec
        cls._tool_specs = specs

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
        demonstrations: Sequence[Message] | None = None,
    ) -> None:
        if type(self).generate_task is ToolEnv.generate_task:
            raise TypeError(
                f"{type(self).__name__} must implement generate_task(self, seed, options) -> task"
            )
        self.max_turns = int(max_turns if max_turns is not None else self.default_max_turns)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        for spec in self._tool_specs.values():
            spec.params  # noqa: B018  builds each tool's JSON schema now: a docstring problem fails here
        self.observation_space = ChatMessages(images=self.observes_images)
        self.action_space = ChatText()
        self.tools_in_prompt = tools_in_prompt
        self.demonstrations = check_demonstrations(demonstrations)
        self.task: Any = None
        self._pool = sandbox_pool
        self._lease: contextlib.ExitStack | contextlib.AsyncExitStack | None = None
        self._sandbox: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn = 0
        self._over = True
        self._achieved: list[str] = []
        self._new_subgoals: list[str] = []
        self._finished: float | None = None

    # ------------------------------------------------------------------ for subclasses
    def generate_task(self, seed: int, options: dict[str, Any]) -> TaskLike:
        """The task for `seed`: deterministic, pure Python (no sandbox). Every subclass overrides it
        (checked in `__init__`); it runs in a worker thread, off the event loop."""
        raise TypeError(f"{type(self).__name__} must implement generate_task(self, seed, options) -> task")

    def task_from_row(self, row: DatasetRow) -> TaskLike:
        """The task for one dataset row (`env.dataset`, envs/dataset.py): `reset(options={"row": row})`
        calls it instead of `generate_task`. Envs that take rows override it; it runs in a worker thread."""
        raise TypeError(
            f"env {self.env_id!r} ({type(self).__name__}) does not take dataset rows: it generates its tasks "
            "from seeds. Remove env.dataset, use an env that takes rows (dataset-qa, reasoning-gym/<name>, "
            "skyrl/<env>), or implement task_from_row(self, row) -> task in the env"
        )

    @classmethod
    def dataset_problems(cls, data: TaskDataset | None) -> list[str]:
        """What is wrong with running this env on `data` (the run's env.dataset, or None); checked at
        config load. Envs with requirements on the rows (an answer column) extend it."""
        if data is None:
            need = f"{cls.__name__} takes its tasks from dataset rows; set env.dataset (a .jsonl or .parquet)"
            return [need] if cls.rows_only else []
        if cls.task_from_row is ToolEnv.task_from_row:
            return [
                f"{cls.__name__} generates its tasks from seeds and does not take dataset rows; remove "
                "env.dataset, or use an env that takes rows (dataset-qa, reasoning-gym/<name>, skyrl/<env>)"
            ]
        return []

    def first_messages(self) -> list[Message]:
        """The conversation's start for `self.task`: [system, *demonstrations, user(prompt)]. A task whose
        prompt is a list of chat messages (a conversational dataset row) starts with those, after the system
        message and demonstrations unless they bring their own system message."""
        system = {"role": "system", "content": self.system_prompt()}
        demos = [dict(m) for m in self.demonstrations]
        prompt = self.task.prompt
        if isinstance(prompt, str):
            return [system, *demos, {"role": "user", "content": prompt}]
        messages = [dict(m) for m in prompt]
        return messages if any(m.get("role") == "system" for m in messages) else [system, *demos, *messages]

    async def setup(self) -> None:
        """Prepare the leased sandbox for `self.task` (write files...). Default: nothing."""

    def on_no_tool_call(self, text: str) -> list[Message]:
        """Observation for a turn without any tool call. Default: a user nudge restating the format."""
        return [
            {
                "role": "user",
                "content": f"No tool call found. Call a tool with {EXPECTED_FORMAT}. "
                f"Available tools: {', '.join(self.tools)}.",
            }
        ]

    def system_prompt(self) -> str:
        """The system message: `instructions`, the tool list (unless `tools_in_prompt=False`), the format."""
        parts = [self.instructions.strip()]
        if self.tools_in_prompt and self.tools:
            lines = [
                f"- {s.signature()}" + (f": {s.description}" if s.description else "")
                for s in self.tools.values()
            ]
            parts.append("Tools:\n" + "\n".join(lines))
        parts.append(f"Call a tool with {EXPECTED_FORMAT}")
        return "\n\n".join(parts)

    # ------------------------------------------------------------------ helpers for tools
    @property
    def tools(self) -> dict[str, ToolSpec]:
        """Tool name -> `ToolSpec`."""
        return self._tool_specs

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas of the tools, for chat templates."""
        return [s.schema() for s in self.tools.values()]

    @property
    def sandbox(self) -> Any:
        """The `sandbox.container.Sandbox` leased for this episode."""
        if not self.uses_sandbox:
            raise RuntimeError(
                f"{type(self).__name__} has uses_sandbox = False; set it to True to get a sandbox"
            )
        if self._sandbox is None:
            raise RuntimeError(
                "no sandbox leased: call reset()/areset() first (the lease ends with the episode)"
            )
        return self._sandbox

    def achieve(self, subgoal: str) -> bool:
        """Record a sub-goal; True the first time it is achieved in this episode (then it shows in info)."""
        if subgoal in self._achieved:
            return False
        self._achieved.append(subgoal)
        self._new_subgoals.append(subgoal)
        return True

    @property
    def achieved_subgoals(self) -> list[str]:
        return list(self._achieved)

    def finish(self, success: float) -> None:
        """End the episode after the current tool call with this success score (1.0/0.0 or partial)."""
        self._finished = float(success)

    @property
    def turn(self) -> int:
        return self._turn

    # ------------------------------------------------------------------ sync API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._release_sync()
        if self.uses_sandbox:
            self._acquire_sync()
        try:
            return self._run(self._start(seed, options or {}))
        except BaseException:
            self._release_sync()
            raise

    def step(self, action: str):
        result = self._run(self._step(action))
        bound_info_depth(result[4])
        if result[2] or result[3]:
            self._release_sync()
        return result

    def close(self) -> None:
        """Return the sandbox lease (if any) and close the private event loop. Idempotent."""
        self._release_sync()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    # ------------------------------------------------------------------ async API
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        await self._arelease()
        if self.uses_sandbox:
            await self._aacquire()
        try:
            return await self._start(seed, options or {})
        except BaseException:
            await self._arelease()
            raise

    async def astep(self, action: str):
        result = await self._step(action)
        bound_info_depth(result[4])
        if result[2] or result[3]:
            await self._arelease()
        return result

    async def aclose(self) -> None:
        """Return the sandbox lease (if any). Idempotent."""
        await self._arelease()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    # ------------------------------------------------------------------ episode logic (shared)
    async def _start(self, seed: int | None, options: dict[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        self._over = True  # until the new episode is fully set up
        task_seed = int(seed) if seed is not None else int(self.np_random.integers(2**31 - 1))
        # off the event loop (generating a large task, long-docs, takes a while), on a thread of its own: a
        # plugin's task code that blocks holds only that thread, never the engine's (envs/threads.py)
        row = options.get("row")
        if row is not None:
            self.task = await run_in_own_thread(self.task_from_row, as_row(row), timeout_s=None, what="task")
        else:
            self.task = await run_in_own_thread(
                self.generate_task, task_seed, options, timeout_s=None, what="task"
            )
        self._turn, self._over, self._finished = 0, False, None
        self._achieved, self._new_subgoals = [], []
        await self.setup()
        messages = self.first_messages()
        info = {
            "task_id": self.task.task_id,
            "seed": task_seed,
            "env_id": self.env_id,
            "max_turns": self.max_turns,
        }
        return messages, info

    def _begin_turn(self, text: str) -> None:
        """Check that a turn may be played now (an episode is open, `text` is the turn's text); count it."""
        if self.task is None:
            raise RuntimeError("call reset() (or areset()) before step()")
        if self._over:
            raise RuntimeError(
                "the episode is over (terminated or truncated); call reset() to start a new one"
            )
        if not isinstance(text, str):
            raise TypeError(f"step() takes the model's text for one turn (str), got {type(text).__name__}")
        self._turn += 1

    async def _step(self, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        self._begin_turn(text)
        self._new_subgoals = []
        info = StepInfo(turn=self._turn)
        obs: list[Message] = []

        def error(message: str, call_result: bool) -> None:
            message = echo(message, MAX_ERROR_CHARS)
            info.tool_errors.append(message)
            if call_result:
                info.tool_results.append(f"error: {message}")
            obs.append({"role": "tool", "content": f"error: {message}"})

        items = parse_tool_calls(text)
        if not items:
            info.no_tool_call = True
            obs.extend(self.on_no_tool_call(text))
        if len(items) > self.max_tool_calls_per_turn:
            error(
                f"{len(items)} tool calls in one turn; only the first {self.max_tool_calls_per_turn} "
                "are run. Make fewer calls per turn.",
                call_result=False,
            )
            items = items[: self.max_tool_calls_per_turn]
        for item in items:
            if self._finished is not None:
                break  # an earlier call this turn ended the episode; the rest are not run
            if isinstance(item, ToolCallError):
                error(item.message, call_result=False)
                continue
            spec = self.tools.get(item.name)
            if spec is None:
                info.tool_calls.append({"name": echo(item.name), "arguments": item.arguments})
                short = len(item.name) < 64  # a hint for plausible typos only (difflib is quadratic)
                close = difflib.get_close_matches(item.name, list(self.tools), n=1) if short else []
                hint = f" Did you mean '{close[0]}'?" if close else ""
                error(
                    f"unknown tool {echo(item.name, 100)!r}.{hint} Available tools: {', '.join(self.tools)}",
                    True,
                )
                continue
            info.tool_calls.append(item.to_dict())
            try:
                args = spec.validate(item.arguments)
            except ToolArgumentError as err:
                error(str(err), True)
                continue
            try:
                result = await self._invoke(spec, args)
            except Exception as err:
                if isinstance(err, SandboxError):
                    info.infra_error = f"{type(err).__name__}: {err}"
                    info.tool_results.append(f"error: infrastructure failure: {info.infra_error}")
                    break
                if isinstance(err, ToolError):
                    error(str(err), True)
                else:
                    error(f"tool '{spec.name}' raised {type(err).__name__}: {err}", True)
                continue
            if isinstance(result, ToolResult):  # images: checked in a killable child (envs/tool_result.py)
                if not self.observes_images:
                    error(f"tool '{spec.name}' returned images but env {self.env_id!r} does not observe "
                          "images; set observes_images = True on the env class", True)
                    continue
                content, record, image_errors = await tool_result_content(result, self.image_limits)
                info.tool_errors.extend(image_errors)
                info.tool_results.append(record)
                obs.append({"role": "tool", "content": content})
                continue
            content = without_surrogates("" if result is None else str(result))
            info.tool_results.append(content)
            obs.append({"role": "tool", "content": content})

        info.subgoals = list(self._new_subgoals)
        reward, terminated = 0.0, False
        if info.infra_error is not None:
            terminated = True
        elif self._finished is not None:
            terminated, reward = True, self._finished
            info.success = self._finished
        info.env_reward = reward
        truncated = not terminated and self._turn >= self.max_turns
        self._over = terminated or truncated
        return obs, reward, terminated, truncated, info.to_dict()

    async def _invoke(self, spec: ToolSpec, args: dict[str, Any]) -> Any:
        bound = spec.fn.__get__(self, type(self))
        if spec.is_async:
            return await bound(**args)
        return bound(**args)

    # ------------------------------------------------------------------ event loop + leases
    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` to completion on the env's private loop (the sync API)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(
                f"{type(self).__name__}.reset()/step() called inside a running event loop; "
                "use `await env.areset()` / `await env.astep(text)` there"
            )
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def _get_pool(self) -> Any:
        if self._pool is None:
            from sandbox.pool import default_pool

            self._pool = default_pool()
        return self._pool

    def _acquire_sync(self) -> None:
        stack = contextlib.ExitStack()
        self._sandbox = stack.enter_context(self._get_pool().lease_sync())
        self._lease = stack

    async def _aacquire(self) -> None:
        stack = contextlib.AsyncExitStack()
        self._sandbox = await stack.enter_async_context(self._get_pool().lease())
        self._lease = stack

    def _release_sync(self) -> None:
        stack, self._lease, self._sandbox = self._lease, None, None
        if isinstance(stack, contextlib.AsyncExitStack):
            self._run(stack.aclose())  # leased by areset(): its exit only hands the sandbox back
        elif stack is not None:
            stack.close()

    async def _arelease(self) -> None:
        stack, self._lease, self._sandbox = self._lease, None, None
        if isinstance(stack, contextlib.AsyncExitStack):
            await stack.aclose()
        elif stack is not None:
            await run_in_own_thread(stack.close, timeout_s=None, what="sandbox-release")
