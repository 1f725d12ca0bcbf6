"""User code never starves the engine (issue 40, part 1): agents, verifiers and task functions run on
threads of their own (envs/threads.py), the engine steps on its own executor, a rollout worker writes its
store and loads weights on its own. Real components throughout: the tiny policy on TorchEngine, the
OpenAI-compatible endpoint, the `agent` env, a RolloutWorker with its TrajectoryStore.

The asyncio default executor has min(32, cpus + 4) threads (6 on 2 cores). Before the fix agents ran
there beside the engine's decode step: with that many agents waiting on the policy the engine never
stepped and every episode timed out with outcome 0, and agents that hung took the threads for good.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import envs.threads as own_threads
from envs.agent_env import AgentEnv
from envs.threads import OwnThreads, OwnThreadTimeout
from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from model.tokenizer import load_tokenizer
from rl.rollout.agent_episode import run_agent_episode
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig
from rl.rollout.endpoint import PolicyEndpoint
from rl.rollout.engine import TorchEngine
from rl.rollout.tasks import Sample, Task
from rl.rollout.worker import RolloutWorker, WorkerSettings
from rl.trajectory import Trajectory, TrajectoryStore

pytestmark = pytest.mark.timeout(120)  # each takes seconds; before the fix some waited forever

DEFAULT_POOL = min(32, (os.cpu_count() or 1) + 4)  # the threads of asyncio's default executor
CFG = EpisodeConfig(max_new_tokens=8, max_episode_tokens=512, temperature=1.0)
HEALTHY_TIMEOUT_S = 30.0  # healthy agents finish in seconds; before the fix they ran into this
HUNG_TIMEOUT_S = 2.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer())


@pytest.fixture(scope="module")
def model(codec: ChatCodec) -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


# ---------------------------------------------------------------------------------------------- agents
def product_task(seed: int) -> dict:
    """A multiplication; the agent answers right when `right` says so (its own behaviour, not the model's)."""
    a, b = 3 + seed, 7
    return {"prompt": f"What is {a} times {b}?", "answer": str(a * b), "a": a, "b": b, "right": seed % 3 != 0}


def answering_agent(client, task: dict) -> str:
    """Asks the policy once (so the engine must step), then answers from the task: right or wrong on
    purpose, so the expected outcome is known whatever the random policy says."""
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    product = task["a"] * task["b"]
    return f"\\boxed{{{product if task['right'] else product + 1}}}"


GATE: dict[str, threading.Barrier] = {}


def together_agent(client, task: dict) -> str:
    """`answering_agent`, after waiting until every episode's agent is running at the same time."""
    GATE["barrier"].wait(timeout=20)
    return answering_agent(client, task)


RELEASE = threading.Event()  # hung agents wait on it: "forever", until the test lets them go


def hung_agent(client, task: dict) -> str:
    """Blocks in its thread and never returns on its own (like an agent stuck on a lock or a socket)."""
    RELEASE.wait()
    return "too late"


def sync_verifier(answer: str, truth: str, row: dict) -> float:
    """A plain-def user verifier (runs on a thread of its own)."""
    return float(re.sub(r"\\boxed\{(.*)\}", r"\1", answer) == str(truth))


@pytest.fixture
def release_hung() -> Iterator[None]:
    """Lets hung agents go after the test, and waits for every thread they held to end."""
    RELEASE.clear()
    yield
    RELEASE.set()
    for thread in own_threads.OWN_THREADS.live_threads():
        thread.join(timeout=30)


def expected(seed: int) -> float:
    return 1.0 if product_task(seed)["right"] else 0.0


def assert_scored_by_its_agent(traj: Trajectory, seed: int) -> None:
    """The episode ran: the policy generated, the agent's own answer was scored, nothing failed."""
    meta = traj.metadata
    assert traj.infra_error is None, traj.infra_error
    assert "agent_error" not in meta, meta.get("agent_error")
    assert traj.outcome == expected(seed), (seed, meta.get("agent_result"), traj.outcome)
    assert traj.n_assistant_turns == 1 and traj.n_tokens > 0


async def _episode(engine, codec, endpoint, agent, seed: int, timeout_s: float) -> Trajectory:
    env = AgentEnv(agent=agent, tasks=product_task, agent_timeout_s=timeout_s)
    return await run_agent_episode(engine, env, codec, CFG, endpoint, seed=seed)


def _worker(tmp_path: Path, model, codec, n: int, **env_kwargs) -> RolloutWorker:
    settings = WorkerSettings(
        env_id="agent",
        env_kwargs={
            "tasks": f"{__name__}:product_task",
            "agent_timeout_s": HEALTHY_TIMEOUT_S,
            **env_kwargs,
        },
        episode=CFG,
        concurrency=n,
        shared_pool=False,
        rewards=[{"name": "outcome"}],
        store_dir=str(tmp_path / "store"),
    )
    return RolloutWorker(settings, engine=TorchEngine(model), tokenizer=codec.tok)


def run_detached(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`, but the loop is closed without joining its default executor's threads: before the
    fix hung agents held those for good, and asyncio.run's exit, which joins them, never returned."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _samples(n: int) -> list[Sample]:
    return [Sample(Task("train", i, seed=i), 0, seed=100 + i) for i in range(n)]


# ---------------------------------------------------------------------------------------------- tests
def test_more_concurrent_agents_than_default_executor_threads_all_finish(tmp_path, model, codec):
    """`odyssey rollout` with more concurrent agent episodes than the default executor has threads: every
    agent runs at the same time (a barrier of all of them), the engine serves them all, and each stored
    episode is scored by its own agent's answer. Before the fix: every episode an agent_error, outcome 0."""
    n = DEFAULT_POOL + 6
    GATE["barrier"] = threading.Barrier(n)
    worker = _worker(tmp_path, model, codec, n, agent=f"{__name__}:together_agent")

    async def run() -> dict:
        try:
            return await worker.run(_samples(n))
        finally:
            await worker.close()

    report = asyncio.run(run())
    stored = {t.metadata["seed"]: t for t in TrajectoryStore(tmp_path / "store").read_all()}
    assert sorted(stored) == list(range(n))
    for seed, traj in stored.items():
        assert_scored_by_its_agent(traj, seed)
        assert traj.rewards["outcome"] == expected(seed)
    assert report["infra_errors"] == 0 and report["generated_tokens"] > 0


def test_hung_agents_beside_healthy_ones(model, codec, release_hung):
    """More hung agents than the default executor has threads, beside healthy ones: the healthy ones finish
    with their own outcome, the hung ones come back by their own agent_timeout_s as scored agent errors,
    and episodes started afterwards (the hung threads still blocked) still get threads and the engine."""
    n_hung, n_healthy = DEFAULT_POOL + 2, 4

    async def run() -> None:
        endpoint = PolicyEndpoint()
        await endpoint.start()
        engine = TorchEngine(model)
        try:
            hung = [_episode(engine, codec, endpoint, hung_agent, s, HUNG_TIMEOUT_S) for s in range(n_hung)]
            healthy = [
                _episode(engine, codec, endpoint, answering_agent, s, HEALTHY_TIMEOUT_S)
                for s in range(n_hung, n_hung + n_healthy)
            ]
            first = await asyncio.gather(*hung, *healthy)
            for traj in first[:n_hung]:
                assert traj.infra_error is None and traj.outcome == 0.0
                assert "agent_timeout_s=2 s" in traj.metadata["agent_error"], traj.metadata["agent_error"]
                assert traj.metadata["wall_s"] < HEALTHY_TIMEOUT_S  # its own timeout ended it
            for traj in first[n_hung:]:
                assert_scored_by_its_agent(traj, traj.metadata["seed"])
            # the hung threads were never killed: abandoned and counted, and still blocked ...
            assert sum(h.what == "agent" for h in own_threads.hung_threads()) == n_hung
            later = await asyncio.wait_for(  # ... while more episodes than the default pool's threads run
                asyncio.gather(
                    *(
                        _episode(engine, codec, endpoint, answering_agent, s, HEALTHY_TIMEOUT_S)
                        for s in range(100, 100 + DEFAULT_POOL + 2)
                    )
                ),
                HEALTHY_TIMEOUT_S,
            )
            for traj in later:
                assert_scored_by_its_agent(traj, traj.metadata["seed"])
            assert endpoint.open_episodes == 0
        finally:
            await endpoint.stop()
            await engine.aclose()

    run_detached(run())
    RELEASE.set()  # the hung agents return at last; their threads end and stop counting
    for thread in own_threads.OWN_THREADS.live_threads():
        thread.join(timeout=30)
    assert own_threads.hung_threads() == []


def test_hung_threads_are_bounded_and_reclaimed(model, codec, release_hung, monkeypatch):
    """Hung threads cannot be killed, so they are bounded: with `max_hung` of them alive, the next episode
    is not started (an infrastructure error naming the hung agents and the fix, not a scored failure);
    once they return, episodes run again."""
    monkeypatch.setattr(own_threads, "OWN_THREADS", OwnThreads(max_hung=2))

    async def run() -> tuple[list[Trajectory], Trajectory, Trajectory]:
        endpoint = PolicyEndpoint()
        await endpoint.start()
        engine = TorchEngine(model)
        try:
            hung = await asyncio.gather(
                *(_episode(engine, codec, endpoint, hung_agent, s, HUNG_TIMEOUT_S) for s in range(2))
            )
            refused = await _episode(engine, codec, endpoint, answering_agent, 4, HEALTHY_TIMEOUT_S)
            RELEASE.set()
            for thread in own_threads.OWN_THREADS.live_threads():
                await asyncio.to_thread(thread.join, 30)
            again = await _episode(engine, codec, endpoint, answering_agent, 4, HEALTHY_TIMEOUT_S)
            return hung, refused, again
        finally:
            await endpoint.stop()
            await engine.aclose()

    hung, refused, again = run_detached(run())
    assert all(t.outcome == 0.0 and "agent_timeout_s" in t.metadata["agent_error"] for t in hung)
    assert refused.outcome is None and refused.metadata["infra_source"] == "env"
    assert "2 abandoned threads are still running" in refused.infra_error
    assert "hung_agent" in refused.infra_error and "Fix the code that hangs" in refused.infra_error
    assert_scored_by_its_agent(again, 4)


def test_odyssey_work_never_waits_on_the_default_executor(tmp_path, model, codec):
    """Someone else's code has taken every thread of the default executor (an async reward or verifier
    calling asyncio.to_thread on something that blocks): episodes still reset (task function), generate
    (engine), get scored (a plain-def verifier), are stored, and weights still load."""
    n = 3
    worker = _worker(
        tmp_path, model, codec, n, agent=f"{__name__}:answering_agent", verifier=f"{__name__}:sync_verifier"
    )

    async def run() -> tuple[dict, int]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        taken = threading.Event()
        stuck = loop.run_in_executor(None, taken.wait)  # the default executor's only thread, taken
        try:
            report = await asyncio.wait_for(worker.run(_samples(n), return_trajectories=True), 60)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            version = await asyncio.wait_for(worker.update_weights(state, 7), 60)
            return report, version
        finally:
            taken.set()
            await stuck
            await worker.close()

    report, version = asyncio.run(run())
    assert version == 7
    for traj in report["trajectories"]:
        assert_scored_by_its_agent(traj, traj.metadata["seed"])
    assert len(TrajectoryStore(tmp_path / "store").read_all()) == n


def test_own_thread_timeout_is_not_the_functions_own_timeout_error():
    """The runner's timeout is `OwnThreadTimeout`; a TimeoutError the function raises itself (a socket
    timeout inside an agent) reaches the caller as that error, and a BaseException as a RuntimeError."""

    def times_out() -> None:
        raise TimeoutError("socket timed out")

    def exits() -> None:
        raise SystemExit(3)

    async def run() -> None:
        runner = OwnThreads(max_hung=1)
        gate = threading.Event()
        with pytest.raises(TimeoutError, match="socket timed out") as own:
            await runner.run(times_out, timeout_s=30, what="agent")
        assert not isinstance(own.value, OwnThreadTimeout)
        with pytest.raises(RuntimeError, match="SystemExit"):
            await runner.run(exits, timeout_s=30, what="agent")
        with pytest.raises(OwnThreadTimeout, match="ran past its timeout of 0.2 s"):
            await runner.run(gate.wait, timeout_s=0.2, what="agent")
        assert [h.what for h in runner.hung()] == ["agent"]
        gate.set()
        for thread in runner.live_threads():
            await asyncio.to_thread(thread.join, 30)
        assert runner.hung() == [] and await runner.run(len, "abc", timeout_s=None, what="task") == 3

    asyncio.run(run())


def test_no_odyssey_code_uses_the_default_executor():
    """The class, not the instance: nothing in rl/ or envs/ puts work on the event loop's default executor
    (asyncio.to_thread, run_in_executor(None, ...)), which user code may fill. Use envs.threads for code
    that may hang, or an executor of the component's own."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"asyncio\.to_thread\(|run_in_executor\(\s*None")
    offenders = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for folder in ("rl", "envs")
        for path in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == [], "\n".join(offenders)
