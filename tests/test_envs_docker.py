"""Built-in envs against a real Docker sandbox: a scripted perfect policy and a bad one per env, the
async path (concurrent episodes, event loop never blocked), lease handling and infra errors.

One module-scoped pool serves every test; each test runs a few short episodes.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import envs
from envs.tool_call import format_tool_call
from sandbox.client import docker_client
from tests.sandbox_fixtures import TEST_LIMITS_KW

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def pool(docker_sandbox):  # noqa: F811
    from sandbox.container import SandboxLimits
    from sandbox.pool import SandboxPool

    pool = SandboxPool(size=2, image=docker_sandbox, limits=SandboxLimits(**TEST_LIMITS_KW))
    pool.start_sync()
    yield pool
    pool.close_sync()


def _play(env, actions):
    steps = []
    for a in actions:
        steps.append(env.step(a))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def _wait_released(pool, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.n_leased and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.n_leased == 0


# ---------------------------------------------------------------------------------------------- arith
def test_arith_perfect_and_bad(pool):
    env = envs.make("arith", difficulty=1, sandbox_pool=pool)
    env.reset(seed=0)
    steps = _play(env, env.oracle_actions())
    assert [s[4]["subgoals"] for s in steps[:-1]] == [["step1"], ["step2"]]
    assert steps[-1][1:4] == (1.0, True, False) and steps[-1][4]["success"] == 1.0
    _wait_released(pool)  # the lease ends with the episode

    env.reset(seed=1)
    bad = [
        format_tool_call("calc", {"expression": "__import__('os').system('id')"}),
        format_tool_call("calc", {"expression": "1/0"}),
        '<tool_call>{"name": "calc", "arguments": {"expression": }}</tool_call>',
        format_tool_call("answer", {"value": env.task.answer + 1}),
    ]
    steps = _play(env, bad)
    assert steps[0][0][0]["content"].startswith("error: unsupported syntax 'Call'")
    assert steps[1][0][0]["content"] == "error: division by zero"
    assert "not valid JSON" in steps[2][4]["tool_errors"][0]
    assert steps[-1][1:4] == (0.0, True, False) and steps[-1][4]["success"] == 0.0
    assert all(s[4]["subgoals"] == [] for s in steps)
    env.close()


# ---------------------------------------------------------------------------------------------- code repair
def test_code_repair_perfect_and_bad(pool):
    env = envs.make("code-repair", difficulty=1, sandbox_pool=pool)
    env.reset(seed=3)
    task = env.task
    steps = _play(env, env.oracle_actions())
    assert steps[0][0][0]["content"] == task.buggy_source
    assert steps[-1][1:4] == (1.0, True, False)
    assert sorted(steps[-1][4]["subgoals"]) == sorted(f"test:{n}" for n in task.failing_tests)
    assert "SUMMARY" in steps[-1][0][0]["content"] and "0 failed" in steps[-1][0][0]["content"]

    env.reset(seed=3)
    mod, tests = env.task.module_file, env.task.test_file
    bad = [
        format_tool_call("run_tests"),
        format_tool_call("write_file", {"path": tests, "content": "def test_x():\n    pass\n"}),
        format_tool_call("read_file", {"path": "/etc/passwd"}),
        format_tool_call("write_file", {"path": mod, "content": "def broken(:\n"}),
        format_tool_call("run_tests"),
        format_tool_call("submit"),
    ]
    steps = _play(env, bad)
    first = steps[0][0][0]["content"]
    assert all(f"FAIL {n}" in first for n in env.task.failing_tests) and steps[0][4]["subgoals"] == []
    assert steps[1][4]["tool_errors"] == [f"only {mod} may be written; the tests are read-only"]
    assert "no file '/etc/passwd'" in steps[2][4]["tool_errors"][0]
    assert "cannot import the code under test: SyntaxError" in steps[4][0][0]["content"]
    assert steps[-1][1:4] == (0.0, True, False) and steps[-1][4]["success"] == 0.0
    env.close()


# ---------------------------------------------------------------------------------------------- long docs
def test_long_docs_perfect_bad_and_reader(pool):
    env = envs.make("long-docs", difficulty=0, sandbox_pool=pool)
    env.reset(seed=2)
    steps = _play(env, env.oracle_actions())
    assert [s[4]["subgoals"] for s in steps] == [["found_location"], ["found_code"], []]
    assert steps[-1][1:4] == (1.0, True, False)

    env.reset(seed=2)
    bad = [
        format_tool_call("list_docs"),
        format_tool_call("grep", {"pattern": "(["}),
        format_tool_call("read_doc", {"name": "../etc/passwd"}),
        format_tool_call("read_doc", {"name": "doc_000.txt", "page": 99}),
        format_tool_call("answer", {"code": 1}),
    ]
    steps = _play(env, bad)
    assert steps[0][0][0]["content"].startswith("[4 documents, page 1/1]")
    assert "invalid regular expression" in steps[1][4]["tool_errors"][0]
    assert "bad document name" in steps[2][4]["tool_errors"][0]
    assert "page 99 is out of range" in steps[3][4]["tool_errors"][0]
    assert steps[-1][1:4] == (0.0, True, False)

    from envs.tasks.long_docs import reader_actions

    env = envs.make("long-docs", difficulty=0, sandbox_pool=pool, max_turns=20)
    env.reset(seed=2)
    steps = _play(env, reader_actions(env.task, calls_per_turn=4))
    assert sorted(g for s in steps for g in s[4]["subgoals"]) == ["found_code", "found_location"]
    chars = sum(len(o["content"]) for s in steps for o in s[0])
    assert chars > sum(len(t) for t in env.task.docs.values())  # the whole set was observed
    assert steps[-1][4]["success"] == 1.0
    env.close()


def test_long_docs_in_process_tools_print_what_the_sandbox_prints(pool):
    """use_sandbox=False (the SFT warm-up's data) gives the sandbox's observations, rewards and sub-goals,
    for the oracle, bad calls and a reader of every page; its temporary documents go at close."""
    from envs.tasks.long_docs import reader_actions

    boxed = envs.make("long-docs", difficulty=0, sandbox_pool=pool, max_turns=30)
    local = envs.make("long-docs", difficulty=0, use_sandbox=False, max_turns=30)
    for seed in (2, 5):
        boxed.reset(seed=seed)
        task = boxed.task
        plays = [
            boxed.oracle_actions(),
            [
                format_tool_call("list_docs"),
                format_tool_call("grep", {"pattern": "(["}),
                format_tool_call("grep", {"pattern": "vault V-"}),
                format_tool_call("read_doc", {"name": "doc_009.txt"}),
                format_tool_call("read_doc", {"name": "doc_001.txt", "page": 99}),
                format_tool_call("answer", {"code": task.code + 1}),
            ],
            reader_actions(task, calls_per_turn=2),
        ]
        for actions in plays:
            boxed.reset(seed=seed)
            local.reset(seed=seed)
            assert _play(local, actions) == _play(boxed, actions)
    # a pattern that spells a fact but matches nothing is echoed in the header: no sub-goal for it
    for env in (boxed, local):
        env.reset(seed=2)
        forged = env.task.location_fact.text + " nowhere"
        obs = env.step(format_tool_call("grep", {"pattern": forged}))
        assert forged in obs[0][0]["content"] and obs[4]["subgoals"] == []
    # a catastrophic regex from model text times out in-process too (a killable child), as in the sandbox
    slow = envs.make("long-docs", difficulty=0, use_sandbox=False, tool_timeout_s=1.0)
    slow.reset(seed=2)
    t0 = time.monotonic()
    obs = slow.step(format_tool_call("grep", {"pattern": "^(([a-z ])+)+[0-9]$"}))
    assert "timed out after 1 s" in obs[4]["tool_errors"][0] and time.monotonic() - t0 < 20
    slow.close()
    folder = local._local.name
    local.close()
    boxed.close()
    assert not os.path.exists(folder)


# ---------------------------------------------------------------------------------------------- async path
def test_async_episodes_run_concurrently_without_blocking_the_loop(pool):
    async def episode(env_id, seed, **kw):
        env = envs.make(env_id, sandbox_pool=pool, **kw)
        await env.areset(seed=seed)
        last = None
        for a in env.oracle_actions():
            last = await env.astep(a)
        await env.aclose()
        return last

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        results = await asyncio.gather(episode("arith", 5, difficulty=2), episode("code-repair", 7))
        elapsed = time.monotonic() - t0
        stop.set()
        await t
        return results, ticks, elapsed

    results, ticks, elapsed = asyncio.run(main())
    assert [r[4]["success"] for r in results] == [1.0, 1.0]
    # a blocked loop would tick ~0 times during Docker calls; allow generous scheduling slack
    assert ticks > 0.3 * elapsed / 0.01, (ticks, elapsed)
    _wait_released(pool)


def test_lease_released_on_close_reset_and_across_apis(pool):
    env = envs.make("arith", sandbox_pool=pool)
    env.reset(seed=0)
    assert pool.n_leased == 1
    env.reset(seed=1)  # the first lease is returned, a fresh sandbox is leased
    assert pool.n_leased == 1
    env.close()
    _wait_released(pool)

    async def mixed():
        await env.areset(seed=2)
        assert pool.n_leased == 1
        await env.astep(env.oracle_actions()[0])
        await env.aclose()
        assert pool.n_leased == 0
        await asyncio.to_thread(env.reset, seed=3)  # a sync lease (from a thread), returned by aclose
        assert pool.n_leased == 1
        await env.aclose()
        assert pool.n_leased == 0
        await env.areset(seed=4)  # left open: the lease ends with its event loop

    asyncio.run(mixed())
    _wait_released(pool)
    env.close()  # nothing left to return; must not raise


def test_dead_sandbox_is_an_infra_error(pool):
    env = envs.make("code-repair", sandbox_pool=pool)
    env.reset(seed=0)
    docker_client().api.kill(env.sandbox.id)
    obs, reward, term, trunc, info = env.step(format_tool_call("run_tests"))
    assert term and not trunc and reward == 0.0 and "success" not in info
    assert info["infra_error"].startswith("SandboxCrashed") and info["tool_errors"] == []
    _wait_released(pool)
    env.reset(seed=0)  # the next episode gets a healthy sandbox
    assert env.step(env.oracle_actions()[0])[4]["infra_error"] is None
    env.close()


def test_default_pool_when_none_given(docker_sandbox):  # noqa: F811
    from sandbox.pool import default_pool

    env = envs.make("arith")
    try:
        env.reset(seed=0)
        assert env.step(env.oracle_actions()[0])[0][0]["content"] == str(env.task.intermediates[0])
        env.close()
    finally:
        default_pool().close_sync()  # the process-wide pool would otherwise live until exit
