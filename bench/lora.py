"""LoRA vs full fine-tuning on the real SmolLM2-135M-Instruct -> bench/results/lora.json.

One learner step (`Learner.step`: forward, backward, clip, AdamW) on the same batch of scored trajectories,
with `learner.lora` (adapters of rank 8 on every attention and MLP projection) and without (every weight
trains), with the same torch thread count.
- Memory: each variant in its own subprocess (build, two steps), so its peak RSS (VmHWM) is its own; also the
  RSS once the learner is built, the trainable parameters and the optimizer state's bytes.
- Speed: both learners in one process, one warm-up step each, then timed steps alternating (full, lora, full,
  lora, ...) so both see the same machine load: median step seconds and learner tokens/s, and the step's
  CPU seconds (time.process_time) and tokens per CPU second.
Reported: both variants and the ratios lora / full.

    python bench/lora.py                       # 16 x 136 tokens: 1 warm-up + 3 timed steps per variant
    python bench/lora.py --steps 2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "lora.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "alpha": 16.0, "target_modules": TARGETS, "dropout": 0.0}


def _rss_kib(field: str) -> int:
    """VmHWM (peak) or VmRSS (now) of this process, KiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _batch(tokenizer, n: int, prompt: int, generated: int) -> list:
    """n scored single-turn trajectories (groups of 2, rewards 0 / 1) of random token ids."""
    import numpy as np

    from model.tokenizer import tokenizer_fingerprint
    from rl.trajectory import Trajectory, TurnSpan

    rng = np.random.default_rng(0)
    fp = tokenizer_fingerprint(tokenizer)
    out = []
    for k in range(n):
        T = prompt + generated
        lp = np.full(T, np.nan, np.float32)
        lp[prompt:] = -3.0 + rng.normal(0, 0.1, generated)
        out.append(Trajectory(
            tokens=rng.integers(10, len(tokenizer), T).astype(np.int32),
            loss_mask=np.r_[np.zeros(prompt), np.ones(generated)].astype(np.uint8), rollout_logprobs=lp,
            routed_experts=None, turns=[TurnSpan("prompt", 0, prompt), TurnSpan("assistant", prompt, T)],
            rewards={"total": float(k % 2)}, turn_rewards=[0.0],
            metadata={"group_id": f"g{k // 2}", "tokenizer": fp}, terminated=True))
    return out


def build(variant: str, n: int, prompt: int, generated: int):
    """(learner, batch) for `variant` (full | lora) on SmolLM2."""
    from model.embedded import resolve_hf_path
    from model.tokenizer import policy_tokenizer
    from rl.config import RunConfig
    from rl.learner import Learner

    learner_cfg = {"group_size": 2, "lr": 1e-5, "micro_batch_tokens": n * (prompt + generated)}
    if variant == "lora":
        learner_cfg["lora"] = LORA
    cfg = RunConfig.model_validate({"model": {"hf_path": resolve_hf_path("smollm2-135m-instruct")},
                                    "learner": learner_cfg})
    tok = policy_tokenizer(cfg.model.hf_path)
    return Learner(cfg, tokenizer=tok), _batch(tok, n, prompt, generated)


def memory_of(variant: str, n: int, prompt: int, generated: int) -> dict:
    """In this (child) process: build the learner, two steps; its memory figures."""
    import torch

    learner, trajs = build(variant, n, prompt, generated)
    built_kib = _rss_kib("VmRSS")
    for _ in range(2):
        learner.step(trajs)
    opt_bytes = sum(t.numel() * t.element_size() for s in learner.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
    return {
        "trainable_params": sum(p.numel() for p in learner.params),
        "optimizer_state_mib": opt_bytes / 2**20,
        "rss_built_mib": built_kib / 1024,
        "peak_rss_mib": _rss_kib("VmHWM") / 1024,
    }


def timings(steps: int, n: int, prompt: int, generated: int) -> dict[str, dict]:
    """In this process: both learners, one warm-up step each, then `steps` timed steps of each,
    alternating (full, lora, full, lora, ...), so both see the same machine load."""
    learners = {v: build(v, n, prompt, generated) for v in ("full", "lora")}
    out: dict[str, dict] = {v: {"step_s": [], "step_cpu_s": [], "tokens_per_step": 0.0} for v in learners}
    for learner, trajs in learners.values():
        learner.step(trajs)
    for _ in range(steps):
        for v, (learner, trajs) in learners.items():
            t0, c0 = time.perf_counter(), time.process_time()
            m = learner.step(trajs)
            out[v]["step_s"].append(time.perf_counter() - t0)
            out[v]["step_cpu_s"].append(time.process_time() - c0)
            out[v]["tokens_per_step"] = m["tokens"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed learner steps per variant")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--generated", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-of", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    shape = (args.trajectories, args.prompt, args.generated)
    if args.memory_of:
        print(json.dumps(memory_of(args.memory_of, *shape)))
        return 0
    memory = {}
    for variant in ("full", "lora"):
        cmd = [sys.executable, __file__, "--memory-of", variant, "--trajectories", str(args.trajectories),
               "--prompt", str(args.prompt), "--generated", str(args.generated),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        memory[variant] = json.loads(out.strip().splitlines()[-1])
    times = timings(args.steps, *shape)
    summary = {}
    for variant, t in times.items():
        step_s, cpu_s = statistics.median(t["step_s"]), statistics.median(t["step_cpu_s"])
        summary[variant] = {
            "median_step_s": step_s,
            "tokens_per_s": t["tokens_per_step"] / step_s,
            "median_step_cpu_s": cpu_s,
            "tokens_per_cpu_s": t["tokens_per_step"] / cpu_s,
            **memory[variant],
        }
    f, lo = summary["full"], summary["lora"]
    ratios = {
        "tokens_per_s": lo["tokens_per_s"] / f["tokens_per_s"],
        "tokens_per_cpu_s": lo["tokens_per_cpu_s"] / f["tokens_per_cpu_s"],
        "peak_rss": lo["peak_rss_mib"] / f["peak_rss_mib"],
        "trainable_params": lo["trainable_params"] / f["trainable_params"],
        "optimizer_state": lo["optimizer_state_mib"] / f["optimizer_state_mib"],
    }
    result = {
        "model": "smollm2-135m-instruct (fp32 master weights, CPU)",
        "lora": LORA,
        "batch": {"trajectories": args.trajectories, "prompt": args.prompt, "generated": args.generated},
        "threads": args.threads,
        "timed_steps": args.steps,
        "summary": summary,
        "lora_over_full": ratios,
        "steps": times,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':8} {'tokens/s':>10} {'step s':>8} {'tok/CPU-s':>10} {'peak RSS MiB':>13} "
          f"{'trainable':>12} {'opt MiB':>9}")
    for v, s in summary.items():
        print(f"{v:8} {s['tokens_per_s']:10.1f} {s['median_step_s']:8.2f} {s['tokens_per_cpu_s']:10.1f} "
              f"{s['peak_rss_mib']:13.0f} {s['trainable_params']:12d} {s['optimizer_state_mib']:9.1f}")
    print("lora / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
