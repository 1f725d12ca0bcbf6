"""ToolEnv episode logic and the built-in envs' Docker-free paths: truncation, termination, sub-goals,
determinism, the async API, infra-error marking, gymnasium compatibility. Real-sandbox runs of the
same envs are in tests/test_envs_docker.py."""

from __future__ import annotations

import asyncio

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs import ToolEnv, tool
from envs.arith import ArithEnv
from envs.tool_call import format_tool_call
from sandbox.errors import SandboxCrashed


class _Task:
    def __init__(self, seed: int) -> None:
        self.task_id, self.prompt, self.target = f"guess/{seed % 5}", "Guess my number (0-4).", seed % 5


class GuessEnv(ToolEnv):
    env_id = "guess"
    default_max_turns = 3

    def generate_task(self, seed, options):
        return _Task(seed)

    @tool
    def check(self, n: int) -> str:
        """Compare a guess with the number.

        Args:
            n: the guess.
        """
        if n == self.task.target:
            self.achieve("found")
            return "equal"
        return "higher" if self.task.target > n else "lower"

    @tool
    def answer(self, n: int) -> str:
        """Final answer.

        Args:
            n: the number.
        """
        self.finish(float(n == self.task.target))
        return "ok"

    @tool
    async def crash(self) -> str:
        """Simulates the sandbox dying under a tool."""
        await asyncio.sleep(0)
        raise SandboxCrashed("container died (oom)", reason="oom")


def test_reset_returns_system_and_user_messages():
    env = GuessEnv()
    msgs, info = env.reset(seed=7)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "check(n: integer): Compare a guess" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[1]["content"] == "Guess my number (0-4)."
    assert info == {"task_id": "guess/2", "seed": 7, "env_id": "guess", "max_turns": 3}
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["check", "answer", "crash"]
    assert GuessEnv(tools_in_prompt=False).reset(seed=0)[0][0]["content"].count("check(") == 0


def test_max_turns_truncates_and_step_after_end_raises():
    env = GuessEnv(max_turns=2)
    env.reset(seed=1)
    *_, term, trunc, _ = env.step(format_tool_call("check", {"n": 0}))
    assert (term, trunc) == (False, False)
    obs, reward, term, trunc, info = env.step("no call")
    assert (reward, term, trunc) == (0.0, False, True) and "success" not in info and info["turn"] == 2
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("again")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        GuessEnv(max_turns=0)


def test_subgoal_reported_once_and_outcome():
    env = GuessEnv()
    env.reset(seed=3)  # target 3
    assert env.step(format_tool_call("check", {"n": 3}))[4]["subgoals"] == ["found"]
    assert env.step(format_tool_call("check", {"n": 3}))[4]["subgoals"] == []
    obs, reward, term, trunc, info = env.step(format_tool_call("answer", {"n": 2}))
    assert (reward, term, info["success"]) == (0.0, True, 0.0)
    assert env.achieved_subgoals == ["found"]


def test_sandbox_error_ends_episode_as_infra_error():
    env = GuessEnv()
    env.reset(seed=0)
    text = (
        format_tool_call("check", {"n": 1}) + format_tool_call("crash") + format_tool_call("check", {"n": 2})
    )
    obs, reward, term, trunc, info = env.step(text)
    assert term and not trunc and reward == 0.0
    assert info["infra_error"] == "SandboxCrashed: container died (oom)"
    assert "success" not in info
    # the call after the crash is not run; the interrupted call's result says why
    assert [c["name"] for c in info["tool_calls"]] == ["check", "crash"]
    assert info["tool_results"][1] == "error: infrastructure failure: SandboxCrashed: container died (oom)"
    assert info["tool_errors"] == []  # not the agent's fault


def test_env_without_generate_task_fails_at_construction():
    class NoTask(ToolEnv):
        pass

    with pytest.raises(TypeError, match="NoTask must implement generate_task"):
        NoTask()


def test_step_before_reset_and_non_str_action():
    env = GuessEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("x")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="str"):
        env.step(123)  # type: ignore[arg-type]


