"""Does RL beat the SFT-only checkpoint? -> bench/results/learning.json + docs/img/learning.png.

For each task family (--families), training seed s (--seeds) and variant: `odyssey train <family config>`
(Ray, async, real Docker sandboxes where the env has tools) from the family's SFT warm-up checkpoint
(`odyssey warmup`: a no-op when it holds the recipe), with rollout.seed = s: the seed of the task stream,
of every sampling seed and of the held-out tasks. The held-out evaluation before the first step is the
SFT-only checkpoint, the one after the last step is RL; both play the same held-out tasks with the same
sampling seeds at the training temperature, so each seed gives a paired difference. Reported per family
and variant: mean over seeds and the standard error (std / sqrt(n), n = seeds) of SFT-only and RL
success, their ratio and difference, and whether the issue's target (RL >= 1.5x SFT-only, or >= +0.3
absolute) is met.

Families:
  arith          configs/tiny.yaml: arithmetic with a calculator tool in a Docker sandbox (calc, then
                 answer: multi-turn), difficulty 0. Ours.
  reasoning-gym  configs/reasoning_gym_tiny.yaml: reasoning-gym `chain_sum` (a + b, a - b, one digit),
                 one turn, scored by reasoning-gym's own score_answer. A task we did not write.
  long-docs      configs/long_docs_tiny.yaml: find a vault's access code in 4 documents with grep / read_doc
                 tools in a Docker sandbox (grep the artifact, grep its vault, answer: multi-turn, with
                 the sub-goals found_location and found_code), difficulty 0, 32 episodes a step,
                 lr 2e-5 instead of the variant's (at 1e-4 RL collapsed it). Ours.
  vision-arith   configs/vision_tiny.yaml: the arithmetic expression exists only in the image the look tool
                 returns (rendered in the Docker sandbox), then calc and answer as in arith; difficulty 0.
                 Its ablation variant rl_raft_blank plays every image blank (white, same size): SFT-only and
                 RL evaluations and the RL batches alike, from the same warm-up checkpoint. Ours.
  smollm2-arith  configs/smollm2_arith_qa.yaml: SmolLM2-135M-Instruct (the embedded pretrained model, no SFT
                 warm-up: the "sft" evaluation of its runs is the instruct model itself) on one-turn
                 arithmetic questions in words (examples/arith_words/arith_words.jsonl, 64 held out),
                 math-verify. Its target is issue 44's: RL >= 1.5x the start AND >= +0.2 absolute.
code-repair is not in this bench: its transcripts (a module and its tests, rewritten whole) are longer
than the tiny policy learns to copy in a CPU warm-up.

Variants (overrides on the family's config):
  rl_raft               make demo's recipe: learner.advantage=raft (each group's best successful
                        episodes), lr 1e-4, 3 warm-up steps, 4 PPO epochs over each batch (the clipped
                        ratio bounds how far one batch moves a token)
  rl_raft_outcome_only  the same without the process and sub-goal rewards (the ablation on a multi-turn
                        task; for raft the shaped rewards only rank a group's successes). arith, long-docs.
  rl                    GRPO, lr 5e-5, 3 warm-up steps, one epoch (the demo's recipe before raft)
  rl_outcome_only       the same without the process and sub-goal rewards. arith only.
  rl_raft_blank         rl_raft with env.kwargs.blank_images=true: the image hidden. vision-arith only.
  grpo_pretrained       GRPO at the config's own learning rate (a pretrained model: 1e-5), one epoch.
                        smollm2 families only (smollm2-arith: one turn; smollm2-tools: calc/answer tools
                        in Docker, shown three worked episodes, configs/smollm2_arith_tools.yaml).
  ppo_pretrained        PPO: GAE advantages from a separate critic (a copy of the policy's trunk with a value
                        head), the config's learning rate, micro-batches of 2048 tokens (memory; the same
                        gradient). smollm2 families only.
  grpo_pretrained_lora  grpo_pretrained with LoRA adapters (rank 16, alpha 32, every attention and MLP
                        projection; only they train) at lr 5e-4. smollm2 families only.
`--variants` / `--families` / `--seeds` run some of them; the results file keeps the runs of the others
(and of other seeds of the same cell when they ran with the same steps and eval episodes), each with the
steps and eval episodes it was run with (see "summary"). `--eval-every N` also evaluates every N steps
(the same held-out tasks): each run's "curve".

    .venv/bin/python bench/learning.py [--families arith] [--variants rl_raft] [--steps 40] [--seeds 0 1 2]
                                       [--eval-every 20]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "learning.json"
PLOT = ROOT / "docs" / "img" / "learning.png"
CURVES = ROOT / "docs" / "img" / "learning_pretrained.png"
OUTCOME_ONLY = (
    "rewards=[{name: outcome, weight: 1.0}, {name: overlong, weight: 1.0, "
    "params: {max_completion_len: 512, soft_punish_cache: 128}}]"
)
#: make demo's RL recipe (the Makefile's `demo` target passes the same overrides)
RAFT = ["learner.advantage=raft", "learner.lr=1e-4", "learner.warmup_steps=3", "learner.ppo_epochs=4"]
GRPO = ["learner.advantage=grpo", "learner.lr=5e-5", "learner.warmup_steps=3", "learner.ppo_epochs=1"]
VARIANTS = {
    "rl_raft": RAFT,
    "rl_raft_outcome_only": [*RAFT, OUTCOME_ONLY],
    "rl": GRPO,
    "rl_outcome_only": [*GRPO, OUTCOME_ONLY],
    "rl_raft_blank": [*RAFT, "env.kwargs.blank_images=true"],
    "grpo_pretrained": ["learner.advantage=grpo"],
    # micro-batches of 2048 tokens (the config's 4096: the learner's RSS reached 17.1 GB with the critic's
    # activations beside the policy's, and Ray killed it on a 24 GB machine); same gradient, half the peak
    "ppo_pretrained": [
        "learner.advantage=gae", "learner.value_model=critic", "learner.micro_batch_tokens=2048",
    ],
    # LoRA adapters (peft) of rank 16 on every projection; adapters take a larger step than full fine-tuning
    # (lr 1e-4 measured +0.062 on seed 1 against full fine-tuning's +0.281: too small a step)
    "grpo_pretrained_lora": [
        "learner.advantage=grpo", "learner.lr=5e-4",
        "learner.lora={rank: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj]}",
    ],
}
# the same adapters at half the rate: at 5e-4 the policy's entropy collapses within about 15 steps on both
# trainers of bench/trl_time_to_reward.py, so 20 TRL steps already saturate (docs/hf.md, "Time to reward")
VARIANTS["grpo_pretrained_lora_half_lr"] = [
    "learner.lr=2.5e-4" if o.startswith("learner.lr=") else o for o in VARIANTS["grpo_pretrained_lora"]
]
LABELS = {
    "rl": "GRPO",
    "rl_outcome_only": "GRPO\n(outcome only)",
    "rl_raft": "RAFT\n(make demo's recipe)",
    "rl_raft_outcome_only": "RAFT\n(outcome only)",
    "rl_raft_blank": "RAFT\n(images blank)",
    "grpo_pretrained": "GRPO\n(from the instruct model)",
    "ppo_pretrained": "PPO + critic\n(from the instruct model)",
    "grpo_pretrained_lora": "GRPO + LoRA r16\n(from the instruct model)",
    "grpo_pretrained_lora_half_lr": "GRPO + LoRA r16, lr 2.5e-4\n(from the instruct model)",
}


@dataclass(frozen=True)
class Family:
    config: str  # the run config, relative to the repo root
    # its SFT warm-up checkpoint (`odyssey warmup` builds or reuses it); None: the config's pretrained model
    warmup: str | None
    label: str
    variants: tuple[str, ...]  # the variants that make sense for it
    overrides: tuple[str, ...] = ()  # after the variant's: what this family's recipe changes
    both_targets: bool = False  # target: RL >= 1.5x AND >= +0.2 (issue 44); else >= 1.5x OR >= +0.3


FAMILIES = {
    "arith": Family("configs/tiny.yaml", "runs/tiny/warmup", "arith d0 (calc tool, Docker)", tuple(VARIANTS)),
    "reasoning-gym": Family(
        "configs/reasoning_gym_tiny.yaml", "runs/rg_tiny/warmup", "reasoning-gym chain_sum", ("rl_raft",)
    ),
    "long-docs": Family(
        "configs/long_docs_tiny.yaml",
        "runs/long_docs_tiny/warmup",
        "long-docs d0 (grep tools, Docker)",
        ("rl_raft", "rl_raft_outcome_only"),
        ("learner.lr=2e-5",),  # lr 1e-4 collapsed it (docs/training.md)
    ),
    "vision-arith": Family(
        "configs/vision_tiny.yaml",
        "runs/vision_tiny/warmup",
        "vision-arith d0 (the expression only in look's image)",
        ("rl_raft", "rl_raft_blank"),
    ),
    "smollm2-arith": Family(
        "configs/smollm2_arith_qa.yaml",
        None,
        "SmolLM2-135M-Instruct, arithmetic in words (one turn)",
        ("grpo_pretrained", "ppo_pretrained", "grpo_pretrained_lora"),
        both_targets=True,
    ),
    "smollm2-tools": Family(
        "configs/smollm2_arith_tools.yaml",
        None,
        "SmolLM2-135M-Instruct, calc + answer tools (multi-turn, Docker)",
        ("grpo_pretrained", "ppo_pretrained", "grpo_pretrained_lora"),
        both_targets=True,
    ),
}


def run(
    family: str,
    variant: str,
    seed: int,
    steps: int,
    eval_episodes: int,
    out: Path,
    eval_every: int = 0,
    adopt: Path | None = None,
    extra: Sequence[str] = (),
) -> dict:
    """Train one cell (family, variant, seed) and return its record; `extra`: config overrides after the
    cell's (recorded in "overrides"). `adopt`: instead of training, record the
    run in that directory, after checking its config.yaml is this cell's (run_dir and checkpoint_every aside):
    `odyssey train <config> <same overrides>` by hand gives the same record. With a constant learning-rate
    schedule nothing in steps 1..N depends on learner.steps, so a longer (or still running) run is adopted
    as its first `steps` steps, once it has evaluated step `steps`."""
    from rich.console import Console

    from rl.config import load_config
    from rl.train.loop import Trainer
    from rl.train.loop import _config_changes as config_changes

    fam = FAMILIES[family]
    run_dir = out / family / f"{variant}_seed{seed}"
    overrides = [
        *([f"model.init_from={ROOT / fam.warmup}"] if fam.warmup else []),
        f"logging.run_dir={run_dir}",
        f"learner.steps={steps}",
        f"rollout.seed={seed}",
        f"orchestrator.eval_every={eval_every or steps}",
        f"orchestrator.eval_episodes={eval_episodes}",
        "orchestrator.checkpoint_every=0",
        *VARIANTS[variant],
        *fam.overrides,
        *extra,
    ]
    cfg = load_config(str(ROOT / fam.config), overrides)
    if adopt is not None:  # a run of exactly this cell trained outside the bench (or a longer one, see below)
        ignored = {"logging.run_dir", "orchestrator.checkpoint_every"}
        if cfg.learner.lr_schedule == "constant":  # then steps 1..N of a longer run are an N-step run's steps
            ignored.add("learner.steps")
        changed = [k for k in config_changes(adopt, cfg) if k not in ignored]
        if changed:
            raise SystemExit(
                f"--adopt {adopt}: its config.yaml differs from this cell's in {', '.join(changed)}"
            )
        run_dir, wall = adopt, None
    else:
        if run_dir.exists():  # every run starts from the warm-up: a checkpoint left here would be resumed
            print(f"  removing the previous run of this cell, {run_dir}", flush=True)
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        Trainer(cfg, console=Console(file=io.StringIO())).run()
        wall = round(time.perf_counter() - t0, 1)
    evals = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    later = [
        e for e in evals if e["step"] > steps
    ]  # an adopted longer run: kept apart, not in the cell's means
    evals = [e for e in evals if e["step"] <= steps]
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_wall = {m["step"]: m["wall_s"] for m in metrics if "wall_s" in m and "step" in m}  # since the start
    first, last = evals[0], evals[-1]

    def point(e: dict) -> dict:  # one evaluation on the curve, at the wall seconds of its step
        return {"step": e["step"], "success": e["success"], "greedy": e["greedy"],
                "wall_s": step_wall.get(e["step"], 0.0)}  # fmt: skip

    keys = ("success", "greedy", f"pass@{cfg.orchestrator.eval_pass_k}", "episodes", "infra_errors")
    assert first["step"] == 0 and last["step"] == steps, (first["step"], last["step"])
    rec = {
        "family": family,
        "variant": variant,
        "overrides": [*VARIANTS[variant], *fam.overrides, *extra],
        "seed": seed,
        "steps": steps,
        "eval_episodes": eval_episodes,
        "episodes_per_step": cfg.rollout.episodes,
        "sft": {k: first[k] for k in keys},
        "rl": {k: last[k] for k in keys},
        "curve": [point(e) for e in evals],
        "wall_s": wall if wall is not None else step_wall.get(steps),
        **({"adopted_from": str(adopt)} if adopt is not None else {}),
        **({"curve_after_steps": [point(e) for e in later]} if later else {}),
    }
    print(
        f"  {family} {variant} seed {seed}: SFT-only {first['success']:.3f} -> RL {last['success']:.3f} "
        f"(greedy {first['greedy']:.2f} -> {last['greedy']:.2f}; {rec['wall_s']:.0f} s)",
        flush=True,
    )
    return rec


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def summarize(runs: list[dict]) -> dict:
    """{family: {variant: mean ± SE over seeds of SFT-only, RL and their paired difference}}."""
    out: dict[str, dict] = {}
    for family in FAMILIES:
        for variant in VARIANTS:
            rs = [r for r in runs if r["family"] == family and r["variant"] == variant]
            if not rs:
                continue
            sft, rl = [r["sft"]["success"] for r in rs], [r["rl"]["success"] for r in rs]
            diff = [b - a for a, b in zip(sft, rl)]
            curves = [{c["step"]: c["success"] for c in r.get("curve", [])} for r in rs]
            common = sorted(set.intersection(*(set(c) for c in curves)))  # the steps every seed evaluated
            (ms, ses), (mr, ser), (md, sed) = mean_se(sft), mean_se(rl), mean_se(diff)
            out.setdefault(family, {})[variant] = {
                "seeds": [r["seed"] for r in rs], "overrides": rs[0]["overrides"],
                "steps": rs[0]["steps"], "eval_episodes": rs[0]["eval_episodes"],
                "episodes_per_step": rs[0].get("episodes_per_step", 16),  # runs before 2026-12-02 ran 16
                "sft_success_mean": ms, "sft_success_se": ses,
                "rl_success_mean": mr, "rl_success_se": ser,
                "diff_mean": md, "diff_se": sed,
                "ratio_rl_over_sft": mr / ms if ms > 0 else None,
                "target": "RL >= 1.5x and >= +0.2" if FAMILIES[family].both_targets else "RL >= 1.5x or +0.3",
                "target_met": bool((mr >= 1.5 * ms and md >= 0.2) if FAMILIES[family].both_targets
                                   else (mr >= 1.5 * ms or md >= 0.3)),
                "curve_success_mean": {str(t): statistics.mean(c[t] for c in curves) for t in common},
            }  # fmt: skip
    return out


def plot(summary: dict, runs: list[dict]) -> None:
    """Per family and variant, its paired SFT-only (before) and RL (after) bars: mean ± SE, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(f, v, s) for f, vs in summary.items() for v, s in vs.items() if FAMILIES[f].warmup]
    if not cells:
        return
    fig, ax = plt.subplots(figsize=(2.2 * len(cells) + 2, 4.2))
    ticks, names = [], []
    for g, (family, variant, s) in enumerate(cells):
        rs = [r for r in runs if r["family"] == family and r["variant"] == variant]
        for j, (key, color) in enumerate((("sft", "#999999"), ("rl", "#3b75af"))):
            x = 3 * g + j
            ax.bar(
                x,
                s[f"{key}_success_mean"],
                yerr=s[f"{key}_success_se"],
                capsize=5,
                color=color,
                label=("SFT-only (before RL)", "after RL")[j] if g == 0 else None,
            )
            ax.scatter([x] * len(rs), [r[key]["success"] for r in rs], color="black", s=10, zorder=3)
        ticks.append(3 * g + 0.5)
        extra = "".join(f"\n+ {o}" for o in FAMILIES[family].overrides)
        names.append(
            f"{FAMILIES[family].label}\n{LABELS[variant]}{extra}\n{s['steps']} steps, "
            f"{s['eval_episodes']} eval eps, {len(rs)} seeds"
        )
    ax.axhline(0.85, ls="--", color="gray", lw=1)
    ax.text(ticks[-1] + 1, 0.86, "demo target 0.85", ha="right", fontsize=8, color="gray")
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success (T = 1)")
    ax.legend(loc="upper center", fontsize=8)
    ax.set_title("tiny policy: SFT-only vs RL on held-out tasks, paired per seed (mean ± SE)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)


def plot_curves(runs: list[dict]) -> None:
    """Pretrained families (no warm-up): held-out success at T = 1 against policy steps and against wall-clock
    minutes, per cell (family, variant) each seed thin and the seeds' mean bold -> CURVES."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in runs if not FAMILIES[r["family"]].warmup and len(r.get("curve", [])) > 1]
    if not rs:
        return
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.5))
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in rs:
        cells.setdefault((r["family"], r["variant"]), []).append(r)
    for (family, variant), cell in cells.items():
        label = f"{family} {LABELS[variant].replace(chr(10), ' ')}"
        color = None
        for r in cell:  # each seed thin (T = 1), then the seeds' mean bold at the steps all of them have
            c = r["curve"] + r.get("curve_after_steps", [])  # an adopted longer run's later evals too
            line = by_step.plot([p["step"] for p in c], [p["success"] for p in c], "-", lw=0.8, alpha=0.35,
                                color=color)  # fmt: skip
            color = line[0].get_color()
            by_time.plot([p["wall_s"] / 60 for p in c], [p["success"] for p in c], "-", lw=0.8, alpha=0.35,
                         color=color)  # fmt: skip
        steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in cell)))
        at = [[next(p for p in r["curve"] if p["step"] == s) for r in cell] for s in steps]
        mean = [sum(p["success"] for p in ps) / len(ps) for ps in at]
        by_step.plot(steps, mean, "-", lw=2.2, marker="o", color=color, label=f"{label}, {len(cell)} seed(s)")
        by_time.plot([sum(p["wall_s"] for p in ps) / len(ps) / 60 for ps in at], mean, "-", lw=2.2,
                     marker="o", color=color)  # fmt: skip
    for ax, x in ((by_step, "policy step"), (by_time, "wall-clock minutes since the run started")):
        ax.set_xlabel(x)
        ax.set_ylabel("held-out success at T = 1 (bold: mean of seeds)")
        ax.set_ylim(0, 1)
    # the legend below both panels, so it never hides a curve
    fig.legend(*by_step.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, no warm-up: held-out success during RL (2 CPU cores)")
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(cells) + 1) // 2), 1, 1))
    fig.savefig(CURVES, dpi=120)


def ensure_warmup(family: str) -> bool:
    """`odyssey warmup` the family's SFT checkpoint: a no-op when it holds this recipe, else (re)trained."""
    from rl.warmup import cli_main as warmup

    fam = FAMILIES[family]
    return warmup([str(ROOT / fam.config), "--out", str(ROOT / fam.warmup)]) == 0


def replaced(r: dict, todo: list[tuple[str, str]], args: argparse.Namespace) -> bool:
    """Whether kept run `r` is dropped: its cell is being run, and with its seed or with other settings."""
    if (r["family"], r["variant"]) not in todo:
        return False
    return r["seed"] in args.seeds or (r["steps"], r["eval_episodes"]) != (args.steps, args.eval_episodes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-episodes", type=int, default=128, help="sampled held-out episodes per eval")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--eval-every", type=int, default=0, help="also evaluate every N steps (the curve); 0 = ends only"
    )
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_learning"))
    ap.add_argument("--adopt", type=Path, help="record this finished run dir as the one cell and seed given")
    args = ap.parse_args()
    if args.adopt and len(args.families) * len(args.variants) * len(args.seeds) != 1:
        ap.error("--adopt records one run: give exactly one --families, --variants and --seeds")
    out = Path(args.out)
    todo = [(f, v) for f in args.families for v in args.variants if v in FAMILIES[f].variants]
    kept = json.loads(RESULTS.read_text())["runs"] if RESULTS.is_file() else []
    runs = [r for r in kept if not replaced(r, todo, args)]  # a cell's seeds share steps and eval episodes
    for family, variant in todo:
        if FAMILIES[family].warmup and not ensure_warmup(family):
            return 1
        for seed in args.seeds:
            runs.append(
                run(family, variant, seed, args.steps, args.eval_episodes, out, args.eval_every, args.adopt)
            )
            write(runs)
    summary = write(runs)
    for family, vs in summary.items():
        for variant, s in vs.items():
            print(
                f"{family} {variant}: SFT-only {s['sft_success_mean']:.3f} ± {s['sft_success_se']:.3f}  RL "
                f"{s['rl_success_mean']:.3f} ± {s['rl_success_se']:.3f}  "
                f"RL/SFT {s['ratio_rl_over_sft'] or float('nan'):.2f}x  "
                f"diff {s['diff_mean']:+.3f} ± {s['diff_se']:.3f}  target ({s['target']}) "
                f"{'met' if s['target_met'] else 'MISSED'}"
            )
    plot(summary, runs)
    plot_curves(runs)
    print(f"wrote {RESULTS.relative_to(ROOT)}, {PLOT.relative_to(ROOT)} and {CURVES.relative_to(ROOT)}")
    return 0


def write(runs: list[dict]) -> dict:
    """Rewrite the results file with `runs` (after every run, so a killed bench keeps what it measured)."""
    summary = summarize(runs)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "bench": "learning", "families": {f: FAMILIES[f].config for f in FAMILIES}, "variants": VARIANTS,
        "machine": platform.platform(), "summary": summary, "runs": runs,
    }, indent=2) + "\n")  # fmt: skip
    return summary


if __name__ == "__main__":
    sys.exit(main())
