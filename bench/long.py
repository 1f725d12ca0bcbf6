"""Long-context learner bench -> bench/results/long.json and docs/img/long.png.

One learner step (`Learner.update`: forward, loss, backward, AdamW step) on a single trajectory of T tokens
(30 % prompt, the rest generated and scored; routing replay on) of the `tiny` policy on CPU:

- chunked: learner.sequence_chunk_tokens = C and activation_checkpointing (per window and per layer), at
  T = 16K, 32K, 64K (128K with --tokens);
- unchunked baselines (a micro-batch of its own): with per-layer activation checkpointing at 8K and 16K;
  without it (the learner's default) with --add-baseline-no-checkpointing.

Each case runs in its own process; peak RSS is that process's VmHWM, the RSS after building the learner is
reported too. The parent watches every child's RSS and kills it past --rss-cap-gib (the box is shared): such
a case is recorded as failed at that cap, with the time it had run.

Fits (chunked points): peak RSS = a + b T (least squares; the extrapolation to 1,048,576 tokens against the
16 GiB target) and seconds = c0 + c1 T + c2 T^2 (the quadratic term is MLA's attention over the prefix; its
1M prediction). The figure: both measurements with their fits.

    python bench/long.py                        # ~20 min on a loaded 2-core machine
    python bench/long.py --tokens 16384 32768   # fewer points
    python bench/long.py --add 8192             # run more chunked lengths, merge into the JSON, refit
    python bench/long.py --context-parallel 16384   # 1 rank vs 2 context-parallel ranks, same threads

Context parallelism (--context-parallel T): one learner step on the same T-token trajectory, unchunked and
without checkpointing, on 1 rank with --threads threads and on 2 ranks (learner.context_parallel=2, gloo)
with --threads / 2 each: seconds (the slowest rank) and each rank's peak RSS.

Timings taken while other jobs load the machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learner import moe_shape, peak_rss_gib, trajectory  # noqa: E402
from rl.config import RunConfig  # noqa: E402
from rl.learner import Learner  # noqa: E402
from rl.learner.sharding import plan_step  # noqa: E402

OUT = ROOT / "bench" / "results" / "long.json"
FIG = ROOT / "docs" / "img" / "long.png"
MILLION = 1_048_576


def timed_step(tokens: int, **learner: object) -> dict:
    """One `Learner.update` on a single `tokens`-token trajectory (30 % prompt; `learner`: section overrides),
    in this process: seconds, peak RSS, RSS after setup, and the step's metrics."""
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({
        "learner": {"group_size": 2, "micro_batch_tokens": tokens, "tis_cap": None, **learner},
        "rollout": {"max_tokens": tokens + 1, "max_new_tokens": min(512, tokens + 1)},
    })
    rng = np.random.default_rng(0)
    trajs = [trajectory(rng, tokens + 1, moe_shape(cfg), 1.0), trajectory(rng, 2, moe_shape(cfg), 0.0)]
    learner_ = Learner(cfg)
    s = learner_.prepare(trajs).samples[0]
    plan = plan_step([s], 1, 1, 0)[0]
    rss_setup = peak_rss_gib()
    t0 = time.perf_counter()
    metrics = learner_.update([s], plan)
    return {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_gib": round(peak_rss_gib(), 3),
            "rss_after_setup_gib": round(rss_setup, 3), "metrics": metrics}


def case(tokens: int, chunk: int, checkpointing: int = 1) -> dict:
    """One learner step on a single `tokens`-token trajectory (chunk 0 = unchunked), in this process."""
    r = timed_step(tokens, activation_checkpointing=bool(checkpointing), sequence_chunk_tokens=chunk)
    m = r.pop("metrics")
    return {"tokens": tokens, "chunk_tokens": chunk, "activation_checkpointing": bool(checkpointing), **r,
            "windows": m["learner/sequence_chunks"], "loss": m["loss"], "grad_norm": m["grad_norm"]}


