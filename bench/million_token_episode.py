"""The million-token episode on CPU: produced through the policy engine, scored, stored and packed (issue 15).

    .venv/bin/python bench/million_token_episode.py                      # configs/stage_1m_tiny.yaml, ~1 h
    .venv/bin/python bench/million_token_episode.py --target-tokens 20000 --out /tmp/x.json   # a quick run

One long-docs episode of the config's first training task, in a real Docker sandbox, through the rollout
worker (env, rewards, store) on the config's TorchEngine. Its policy is a scripted reader
(rl/rollout/scripted.py): each turn reads the next page (envs/tasks/long_docs.reader_actions) until the
conversation holds --target-tokens tokens, then answers; every turn is teacher-forced through the engine,
so the stored trajectory carries the model's own log-probs and routed experts of every token (chunked
prefill: `TorchEngine.prefill_chunk_size` tokens per forward over the growing cache). Then the trajectory is
read back from the store, validated as the learner validates it and packed with the learner's functions
(pack, collate with routing replay, the windows of `learner.sequence_chunk_tokens`). Its learner step is
not run here (hours on 2 cores; docs/long_context.md has the fit): the JSON records what it would be given.

Writes --out (default bench/results/million_token_episode.json): tokens, turns, rewards, seconds per phase,
the engine's prefill throughput, peak RSS, the store file's size and the packed micro-batch's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.tasks.long_docs import reader_actions  # noqa: E402
from model.sequence_chunks import plan_windows  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from rl.config import load_config  # noqa: E402
from rl.learner.batch import check_trajectory, to_sample  # noqa: E402
from rl.learner.packing import collate, pack  # noqa: E402
from rl.rollout.agent_loop import ChatCodec  # noqa: E402
from rl.rollout.engine import GenerationRequest  # noqa: E402
from rl.rollout.engines import build_engine  # noqa: E402
from rl.rollout.scripted import TeacherForcedEngine, conversation_tokens  # noqa: E402
from rl.rollout.tasks import task_stream  # noqa: E402
from rl.rollout.worker import RolloutWorker, WorkerSettings  # noqa: E402
from rl.trajectory import TrajectoryStore  # noqa: E402

OUT = ROOT / "bench" / "results" / "million_token_episode.json"


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Reader:
    """The scripted reader: the next page each turn until the conversation holds `target` tokens (or every
    page is read), then the answer. Prints a progress line every `every` turns."""

    def __init__(self, task, target: int, every: int = 10) -> None:
        *self.pages, self.answer = reader_actions(task)
        self.target, self.every = target, every
        self.turns, self.t0 = 0, time.perf_counter()

    def __call__(self, request: GenerationRequest) -> str:
        n = conversation_tokens(request)
        self.turns += 1
        if self.turns % self.every == 0:
            dt = time.perf_counter() - self.t0
            print(f"turn {self.turns}: {n:,} tokens in the conversation, {dt:.0f} s, {n / dt:.0f} tok/s",
                  flush=True)  # fmt: skip
        if n >= self.target or self.turns > len(self.pages):
            return self.answer
        return self.pages[self.turns - 1]


def produce(cfg, settings: WorkerSettings, target: int) -> dict:
    """Play, score and store the episode (the worker stores it); its production figures."""
    tok = load_tokenizer()
    codec = ChatCodec(tok)
    engine, _ = build_engine(settings, codec.decode)
    stream = task_stream(cfg, "train")
    sample = stream.samples(stream.task(0), 1)[0]

    async def play() -> dict:
        probe = RolloutWorker(settings, engine=engine, tokenizer=tok)
        env = probe.make_env()  # builds the task the worker's env will reset to (leases nothing)
        task = env.generate_task(sample.task.seed, sample.task.reset_options())
        env.close()
        worker = RolloutWorker(settings, engine=TeacherForcedEngine(engine, codec, Reader(task, target)),
                               tokenizer=tok)  # fmt: skip
        try:
            return await worker.run([sample])
        finally:
            await worker.close()

    print(f"producing one episode past {target:,} tokens ({cfg.env.id}, model {cfg.model.preset}, prefill "
          f"chunks of {engine.prefill_chunk_size}) into {settings.store_dir}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    report = asyncio.run(play())
    stats = engine.stats
    return {
        "episode_s": round(time.perf_counter() - t0, 1),
        "engine": {"prefill_tokens": stats["prefill_tokens"], "forwards": stats["forwards"],
                   "forward_s": round(stats["forward_s"], 1),
                   "prefill_tok_per_s": round(stats["prefill_tokens"] / max(stats["forward_s"], 1e-9), 1),
                   "prefill_chunk_size": engine.prefill_chunk_size},
        "worker_report": {k: report[k] for k in ("episodes", "infra_errors") if k in report},
        "peak_rss_gib": round(peak_rss_gib(), 2),
    }  # fmt: skip


def read_and_pack(cfg, store_dir: Path) -> dict:
    """Read the episode back, validate and pack it with the learner's functions, and hand it to the
    learner's batch preparation (selection and advantages: what its step would train on)."""
    from rl.learner import Learner

    t0 = time.perf_counter()
    (traj,) = TrajectoryStore(store_dir).read_all()
    read_s = time.perf_counter() - t0
    learner = Learner(cfg)
    t1 = time.perf_counter()
    check_trajectory(traj, 0, learner.facts, need_routing=cfg.learner.routing_replay)
    s = to_sample(traj, 0)
    bins = pack([len(s.input_ids)], cfg.learner.micro_batch_tokens)
    mb = collate([s], with_replay=cfg.learner.routing_replay)
    chunk = cfg.learner.sequence_chunk_tokens
    windows = plan_windows([mb.n_tokens], chunk) if chunk else []
    pack_s = time.perf_counter() - t1
    prepared = learner.prepare([traj])
    n = len(traj.tokens)
    return {
        "trajectory": {
            "tokens": n,
            "past_1m": n > 1_048_576,
            "generated_tokens": int(traj.loss_mask.sum()),
            "turns": len(traj.metadata.get("finish_reasons", [])),
            "infra_error": traj.infra_error,
            "outcome": traj.outcome,
            "rewards": {k: float(v) for k, v in traj.rewards.items()},
            "truncation": traj.metadata.get("truncation"),
            "has_logprobs_and_routes": traj.rollout_logprobs is not None and traj.routed_experts is not None,
            "store_bytes": sum(p.stat().st_size for p in store_dir.glob("*")),
        },
        "store_read_s": round(read_s, 2),
        "pack_s": round(pack_s, 2),
        "packed": {"micro_batches": len(bins), "input_tokens": mb.n_tokens, "scored_tokens": mb.n_scored,
                   "cu_seqlens": mb.cu_seqlens.tolist(),
                   "replay_shape": list(mb.replay.shape) if mb.replay is not None else None,
                   "sequence_chunk_tokens": chunk, "windows": len(windows)},
        "learner_batch": {"advantage": cfg.learner.advantage, "samples": len(prepared.samples),
                          "scored_tokens": int(sum(x.n_scored for x in prepared.samples))},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "stage_1m_tiny.yaml"))
    ap.add_argument("--target-tokens", type=int, default=1_048_576 + 1)
    ap.add_argument("--run-dir", default=None, help="default: the config's logging.run_dir + /episode")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--from-store", action="store_true",
                    help="do not play: read, pack and prepare the episode already in the run dir's store, "
                    "keeping the production figures of --out")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.max_tokens <= args.target_tokens:
        raise SystemExit(f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room past --target-tokens="
                         f"{args.target_tokens}: raise it")  # fmt: skip
    run_dir = Path(args.run_dir or Path(cfg.logging.run_dir) / "episode").resolve()
    store_dir = run_dir / "trajectories"
    if args.from_store:
        production = json.loads(args.out.read_text())["production"]
    else:
        if store_dir.exists() and any(store_dir.iterdir()):
            raise SystemExit(f"{store_dir} is not empty: give a new --run-dir (or --from-store)")
        production = produce(cfg, WorkerSettings.from_config(cfg, str(store_dir)), args.target_tokens)
    result = {
        "config": os.path.relpath(Path(args.config).resolve(), ROOT),
        "overrides": args.overrides,
        "target_tokens": args.target_tokens,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch_threads": torch.get_num_threads(), "load_average_at_end": list(os.getloadavg())},
        "production": production,
        **read_and_pack(cfg, store_dir),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    t = result["trajectory"]
    ok = t["tokens"] > args.target_tokens and t["infra_error"] is None and t["has_logprobs_and_routes"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
