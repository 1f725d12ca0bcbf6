"""long-docs trajectory size and tool latency: a reader policy that reads every page, in a real sandbox.

    python bench/envs_long_docs.py [--difficulty 1] [--calls-per-turn 8]

Measures, for one episode: observation characters and tokens (Odyssey's tokenizer), turns, wall time,
and the mean latency of one `read_doc` call in the sandbox against the same script run as a host
subprocess (the baseline, measured in the same run). Updates the entry for the difficulty in
bench/results/envs_long_docs.json (difficulty 2 takes ~2 min: 640 reads, ~1.6M tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402
from envs.sandbox_scripts import script_source  # noqa: E402
from envs.tasks.long_docs import reader_actions  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from sandbox.pool import SandboxPool  # noqa: E402


def host_read_latency(task, n: int) -> float:
    """Baseline: the same docs.py `read` run as a host subprocess, mean seconds per call."""
    with tempfile.TemporaryDirectory() as d:
        for name, text in task.docs.items():
            Path(d, name).write_text(text)
        name = next(iter(task.docs))
        src = script_source("docs")
        t0 = time.perf_counter()
        for _ in range(n):
            subprocess.run(
                [sys.executable, "-c", src, d, "read", name, "1", str(task.config.page_lines)],
                capture_output=True,
                check=True,
            )
        return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--calls-per-turn", type=int, default=8)
    args = ap.parse_args()

    tok = load_tokenizer()
    pool = SandboxPool(size=1)
    pool.start_sync()
    try:
        env = envs.make("long-docs", difficulty=args.difficulty, sandbox_pool=pool, max_turns=100_000)
        t0 = time.perf_counter()
        env.reset(seed=0)
        reset_s = time.perf_counter() - t0
        actions = reader_actions(env.task, calls_per_turn=args.calls_per_turn)
        obs_chars = obs_tokens = act_tokens = 0
        step_s: list[float] = []
        t1 = time.perf_counter()
        for a in actions:
            ts = time.perf_counter()
            obs, reward, term, trunc, info = env.step(a)
            step_s.append(time.perf_counter() - ts)
            act_tokens += len(tok(a)["input_ids"])
            for o in obs:
                obs_chars += len(o["content"])
                obs_tokens += len(tok(o["content"])["input_ids"])
            if term or trunc:
                break
        episode_s = time.perf_counter() - t1
        n_calls = sum(a.count("<tool_call>") for a in actions[:-1])
        sandbox_call_s = sum(step_s[:-1]) / max(n_calls, 1)
        host_call_s = host_read_latency(env.task, n=min(n_calls, 20))
        result = {
            "difficulty": args.difficulty,
            "config": env.task.config.__dict__,
            "turns": len(step_s),
            "read_calls": n_calls,
            "success": info.get("success"),
            "subgoals": env.achieved_subgoals,
            "observation_chars": obs_chars,
            "observation_tokens": obs_tokens,
            "action_tokens": act_tokens,
            "trajectory_tokens_approx": obs_tokens + act_tokens,
            "reset_s": round(reset_s, 3),
            "episode_s": round(episode_s, 3),
            "median_step_s": round(statistics.median(step_s), 4),
            "sandbox_read_call_s": round(sandbox_call_s, 4),
            "host_read_call_s (baseline)": round(host_call_s, 4),
            "sandbox_over_host": round(sandbox_call_s / host_call_s, 2),
        }
        env.close()
    finally:
        pool.close_sync()
    out = ROOT / "bench" / "results" / "envs_long_docs.json"
    runs = json.loads(out.read_text()) if out.exists() else {}  # one entry per difficulty
    runs[f"difficulty_{args.difficulty}"] = result
    out.write_text(json.dumps(runs, indent=2) + "\n")
    for k, v in result.items():
        print(f"{k:30s} {v}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
