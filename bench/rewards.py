"""Async rewards keep the rollout going: 32 episodes scored by an LLM-judge reward that answers after a delay.

Cases, each on the same RolloutWorker (tiny TorchEngine policy, dataset-qa rows, 8 episodes played at once),
against a local stub judge (tests/judge_stub.py, loopback) that answers after `--delay` seconds:
  no_judge:       rewards = [outcome]                                   (the baseline)
  async_judge:    + tests.custom_rewards:judge, `async def` (httpx): awaited while other episodes play
  blocking_judge: + tests.custom_rewards:blocking_judge, a plain def (urllib): blocks the event loop

Reports wall time and episodes/s per case, and the ratios async/no_judge and blocking/async (time: the
extra wall time a judge costs). Writes bench/results/rewards.json.

    .venv/bin/python bench/rewards.py [--episodes 32] [--delay 0.5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the `rewards` package, not this file

from envs.dataset import TaskDataset  # noqa: E402
from rl.rollout.agent_loop import EpisodeConfig  # noqa: E402
from rl.rollout.tasks import TaskStream  # noqa: E402
from rl.rollout.worker import RolloutWorker, WorkerSettings  # noqa: E402
from tests.judge_stub import StubJudge  # noqa: E402


def samples(n: int, tmp: Path) -> list:
    path = tmp / "numbers.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Say the number {i}.", "answer": str(i)}) + "\n" for i in range(n))
    )
    return TaskStream(0, "train", dataset=TaskDataset.load(path, eval_size=0)).first_samples(n, group_size=1)


def run_case(engine, rewards: list[dict], todo: list) -> dict:
    settings = WorkerSettings(
        env_id="dataset-qa",
        env_kwargs={"verifier": "exact-match", "max_turns": 1},
        episode=EpisodeConfig(max_new_tokens=12, max_episode_tokens=256, max_turns=1),
        concurrency=8,
        shared_pool=False,
        rewards=rewards,
    )
    worker = RolloutWorker(settings, 0, engine=engine)
    t0 = time.perf_counter()
    out = asyncio.run(worker.run(todo))
    wall = time.perf_counter() - t0
    assert out["episodes"] == len(todo) and out["reward_errors"] == 0, out
    return {"wall_s": wall, "episodes_per_s": len(todo) / wall, "generated_tokens": out["generated_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds the stub judge takes per request")
    ap.add_argument("--repeats", type=int, default=2, help="best of")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rewards.json"))
    args = ap.parse_args()

    stub = StubJudge(delay_s=args.delay)
    url = stub.url + "/judge"
    cases = {
        "no_judge": [{"name": "outcome"}],
        "async_judge": [{"name": "outcome"}, {"name": "tests.custom_rewards:judge", "params": {"url": url}}],
        "blocking_judge": [
            {"name": "outcome"},
            {"name": "tests.custom_rewards:blocking_judge", "params": {"url": url}},
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        todo = samples(args.episodes, Path(tmp))
        engine = RolloutWorker(WorkerSettings(env_id="dataset-qa", shared_pool=False), 0).engine
        run_case(engine, cases["no_judge"], todo[:8])  # warm-up (kernels, allocator)
        results = {}
        for name, rewards in cases.items():
            runs = [run_case(engine, rewards, todo) for _ in range(args.repeats)]
            results[name] = min(runs, key=lambda r: r["wall_s"])
            r = results[name]
            print(f"{name:15s} {r['wall_s']:6.2f} s  {r['episodes_per_s']:5.2f} episodes/s")
    stub.close()
    ratios = {
        "async_vs_no_judge_time": results["async_judge"]["wall_s"] / results["no_judge"]["wall_s"],
        "blocking_vs_async_time": results["blocking_judge"]["wall_s"] / results["async_judge"]["wall_s"],
        "judge_serial_s": args.episodes * args.delay,
    }
    print(
        f"async judge costs {ratios['async_vs_no_judge_time']:.2f}x the no-judge wall time; a blocking judge "
        f"{ratios['blocking_vs_async_time']:.2f}x the async one (the judge's calls one after another: "
        f"{ratios['judge_serial_s']:.0f} s)"
    )
    record = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": {
            "episodes": args.episodes,
            "judge_delay_s": args.delay,
            "episodes_played_at_once": 8,
            "policy": "tiny TorchEngine, dataset-qa rows, max_new_tokens 12",
            "best_of": args.repeats,
        },
        "note": "measured on the shared 2-core development machine under load from other jobs; the ratios "
        "are what count",
        "cases": results,
        "ratios": ratios,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
