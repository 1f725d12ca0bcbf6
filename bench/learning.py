"""Does RL beat the SFT-only checkpoint? -> bench/results/learning.json + docs/img/learning.png.

For each training seed s (--seeds) and variant: `odyssey train configs/tiny.yaml` (real Docker sandboxes,
Ray, async) from the SFT warm-up checkpoint (--init-from, built by `odyssey warmup` when missing), with
rollout.seed = s: the seed of the task stream, of every sampling seed and of the held-out tasks. The
held-out evaluation before the first step is the SFT-only checkpoint, the one after the last step is RL;
both play the same held-out tasks with the same sampling seeds at the training temperature, so each seed
gives a paired difference. Reported per variant: mean over seeds and the standard error (std / sqrt(n),
n = seeds) of SFT-only and RL success, their ratio and difference, and whether the issue's target (RL >=
1.5x SFT-only, or >= +0.3 absolute) is met.

Variants: `rl_raft` is make demo's recipe (learner.advantage=raft: each group's best successful episodes;
lr 5e-5, 5 warm-up steps). `rl` is GRPO with lr 5e-5 and 3 warm-up steps (the demo's recipe before), and
`rl_outcome_only` / `rl_raft_outcome_only` the same without the process and sub-goal rewards (the ablation
on a multi-turn task: arith is calc, then answer; for raft the shaped rewards only rank a group's
successes, so without them every success of a group is kept). `--variants` runs some of them; the
results file keeps the runs of the others, each with the steps and eval episodes it was run with (see
"summary").

Task families: arith only. code-repair and long-docs have no in-process oracle for a fast SFT warm-up of
the tiny policy yet (their tools need a sandbox per transcript), so they are not in this bench.

    .venv/bin/python bench/learning.py [--variants rl_raft] [--steps 60] [--eval-episodes 256] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "learning.json"
PLOT = ROOT / "docs" / "img" / "learning.png"
RECIPE = ["learner.lr=5e-5", "learner.warmup_steps=3"]  # every variant's base; rl_raft overrides it
VARIANTS = {
    "rl": [],
    "rl_outcome_only": [
        "rewards=[{name: outcome, weight: 1.0}, {name: overlong, weight: 1.0, "
        "params: {max_completion_len: 512, soft_punish_cache: 128}}]"
    ],
    "rl_raft": ["learner.advantage=raft", "learner.lr=5e-5", "learner.warmup_steps=5"],
    "rl_raft_outcome_only": [
        "learner.advantage=raft", "learner.lr=5e-5", "learner.warmup_steps=5",
        "rewards=[{name: outcome, weight: 1.0}, {name: overlong, weight: 1.0, "
        "params: {max_completion_len: 512, soft_punish_cache: 128}}]",
    ],
}
LABELS = {
    "rl": "RL, GRPO\n(all rewards)",
    "rl_outcome_only": "RL, GRPO\n(outcome only)",
    "rl_raft": "RL, RAFT (best of group)\n= make demo",
    "rl_raft_outcome_only": "RL, RAFT\n(outcome only)",
}


def run(variant: str, seed: int, steps: int, eval_episodes: int, init_from: str, out: Path) -> dict:
    from rich.console import Console

    from rl.config import load_config
    from rl.train.loop import Trainer

    run_dir = out / f"{variant}_seed{seed}"
    overrides = [
        f"model.init_from={init_from}",
        f"logging.run_dir={run_dir}",
        f"learner.steps={steps}",
        f"rollout.seed={seed}",
        f"orchestrator.eval_every={steps}",
        f"orchestrator.eval_episodes={eval_episodes}",
        "orchestrator.checkpoint_every=0",
        *RECIPE,
        *VARIANTS[variant],
    ]
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)
    t0 = time.perf_counter()
    Trainer(cfg, console=Console(file=io.StringIO())).run()
    evals = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == steps, (first["step"], last["step"])
    rec = {
        "variant": variant,
        "seed": seed,
        "steps": steps,
        "eval_episodes": eval_episodes,
        "sft": {k: first[k] for k in ("success", "greedy", "pass@4", "episodes", "infra_errors")},
        "rl": {k: last[k] for k in ("success", "greedy", "pass@4", "episodes", "infra_errors")},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(f"  {variant} seed {seed}: SFT-only {first['success']:.3f} -> RL {last['success']:.3f} "
          f"(greedy {first['greedy']:.2f} -> {last['greedy']:.2f}; {rec['wall_s']:.0f} s)", flush=True)
    return rec


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def summarize(runs: list[dict]) -> dict:
    out = {}
    for variant in VARIANTS:
        rs = [r for r in runs if r["variant"] == variant]
        if not rs:
            continue
        sft, rl = [r["sft"]["success"] for r in rs], [r["rl"]["success"] for r in rs]
        diff = [b - a for a, b in zip(sft, rl)]
        (ms, ses), (mr, ser), (md, sed) = mean_se(sft), mean_se(rl), mean_se(diff)
        out[variant] = {
            "seeds": [r["seed"] for r in rs],
            "steps": rs[0]["steps"], "eval_episodes": rs[0].get("eval_episodes", 64),
            "sft_success_mean": ms, "sft_success_se": ses,
            "rl_success_mean": mr, "rl_success_se": ser,
            "diff_mean": md, "diff_se": sed,
            "ratio_rl_over_sft": mr / ms if ms > 0 else None,
            "target_met": bool(mr >= 1.5 * ms or md >= 0.3),
        }  # fmt: skip
    return out


def plot(summary: dict, runs: list[dict]) -> None:
    """Per variant, its paired SFT-only (before) and RL (after) bars: mean ± SE, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ticks, names = [], []
    for g, (variant, s) in enumerate(summary.items()):
        rs = [r for r in runs if r["variant"] == variant]
        for j, (key, color) in enumerate((("sft", "#999999"), ("rl", "#3b75af"))):
            x = 3 * g + j
            ax.bar(x, s[f"{key}_success_mean"], yerr=s[f"{key}_success_se"], capsize=5, color=color,
                   label=("SFT-only (before RL)", "after RL")[j] if g == 0 else None)
            ax.scatter([x] * len(rs), [r[key]["success"] for r in rs], color="black", s=10, zorder=3)
        ticks.append(3 * g + 0.5)
        names.append(f"{LABELS[variant]}\n{s['steps']} steps, {s['eval_episodes']} eval eps")
    ax.axhline(0.85, ls="--", color="gray", lw=1)
    ax.text(ticks[-1] + 1, 0.86, "target 0.85", ha="right", fontsize=8, color="gray")
    ax.set_xticks(ticks, names, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success (T = 1)")
    ax.legend(loc="lower right", fontsize=8)
    n = len(next(iter(summary.values()))["seeds"])
    ax.set_title(f"arith d0, tiny: SFT-only vs RL, paired per variant ({n} seeds, mean ± SE)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-episodes", type=int, default=256, help="sampled held-out episodes per eval")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--init-from", default=str(ROOT / "runs" / "tiny" / "warmup"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_learning"))
    args = ap.parse_args()
    init = Path(args.init_from)
    if not (init / "config.json").is_file():
        from rl.warmup import cli_main as warmup

        print(f"bench/learning: no warm-up checkpoint at {init}; running `odyssey warmup` first", flush=True)
        if warmup([str(ROOT / "configs" / "tiny.yaml"), "--out", str(init)]) != 0:
            return 1
    out = Path(args.out)
    kept = json.loads(RESULTS.read_text())["runs"] if RESULTS.is_file() else []
    runs = [r for r in kept if r["variant"] not in args.variants]  # each variant keeps its own steps
    for variant in args.variants:
        for seed in args.seeds:
            runs.append(run(variant, seed, args.steps, args.eval_episodes, str(init), out))
    summary = summarize(runs)
    for variant, s in summary.items():
        print(f"{variant}: SFT-only {s['sft_success_mean']:.3f} ± {s['sft_success_se']:.3f}  RL "
              f"{s['rl_success_mean']:.3f} ± {s['rl_success_se']:.3f}  RL/SFT {s['ratio_rl_over_sft']:.2f}x  "
              f"diff {s['diff_mean']:+.3f} ± {s['diff_se']:.3f}  target (>= 1.5x or +0.3) "
              f"{'met' if s['target_met'] else 'MISSED'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "bench": "learning", "family": "arith (difficulty 0)", "recipe": RECIPE,
        "variants": VARIANTS,
        "episodes_per_step": 16, "machine": platform.platform(), "summary": summary, "runs": runs,
    }, indent=2) + "\n")  # fmt: skip
    plot(summary, runs)
    print(f"wrote {RESULTS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