def cp_rank(rank: int, ranks: int, tokens: int, init: str, threads: int, out: str) -> None:
    """One rank of a context-parallel learner step (`learner.context_parallel = ranks`, unchunked, no
    activation checkpointing) on the `case` trajectory; writes its seconds and peak RSS to out.<rank>."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks)
    r = timed_step(tokens, num_ranks=ranks, context_parallel=ranks)
    m = r.pop("metrics")
    Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, **r, "loss": m["loss"],
                                                 "grad_norm": m["grad_norm"]}))
    if ranks > 1:
        dist.destroy_process_group()


def context_parallel_case(tokens: int, ranks: int, threads_total: int) -> dict:
    """A learner step at `ranks`-way context parallelism, the machine's threads split over the ranks."""
    import tempfile

    import torch.multiprocessing as mp

    d = tempfile.mkdtemp()
    threads = max(1, threads_total // ranks)
    t0 = time.perf_counter()
    mp.start_processes(cp_rank, args=(ranks, tokens, f"{d}/rendezvous", threads, f"{d}/rank"), nprocs=ranks,
                       start_method="spawn")
    rows = [json.loads(Path(f"{d}/rank.{r}").read_text()) for r in range(ranks)]
    return {"tokens": tokens, "ranks": ranks, "threads_per_rank": threads,
            "seconds": max(r["seconds"] for r in rows), "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gib_per_rank": [r["peak_rss_gib"] for r in rows],
            "loss": rows[0]["loss"], "grad_norm": rows[0]["grad_norm"]}


def rss_gib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run_case(tokens: int, chunk: int, cap_gib: float, timeout_s: float, checkpointing: bool = True) -> dict:
    """`case` in a child process, killed past cap_gib of RSS or timeout_s seconds."""
    cmd = [sys.executable, __file__, "--case", str(tokens), str(chunk), str(int(checkpointing))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak, why = 0.0, None
    while proc.poll() is None:
        peak = max(peak, rss_gib(proc.pid))
        if peak > cap_gib:
            why = f"killed: RSS passed the {cap_gib} GiB cap"
        elif time.perf_counter() - t0 > timeout_s:
            why = f"killed: ran past {timeout_s:.0f} s"
        if why:
            proc.kill()
            break
        time.sleep(0.2)
    out, err = proc.communicate()
    row = {"tokens": tokens, "chunk_tokens": chunk, "activation_checkpointing": checkpointing}
    if why or proc.returncode != 0:
        if why is None:
            why = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                   else (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
        row.update(error=why,
                   seconds_until_stop=round(time.perf_counter() - t0, 1), rss_seen_gib=round(peak, 3))
    else:
        row.update(json.loads(out.strip().splitlines()[-1]))
    return row


def nonnegative_polyfit(T: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares (c0, c1, c2) >= 0 of y = c0 + c1 T + c2 T^2: the best unconstrained fit over every subset
    of free coefficients whose solution is non-negative (exact for three unknowns)."""
    A = np.stack([np.ones_like(T), T, T**2], axis=1)
    scale = np.abs(A).max(axis=0)
    best, best_err = np.zeros(3), float(np.sum(y**2))
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(A[:, cols] / scale[cols], y, rcond=None)
        if np.all(coef >= 0):
            full = np.zeros(3)
            full[cols] = coef / scale[cols]
            err = float(np.sum((A @ full - y) ** 2))
            if err < best_err:
                best, best_err = full, err
    return float(best[0]), float(best[1]), float(best[2])


def attention_cost(chunk: int = 4096, prefix: int = 16384, repeats: int = 2) -> dict:
    """The T^2 term measured at its source: one tiny MLA layer's attention of `chunk` queries over `prefix` +
    `chunk` keys (`causal_attention`, as a window runs it), forward and forward + backward. A step runs the
    forward three times (window, window recomputation, layer recomputation) and the backward once, over
    T^2 / 2 (query, key) pairs per MLA layer: c2 = n_mla * (2 t_fwd + t_fwd_bwd) / pairs / 2."""
    from model.config import OdysseyConfig
    from model.mla import causal_attention

    cfg = OdysseyConfig.from_preset("tiny")
    H, Dh = cfg.mla_num_heads, cfg.mla_head_dim
    L = prefix + chunk
    q = torch.randn(chunk, H, Dh, requires_grad=True)
    k, v = (torch.randn(L, H, Dh, requires_grad=True) for _ in range(2))
    t_f, t_fb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            causal_attention(q, k, v, prefix, Dh**-0.5)
        t_f.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        causal_attention(q, k, v, prefix, Dh**-0.5).sum().backward()
        t_fb.append(time.perf_counter() - t0)
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    n_mla = len(cfg.mla_layer_indices)
    c2 = n_mla * (2 * min(t_f) + min(t_fb)) / pairs / 2
    return {"chunk": chunk, "prefix": prefix, "fwd_s": round(min(t_f), 3), "fwd_bwd_s": round(min(t_fb), 3),
            "c2_per_token2": c2, "at_1M_quadratic_s": round(c2 * MILLION**2, 1),
            "at_1M_quadratic_h": round(c2 * MILLION**2 / 3600, 2)}


def fits(rows: list[dict]) -> dict:
    T = np.array([r["tokens"] for r in rows], dtype=np.float64)
    rss = np.array([r["peak_rss_gib"] for r in rows])
    sec = np.array([r["seconds"] for r in rows])
    b, a = np.polyfit(T, rss, 1)
    out = {"points": len(rows), "tokens": [int(t) for t in T],
           "rss_gib": {"intercept": round(float(a), 4), "gib_per_token": float(b),
                       "mib_per_1k_tokens": round(float(b) * 1024 * 1024, 3),
                       "max_abs_residual_gib": round(float(np.abs(a + b * T - rss).max()), 4),
                       "at_1M_gib": round(float(a + b * MILLION), 2), "target_at_1M_gib": 16.0}}
    # seconds = c0 + c1 T + c2 T^2 with every coefficient >= 0 (least squares over the sets of free terms):
    # under load the timings are noisy enough for an unconstrained fit of few points to make c2 negative
    (c0, c1, c2) = nonnegative_polyfit(T, sec)
    at = c0 + c1 * MILLION + c2 * MILLION**2
    out["seconds"] = {"model": "c0 + c1 T + c2 T^2, least squares with c0, c1, c2 >= 0", "c0": float(c0),
                      "c1_per_token": float(c1), "c2_per_token2": float(c2),
                      "max_abs_residual_s": round(float(np.abs(c0 + c1 * T + c2 * T**2 - sec).max()), 2),
                      "at_1M_s": round(float(at), 1), "at_1M_h": round(float(at) / 3600, 2),
                      "quadratic_share_at_1M": round(float(c2 * MILLION**2 / max(at, 1e-9)), 3)}
    return out


def plot(chunked: list[dict], baseline: list[dict], fit: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    T = np.array([r["tokens"] for r in chunked])
    grid = np.linspace(0, max(T) * 1.15, 100)
    r, s = fit["rss_gib"], fit["seconds"]
    ax1.plot(T / 1024, [x["peak_rss_gib"] for x in chunked], "o", label="chunked + checkpointed")
    ax1.plot(grid / 1024, r["intercept"] + r["gib_per_token"] * grid, "-",
             label=f"fit: {r['intercept']:.2f} GiB + {r['mib_per_1k_tokens']:.1f} MiB/1K tok "
                   f"(1M: {r['at_1M_gib']:.1f} GiB)")
    for ckpt, marker in ((True, "s"), (False, "^")):
        ok = [x for x in baseline if "peak_rss_gib" in x and x.get("activation_checkpointing", True) == ckpt]
        name = "unchunked" + (", layer checkpoints" if ckpt else ", no checkpointing")
        ax1.plot([x["tokens"] / 1024 for x in ok], [x["peak_rss_gib"] for x in ok], marker, label=name)
        ax2.plot([x["tokens"] / 1024 for x in ok], [x["seconds"] for x in ok], marker, label=name)
    for x in baseline:
        if "error" in x:
            ax1.plot(x["tokens"] / 1024, x["rss_seen_gib"], "x", color="red", ms=10,
                     label=f"unchunked, stopped: {x['error'][:40]}")
    ax1.set_xlabel("trajectory tokens (K)")
    ax1.set_ylabel("peak RSS (GiB)")
    ax1.legend(fontsize=7)
    ax2.plot(T / 1024, [x["seconds"] for x in chunked], "o", label="chunked + checkpointed")
    ax2.plot(grid / 1024, s["c0"] + s["c1_per_token"] * grid + s["c2_per_token2"] * grid**2, "-",
             label=f"fit: c1 T + c2 T^2, c2 = {s['c2_per_token2']:.2e} s/tok^2 (1M: {s['at_1M_h']:.1f} h)")
    ax2.set_xlabel("trajectory tokens (K)")
    ax2.set_ylabel("seconds per learner step")
    ax2.legend(fontsize=7)
    fig.suptitle("tiny policy, one learner step on one trajectory, 2 CPU cores (shared, under load)",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--baseline-tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--rss-cap-gib", type=float, default=8.0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--figure", type=Path, default=FIG)
    p.add_argument("--add", type=int, nargs="+", help="chunked lengths to run and merge into --out")
    p.add_argument("--add-baseline-no-checkpointing", type=int, nargs="+", default=[],
                   help="unchunked lengths without activation checkpointing to run and merge into --out")
    p.add_argument("--refit", action="store_true", help="recompute the fits and the figure of --out")
    p.add_argument("--from-log", type=Path,
                   help="with --add: take the rows a previous run printed (its stdout) instead of --out")
    p.add_argument("--context-parallel", type=int, metavar="T",
                   help="run one learner step at T tokens on 1 rank and on 2 context-parallel ranks (the "
                        "--threads split between them), unchunked; merge into --out")
    p.add_argument("--case", nargs="+", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(case(*args.case)))
        return 0
    if args.context_parallel:
        rows = [context_parallel_case(args.context_parallel, r, args.threads) for r in (1, 2)]
        for r in rows:
            print("context parallel", json.dumps(r), flush=True)
        result = json.loads(args.out.read_text())
        result["context_parallel"] = {
            "rows": rows, "speedup_2_ranks": round(rows[0]["seconds"] / rows[1]["seconds"], 3),
            "peak_rss_ratio_per_rank": round(max(rows[1]["peak_rss_gib_per_rank"])
                                             / rows[0]["peak_rss_gib_per_rank"][0], 3),
            "loss_rel_diff": abs(rows[1]["loss"] - rows[0]["loss"]) / max(abs(rows[0]["loss"]), 1e-12),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result["context_parallel"].items() if k != "rows"}))
        return 0
    if args.refit:
        result = json.loads(args.out.read_text())
        good = [r for r in result["chunked"] if "peak_rss_gib" in r]
        result["fit"] = fits(good)
        result["fit"]["attention_probe"] = attention_cost()
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(good, result["unchunked"], result["fit"], args.figure)
        print(json.dumps(result["fit"], indent=2))
        return 0
    t0 = time.perf_counter()
    chunked, baseline, wall = [], [], 0.0
    for tokens in args.add_baseline_no_checkpointing:
        baseline.append(run_case(tokens, 0, args.rss_cap_gib, args.timeout_s, checkpointing=False))
        print("unchunked, no checkpointing", json.dumps(baseline[-1]), flush=True)
    if args.from_log:  # the rows of an interrupted run, as it printed them
        for line in args.from_log.read_text().splitlines():
            kind, _, row = line.partition(" {")
            if kind.startswith(("unchunked", "chunked")):
                rows = baseline if kind.startswith("unchunked") else chunked
                rows.append(json.loads("{" + row))
                wall += rows[-1].get("seconds", rows[-1].get("seconds_until_stop", 0.0))
    elif args.add or args.add_baseline_no_checkpointing:
        old = json.loads(args.out.read_text())
        chunked, baseline, wall = old["chunked"], old["unchunked"] + baseline, old["wall_s"]
    for tokens in args.baseline_tokens if not (args.add or args.add_baseline_no_checkpointing
                                               or args.from_log) else []:
        baseline.append(run_case(tokens, 0, args.rss_cap_gib, args.timeout_s))
        print("unchunked", json.dumps(baseline[-1]), flush=True)
    for tokens in args.add or ([] if args.add_baseline_no_checkpointing or args.from_log else args.tokens):
        chunked.append(run_case(tokens, args.chunk, args.rss_cap_gib, args.timeout_s))
        print("chunked  ", json.dumps(chunked[-1]), flush=True)
    chunked.sort(key=lambda r: r["tokens"])
    good = [r for r in chunked if "peak_rss_gib" in r]
    fit = fits(good) if len(good) >= 2 else None
    if fit is not None:
        fit["attention_probe"] = attention_cost()
    result = {
        "bench": "long-context learner step (bench/long.py)",
        "model": "tiny", "device": "cpu", "threads": args.threads,
        "note": "taken on a shared 2-core machine under load from other jobs: seconds are noisy",
        "chunk_tokens": args.chunk, "rss_cap_gib": args.rss_cap_gib,
        "chunked": chunked, "unchunked": baseline, "fit": fit,
        "one_million_on_device": "not run: no accelerator was lent to this task; the fit stands in",
        "wall_s": round(wall + time.perf_counter() - t0, 1),
    }
    if args.out.is_file() and "context_parallel" in (old := json.loads(args.out.read_text())):
        result["context_parallel"] = old["context_parallel"]  # its own mode (--context-parallel) refreshes it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if fit is not None:
        plot(good, baseline, fit, args.figure)
        print(json.dumps(fit, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