def test_async_api_matches_sync():
    def run_sync():
        env = GuessEnv()
        out = [env.reset(seed=4)]
        out += [env.step(format_tool_call("check", {"n": 1})), env.step(format_tool_call("answer", {"n": 4}))]
        env.close()
        return out

    async def run_async():
        env = GuessEnv()
        out = [await env.areset(seed=4)]
        out += [
            await env.astep(format_tool_call("check", {"n": 1})),
            await env.astep(format_tool_call("answer", {"n": 4})),
        ]
        await env.aclose()
        return out

    assert asyncio.run(run_async()) == run_sync()


def test_sync_api_inside_event_loop_names_the_async_api():
    async def main():
        env = GuessEnv()
        with pytest.raises(RuntimeError, match="await env.areset"):
            env.reset(seed=0)

    asyncio.run(main())


def test_seedless_reset_is_reproducible_from_first_seed():
    a, b = GuessEnv(), GuessEnv()
    a.reset(seed=11), b.reset(seed=11)
    assert [a.reset()[1]["seed"] for _ in range(3)] == [b.reset()[1]["seed"] for _ in range(3)]


def test_gymnasium_make_and_env_checker():
    import envs.registry  # noqa: F401  (registers the odyssey/<Name>-v0 gymnasium ids; `import envs` is lazy)

    env = gymnasium.make("odyssey/Arith-v0", use_sandbox=False)
    msgs, info = env.reset(seed=0)
    assert info["env_id"] == "arith" and msgs[1]["content"].startswith("Compute ")
    obs, *_ = env.step(env.unwrapped.oracle_actions()[0])
    assert obs[0]["role"] == "tool"
    env.close()
    check_env(ArithEnv(use_sandbox=False), skip_render_check=True)


# ---------------------------------------------------------------------------------------------- arith
@pytest.mark.parametrize("difficulty", [0, 1, 2, 3])
def test_arith_oracle_solves_without_sandbox(difficulty):
    env = envs.make("arith", difficulty=difficulty, use_sandbox=False)
    for seed in range(5):
        env.reset(seed=seed)
        steps = [env.step(a) for a in env.oracle_actions()]
        n_ops = len(env.task.intermediates)
        assert [s[4]["subgoals"] for s in steps[:-1]] == [[f"step{i + 1}"] for i in range(n_ops)]
        *_, reward, term, trunc, info = steps[-1]
        assert (reward, term, trunc, info["success"]) == (1.0, True, False, 1.0)


def test_arith_wrong_answer_and_calc_errors():
    env = envs.make("arith", use_sandbox=False)
    env.reset(seed=0)
    obs, *_, info = env.step(format_tool_call("calc", {"expression": "__import__('os')"}))
    assert obs[0]["content"].startswith("error: unsupported syntax") and info["tool_errors"]
    obs, *_ = env.step(format_tool_call("calc", {"expression": "1/0"}))
    assert obs[0]["content"] == "error: division by zero"
    *_, reward, term, _, info = env.step(format_tool_call("answer", {"value": env.task.answer + 1}))
    assert (reward, term, info["success"]) == (0.0, True, 0.0)


def test_arith_instructions_replace_the_system_messages_first_paragraph():
    """env.kwargs.instructions (configs/smollm2_arith_tools.yaml: a worked example for a model whose chat
    template shows no tools): the system message starts with it; the tool list and format follow as before."""
    default, _ = envs.make("arith", use_sandbox=False).reset(seed=0)
    mine, _ = envs.make("arith", use_sandbox=False, instructions="Call calc, then answer.").reset(seed=0)
    assert mine[0]["content"].startswith("Call calc, then answer.")
    assert not default[0]["content"].startswith("Call calc")
    tail = default[0]["content"].split("\n", 1)[1]
    assert mine[0]["content"].endswith(tail)


def test_arith_difficulty_zero_is_tiny():
    env = envs.make("arith", use_sandbox=False)
    for seed in range(20):
        msgs, _ = env.reset(seed=seed)
        assert len(msgs[1]["content"]) <= len("Compute 9+9.") and len(env.task.intermediates) == 1
    assert len(msgs[0]["content"]) < 400


def test_arith_options_override_difficulty_and_bad_config():
    env = envs.make("arith", use_sandbox=False)
    env.reset(seed=0, options={"difficulty": 2})
    assert len(env.task.intermediates) == 3
    with pytest.raises(ValueError, match="unknown arith config field"):
        envs.make("arith", config={"n_ops": 2})
    with pytest.raises(ValueError, match="difficulty must be one of"):
        envs.make("arith", difficulty=9)
