"""An async LLM-judge reward in TRL's form against a slow local stub HTTP server (loopback only), scoring 32
real episodes of a RolloutWorker (real TorchEngine, dataset-qa rows): episodes keep being played while judges
wait, judges run concurrently, and a hung judge times out into a reward_error (never a 0). The throughput
figure is bench/rewards.py's, not this test's."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from envs.dataset import TaskDataset
from rl.rollout.agent_loop import EpisodeConfig
from rl.rollout.tasks import TaskStream
from rl.rollout.worker import RolloutWorker, WorkerSettings
from tests.judge_stub import StubJudge


@pytest.fixture(scope="module")
def judge_server():
    stub = StubJudge(delay_s=1.0)
    yield stub
    stub.close()


def _samples(tmp_path, n: int) -> list:
    rows = [{"prompt": f"Say the number {i}.", "answer": str(i)} for i in range(n)]
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = TaskDataset.load(path, eval_size=0, seed=0)
    return TaskStream(0, "train", dataset=data).first_samples(n, group_size=1)


def _settings(rewards: list[dict], concurrency: int) -> WorkerSettings:
    return WorkerSettings(
        env_id="dataset-qa",
        env_kwargs={"verifier": "exact-match", "max_turns": 1},
        episode=EpisodeConfig(max_new_tokens=12, max_episode_tokens=256, max_turns=1),
        concurrency=concurrency,
        shared_pool=False,
        rewards=rewards,
    )


async def _run_with_progress(worker: RolloutWorker, samples: list) -> tuple[dict, list[tuple[float, int]]]:
    """worker.run(samples) while recording (time, generated tokens so far) every 20 ms."""
    trace: list[tuple[float, int]] = []
    task = asyncio.ensure_future(worker.run(samples, return_trajectories=True))
    while not task.done():
        trace.append((time.monotonic(), (await worker.progress())["generated_tokens"]))
        await asyncio.sleep(0.02)
    return task.result(), trace


@pytest.mark.slow
def test_async_judge_does_not_block_episodes_and_a_hung_judge_is_a_reward_error(tmp_path, judge_server):
    specs = [
        {"name": "outcome"},
        {
            "name": "tests.custom_rewards:judge",
            "params": {"url": judge_server.url + "/judge"},
            "timeout_s": 30,
        },
        {"name": "tests.custom_rewards:trl_numeric", "key": "trl"},
        {"name": "tests.custom_rewards:traj_numeric", "key": "traj"},
    ]
    worker = RolloutWorker(_settings(specs, concurrency=8), 0)
    try:
        out, trace = asyncio.run(_run_with_progress(worker, _samples(tmp_path, 32)))
        trajs = out["trajectories"]
        assert len(trajs) == 32 and out["reward_errors"] == 0 and out["infra_errors"] == 0
        assert all({"judge", "trl", "traj", "total"} <= set(t.rewards) for t in trajs)
        assert all(
            t.rewards["trl"] == t.rewards["traj"] for t in trajs
        )  # the two forms agree on real episodes
        assert len(judge_server.windows) == 32 and judge_server.peak >= 2  # judges ran concurrently

        def progressed_during(lo: float, hi: float) -> bool:
            inside = [tokens for t, tokens in trace if lo < t < hi]
            return len(inside) >= 2 and inside[-1] > inside[0]

        # while a judge request waited at the server, the engine kept generating other episodes' tokens
        busy = [w for w in judge_server.windows if progressed_during(*w)]
        assert busy, f"no judge window saw generation progress ({len(trace)} progress samples)"

        hung_specs = [
            {"name": "outcome"},
            {
                "name": "tests.custom_rewards:judge",
                "params": {"url": judge_server.url + "/hang"},
                "timeout_s": 1.0,
            },
        ]
        hung = RolloutWorker(_settings(hung_specs, concurrency=4), 1, engine=worker.engine)
        out = asyncio.run(hung.run(_samples(tmp_path, 4), return_trajectories=True))
        assert out["reward_errors"] == 4 and out["rewards"]["errors_by_key"] == {"judge": 4}
        for t in out["trajectories"]:
            assert t.rewards == {} and t.infra_error is None
            assert t.reward_error == (
                "reward 'judge' (tests.custom_rewards:judge) timed out after 1 s (timeout_s); not scored"
            )
    finally:
        asyncio.run(worker.close())
