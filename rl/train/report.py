"""`odyssey report RUN_DIR`: PNG plots and a `report.md` linking them, from a run dir as it is now.

    odyssey report runs/tiny                  # writes runs/tiny/report/{report.md, *.png}
    odyssey report runs/tiny --out /tmp/r

Reads only files (no Ray, no model), so it works on a run that is still going and on one that crashed:
a last JSONL line cut off mid-write is skipped and counted in the report. Inputs: `metrics.jsonl` (one
record per step, rl/train/metrics.py), `eval.jsonl` (held-out evaluations), `samples.jsonl` (the ledger:
which samples each step trained) and the trajectory store (their lengths and turns).

Plots (each a PNG; stage boundaries, the metrics' `stage` changes, are dashed vertical lines):
    rewards.png       reward/total (and its components) and success of the trained batches, held-out eval
                      success (and pass@k) against steps, and held-out success against wall-clock minutes
                      (the end of the evaluated step, metrics' wall_s; step 0 at 0)
    lengths.png       histograms of generated tokens and assistant turns per trained episode, first vs
                      last third of the steps
    expert_load.png   heatmap layer x step of the max/mean expert load (moe/layer<l>/max_mean_load) and
                      the dead-expert count per step (moe/n_dead_experts, over model.moe_load_window steps)
    routing.png       heatmap layer x step of the rollout-vs-learner routing agreement
                      (learner/routing_agreement/layer<l>), its mean, the share replay changed (R3) and
                      the staleness
    time.png          the time breakdown per step: rollout wait, learner, weight sync, eval (stacked, wall
                      seconds) and the worker-seconds spent playing and scoring the batch's episodes
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

REPORT_DIR = "report"
PLOTS = ("rewards.png", "lengths.png", "expert_load.png", "routing.png", "time.png")


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(records, lines skipped): lines that do not parse (a line cut off by a crash) are skipped."""
    if not path.exists():
        return [], 0
    out, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def stage_boundaries(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """[(step, stage)] where the record's `stage` differs from the previous record's."""
    out, prev = [], None
    for r in records:
        s = r.get("stage")
        if s is not None and prev is not None and s != prev:
            out.append((int(r["step"]), int(s)))
        prev = s if s is not None else prev
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _mark_stages(ax: Any, bounds: list[tuple[int, int]]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for step, stage in bounds:
        ax.axvline(step - 0.5, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"stage {stage}", (step - 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=8,
                    rotation=90, va="top", ha="right", color="grey")


def episode_shapes(run_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """{step: [(generated tokens, assistant turns)] of the episodes it trained} from the ledger and store."""
    from rl.trajectory import TrajectoryStore

    ledger, _ = read_jsonl(run_dir / "samples.jsonl")
    step_of = {k: e["step"] for e in ledger if e.get("step") is not None for k in e.get("trained", [])}
    store_dir = run_dir / "trajectories"
    if not step_of or not store_dir.is_dir():
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    seen: set[str] = set()
    for t in TrajectoryStore(store_dir).iter():
        key = t.metadata.get("sample_key")
        if key in step_of and key not in seen and not t.infra_error:
            seen.add(key)
            turns = int(t.metadata.get("n_turns", t.n_assistant_turns))
            out.setdefault(step_of[key], []).append((int(t.n_generated), turns))
    return out


def eval_wall_s(records: list[dict], evals: list[dict]) -> list[tuple[float, float]]:
    """(wall seconds, held-out success) per evaluation: the evaluated step's `wall_s` (seconds since the run
    started, at the end of that step; the evaluation before step 1 is at 0)."""
    wall = {r["step"]: r["wall_s"] for r in records if isinstance(r.get("wall_s"), (int, float))}
    return [
        (0.0 if e["step"] == 0 else wall[e["step"]], e["success"])
        for e in evals
        if isinstance(e.get("success"), (int, float)) and (e.get("step") == 0 or e.get("step") in wall)
    ]


def plot_rewards(path: Path, records: list[dict], evals: list[dict], bounds: list) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8))
    a.plot(*_series(records, "reward/total"), marker="o", label="train reward/total")
    parts = sorted({k for r in records for k in r if k.count("/") == 1 and k.startswith("reward/")} - {
        "reward/total"
    })  # the terms (weighted into the total by their reward weights), not their diagnostics (a/b/c)
    for key in parts[:8]:
        a.plot(*_series(records, key), linestyle="--", alpha=0.6, label=key)
    a.set_xlabel("step"), a.set_ylabel("reward"), a.set_title("reward (trained batches)")
    b.plot(*_series(records, "success"), marker="o", label="train success")
    ev = [(e["step"], e["success"]) for e in evals if isinstance(e.get("success"), (int, float))]
    if ev:
        b.plot([p[0] for p in ev], [p[1] for p in ev], marker="s", label="held-out success")
    passk = sorted({k for e in evals for k in e if re.fullmatch(r"pass@\d+", k)})
    for k in passk[:1]:
        pk = [(e["step"], e[k]) for e in evals if isinstance(e.get(k), (int, float))]
        b.plot([p[0] for p in pk], [p[1] for p in pk], marker="^", label=f"held-out {k}")
    b.set_xlabel("step"), b.set_ylabel("success"), b.set_ylim(-0.02, 1.02), b.set_title("success")
    wall = eval_wall_s(records, evals)
    c.plot([w / 60 for w, _ in wall], [v for _, v in wall], marker="s", label="held-out success")
    c.set_xlabel("wall-clock minutes"), c.set_ylabel("success"), c.set_ylim(-0.02, 1.02)
    c.set_title("held-out success vs time")
    for ax in (a, b):
        _mark_stages(ax, bounds)
    for ax in (a, b, c):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_lengths(path: Path, shapes: dict[int, list[tuple[int, int]]]) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = sorted(shapes)
    third = max(1, len(steps) // 3)
    parts = [("first steps", steps[:third]), ("last steps", steps[-third:])] if len(steps) > 1 else [
        ("all steps", steps)
    ]
    for label, ss in parts:
        eps = [e for s in ss for e in shapes[s]]
        if not eps:
            continue
        name = f"{label} {ss[0]}-{ss[-1]} ({len(eps)} episodes)"
        a.hist([e[0] for e in eps], bins=20, alpha=0.6, label=name)
        b.hist([e[1] for e in eps], bins=[x - 0.5 for x in range(max(e[1] for e in eps) + 2)], alpha=0.6,
               label=name)
    a.set_xlabel("generated tokens per episode"), a.set_title("lengths")
    b.set_xlabel("assistant turns per episode"), b.set_title("turns")
    for ax in (a, b):
        ax.set_ylabel("episodes")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no trained episodes in the store", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def layer_matrix(records: list[dict], prefix: str, metric: str) -> tuple[list[int], list[list[float]]]:
    """(layers, M[layer][step]) of the keys `<prefix>/layer<l>/<metric>` (`<prefix>/layer<l>` when metric
    is ""), NaN where a step has none."""
    tail = f"/{metric}" if metric else ""
    pattern = re.compile(rf"^{re.escape(prefix)}/layer(\d+){re.escape(tail)}$")
    layers = sorted({int(m.group(1)) for r in records for k in r if (m := pattern.match(k))})

    def value(r: dict, layer: int) -> float:
        v = r.get(f"{prefix}/layer{layer}{tail}")
        return float(v) if isinstance(v, (int, float)) else float("nan")

    return layers, [[value(r, l) for r in records] for l in layers]


def _heatmap(fig: Any, ax: Any, records: list[dict], prefix: str, metric: str, label: str, bounds: list,
             **imshow: Any) -> None:
    import numpy as np

    layers, m = layer_matrix(records, prefix, metric)
    steps = [int(r["step"]) for r in records]
    if layers:
        im = ax.imshow(np.array(m), aspect="auto", origin="lower", interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(layers) - 0.5), **imshow)
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        fig.colorbar(im, ax=ax, label=label)
        _mark_stages(ax, bounds)
    else:
        ax.text(0.5, 0.5, f"no {prefix}/layer<l> metrics", ha="center", transform=ax.transAxes)
    ax.set_xlabel("step"), ax.set_ylabel("layer")


def plot_expert_load(path: Path, records: list[dict], bounds: list) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    _heatmap(fig, a, records, "moe", "max_mean_load", "max / mean tokens per expert", bounds, cmap="viridis")
    a.set_title("expert load (max/mean) per MoE layer")
    from matplotlib.ticker import MaxNLocator

    b.plot(*_series(records, "moe/n_dead_experts"), marker="o", color="C3")
    b.yaxis.set_major_locator(MaxNLocator(integer=True))
    b.set_ylim(bottom=-0.5, top=max([1.0, *_series(records, "moe/n_dead_experts")[1]]) + 0.5)
    b.set_xlabel("step"), b.set_ylabel("experts"), b.set_title("dead experts (all layers, over the window)")
    b.grid(alpha=0.3)
    _mark_stages(b, bounds)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_routing(path: Path, records: list[dict], bounds: list) -> None:
    """Rollout vs learner routing agreement per MoE layer and step; the share replay changed (R3)."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    _heatmap(fig, a, records, "learner/routing_agreement", "", "share of tokens, same top-k set", bounds,
             cmap="magma", vmin=0.0, vmax=1.0)
    a.set_title("routing agreement rollout vs learner per MoE layer")
    b.plot(*_series(records, "learner/routing_agreement"), marker="o", label="agreement (mean over layers)")
    b.plot(*_series(records, "learner/replay_changed"), marker="s", label="changed by replay (R3)")
    b.plot(*_series(records, "staleness/mean"), linestyle=":", label="staleness/mean (versions)")
    b.set_xlabel("step"), b.set_title("agreement, replay, staleness")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    _mark_stages(b, bounds)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


TIME_PHASES = ("rollout", "learner", "weight_sync", "eval")


def plot_time(path: Path, records: list[dict], bounds: list) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = [int(r["step"]) for r in records]
    bottom = [0.0] * len(records)
    for phase in TIME_PHASES:
        vals = [float(r.get(f"time/{phase}_s") or 0.0) for r in records]
        a.bar(steps, vals, bottom=bottom, label=phase)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.set_xlabel("step"), a.set_ylabel("wall seconds"), a.set_title("driver time per step")
    a.legend(fontsize=8)
    for key, label in (("time/episodes_s", "playing episodes"), ("time/reward_s", "scoring (rewards)")):
        b.plot(*_series(records, key), marker="o", label=label)
    b.set_xlabel("step"), b.set_ylabel("worker seconds"), b.set_title("rollout worker time of the batch")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    for ax in (a, b):
        _mark_stages(ax, bounds)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and report.md for `run_dir` into `out_dir` (default <run_dir>/report); returns the
    report.md path. ValueError when the directory holds no metrics at all."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory (logging.run_dir of an `odyssey train` run)")
    records, bad = read_jsonl(run_dir / "metrics.jsonl")
    records = [r for r in records if isinstance(r.get("step"), int)]
    if not records:
        raise ValueError(
            f"{run_dir}/metrics.jsonl holds no step records yet; `odyssey train` writes one per learner step"
        )
    evals, bad_evals = read_jsonl(run_dir / "eval.jsonl")
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    bounds = stage_boundaries(records)
    plot_rewards(out / "rewards.png", records, evals, bounds)
    plot_lengths(out / "lengths.png", episode_shapes(run_dir))
    plot_expert_load(out / "expert_load.png", records, bounds)
    plot_routing(out / "routing.png", records, bounds)
    plot_time(out / "time.png", records, bounds)

    first, last = records[0], records[-1]
    lines = [
        f"# Odyssey run report: `{run_dir.name}`",
        "",
        f"Run dir `{run_dir.resolve()}`; {len(records)} step records (steps {first['step']}-{last['step']}), "
        f"{last.get('wall_s', 0):.0f} s of training.",
    ]
    if bad or bad_evals:
        lines.append(f"Skipped {bad} unreadable metrics line(s) and {bad_evals} eval line(s) (a run cut off "
                     "mid-write).")
    lines += ["", "| | first step | last step |", "|---|---|---|"]
    for key in ("reward/total", "success", "length/mean", "learner/loss", "moe/n_dead_experts",
                "moe/max_mean_load_max", "time/step_s"):
        lines.append(f"| `{key}` | {_fmt(first.get(key))} | {_fmt(last.get(key))} |")
    if evals:
        wall = {r["step"]: r.get("wall_s") for r in records}
        lines += ["", "Held-out evaluations (`eval.jsonl`):", "", "| step | wall s | success | greedy |",
                  "|---|---|---|---|"]
        lines += [f"| {e.get('step')} | {_fmt(0.0 if e.get('step') == 0 else wall.get(e.get('step')))} | "
                  f"{_fmt(e.get('success'))} | {_fmt(e.get('greedy'))} |" for e in evals]
    if bounds or any(r.get("stage") for r in records):
        lines += ["", "Stages: " + ", ".join(
            [f"stage {first.get('stage', 0)} from step {first['step']}"]
            + [f"stage {s} from step {st}" for st, s in bounds])]
    lines += [
        "",
        "## Reward and success",
        "![rewards](rewards.png)",
        "",
        "## Lengths and turns",
        "![lengths](lengths.png)",
        "",
        "## Expert load",
        "![expert load](expert_load.png)",
        "",
        "## Routing: rollout vs learner",
        "![routing](routing.png)",
        "",
        "## Time",
        "![time](time.png)",
        "",
    ]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="odyssey report",
        description="PNG plots and report.md of a training run dir (works while it runs, and after a crash).",
    )
    p.add_argument("run_dir", help="the run's logging.run_dir, e.g. runs/tiny")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        md = write_report(args.run_dir, args.out)
    except ValueError as e:
        print(f"odyssey report: {e}")
        return 2
    print(f"odyssey report: wrote {md} and {', '.join(PLOTS)} next to it")
    return 0
