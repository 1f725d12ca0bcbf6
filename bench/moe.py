"""LatentMoE benchmarks -> bench/results/moe.json (+ docs/img/balancing.png).

1. Dispatch (sort by expert + one matmul pair per expert segment) against the dense loop (every expert on
   every token, masked), at 4096 tokens, 64 experts, top-4 with the `small` preset's MoE widths
   (hidden 512, latent 256, expert intermediate 256). Forward (no grad) and forward+backward; target >= 5x.
2. Balancing under drift: 200 steps, each a fresh batch of 32768 tokens x 64 experts, top-4, of sigmoid
   scores s = sigmoid(z + c_topic + A cos(2 pi (j / n - t / P))) with z ~ N(0, 1) per token and expert, a
   static per-topic preference c (8 topics) and a global skew of amplitude A = 1.5 logits that rotates
   around the experts with period P: P = 1000 steps ("moderate drift", the headline and the plot's left
   panel) and P = 200 ("fast drift": the skew turns fully within the run). Every method sees the same
   batches; the bias computed after step t is used at step t + 1. Reported per method: steps until
   max/mean < 1.1, worst and mean max/mean after a 20-step warm-up, and the multinomial noise floor
   (uniform random routing of the same number of tokens), which no method can beat.

Run: .venv/bin/python bench/moe.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the `model` package, not bench/model.py next to this script

from model.balancing import QuantileStats, aux_balance_loss, sign_bias_update  # noqa: E402
from model.config import OdysseyConfig  # noqa: E402
from model.moe import LatentMoE, dense_reference_forward, latent_expert  # noqa: E402


def timed_pair(fast, slow, repeats: int) -> tuple[float, float]:
    """Best of `repeats` interleaved runs of each after one warm-up (the least disturbed run on a shared
    machine; interleaving exposes both to the same load)."""
    fast(), slow()
    t_fast, t_slow = [], []
    for _ in range(repeats):
        for fn, times in ((fast, t_fast), (slow, t_slow)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(t_fast), min(t_slow)


def dense_routed(moe: LatentMoE, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Baseline for the routed part: every expert on every token, masked by the [T, n] weights."""
    W = torch.zeros(z.shape[0], moe.n_experts, dtype=z.dtype).scatter(1, idx, p.to(z.dtype))
    h = torch.zeros_like(z)
    for e, (w_gu, w_d) in enumerate(zip(moe.w_gate_up.unbind(0), moe.w_down_experts.unbind(0))):
        h = h + W[:, e:e + 1] * latent_expert(w_gu, w_d, z)
    return h


def bench_dispatch(tokens: int, repeats: int) -> dict:
    """Routed part (sum_i p_i E_i(z) on the latent z) and the whole layer, dispatch vs dense loop."""
    cfg = OdysseyConfig.from_preset("small")
    assert cfg.n_routed_experts == 64 and cfg.num_experts_per_tok == 4
    torch.manual_seed(0)
    moe = LatentMoE(cfg, layer_idx=1)
    x = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        _, idx, p = moe.router(x)
        z = moe.latent_down(x)
        err = float((moe.dispatch(z, idx, p) - dense_routed(moe, z, idx, p)).abs().max())
        layer_err = float((moe(x)[0] - dense_reference_forward(moe, x)[0]).abs().max())
    assert err < 1e-4 and layer_err < 1e-4, f"dispatch disagrees with the dense loop: {err}, {layer_err}"
    zg = z.detach().requires_grad_()

    def no_grad(f):
        def run():
            with torch.no_grad():
                f()
        return run

    def with_grad(f):
        def run():
            moe.zero_grad(set_to_none=True)
            f().pow(2).mean().backward()
        return run

    cases = {
        "routed_forward": (no_grad(lambda: moe.dispatch(z, idx, p)),
                           no_grad(lambda: dense_routed(moe, z, idx, p))),
        "routed_forward_backward": (with_grad(lambda: moe.dispatch(zg, idx, p)),
                                    with_grad(lambda: dense_routed(moe, zg, idx, p))),
        "layer_forward": (no_grad(lambda: moe(x)), no_grad(lambda: dense_reference_forward(moe, x))),
    }
    out = {"tokens": tokens, "experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
           "hidden": cfg.hidden_size, "latent": cfg.moe_latent_dim,
           "expert_intermediate": cfg.moe_intermediate_size, "max_abs_err_vs_dense": max(err, layer_err),
           "note": "layer_forward includes the router, W_down/W_up, the RMSNorm and the shared expert, "
                   "which both paths pay equally"}
    for name, (fast, dense) in cases.items():
        t_fast, t_dense = timed_pair(fast, dense, repeats)
        out[name] = {"dispatch_s": t_fast, "dense_loop_s": t_dense, "speedup": t_dense / t_fast}
    return out


class DriftingScores:
    """Fresh batches of sigmoid router logits with a topic preference and a rotating global skew."""

    def __init__(self, tokens: int, n: int, topics: int = 8, amplitude: float = 1.5, period: int = 200,
                 seed: int = 0) -> None:
        self.tokens, self.n, self.amplitude, self.period, self.seed = tokens, n, amplitude, period, seed
        g = torch.Generator().manual_seed(seed)
        self.topic_pref = torch.randn(topics, n, generator=g) * 0.7
        self.topic_prob = torch.softmax(torch.randn(topics, generator=g), dim=0)

    def logits(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        topic = torch.multinomial(self.topic_prob, self.tokens, replacement=True, generator=g)
        j = torch.arange(self.n, dtype=torch.float32)
        skew = self.amplitude * torch.cos(2 * math.pi * (j / self.n - step / self.period))
        return torch.randn(self.tokens, self.n, generator=g) + self.topic_pref[topic] + skew


def load_ratio(idx: torch.Tensor, n: int) -> float:
    load = torch.bincount(idx.reshape(-1), minlength=n).double()
    return float(load.max() / load.mean())


def simulate(method: str, src: DriftingScores, steps: int, k: int, **hp) -> list[float]:
    n = src.n
    b = torch.zeros(n)
    theta = torch.zeros(n, requires_grad=True)  # aux_loss: a trainable per-expert router logit offset
    opt = torch.optim.Adam([theta], lr=hp.get("lr", 1e-2)) if method == "aux_loss" else None
    ratios = []
    for t in range(steps):
        z = src.logits(t)
        if method == "aux_loss":
            s = torch.sigmoid(z + theta)
            idx = s.detach().topk(k, dim=-1).indices
            opt.zero_grad()
            aux_balance_loss(s, idx, n, hp.get("coef", 1e-2)).backward()
            opt.step()
        else:
            s = torch.sigmoid(z)
            idx = (s + b).topk(k, dim=-1).indices
            if method == "quantile":
                stats = QuantileStats(k)
                stats.add(s, b)
                b = stats.solve(n, exact_max_tokens=65536, bins=1024)
            elif method == "bias_sign":
                b = sign_bias_update(b, torch.bincount(idx.reshape(-1), minlength=n), hp["gamma"])
        ratios.append(load_ratio(idx, n))
    return ratios


def noise_floor(tokens: int, n: int, k: int, trials: int = 50) -> float:
    g = torch.Generator().manual_seed(1)
    vals = [load_ratio(torch.rand(tokens, n, generator=g).topk(k, dim=-1).indices, n) for _ in range(trials)]
    return statistics.median(vals)


def bench_balancing(tokens: int, steps: int, period: int,
                    warmup: int = 20) -> tuple[dict, dict[str, list[float]]]:
    n, k = 64, 4
    src = DriftingScores(tokens, n, period=period)
    methods = {
        "quantile": ("quantile", {}),
        "bias_sign (gamma=1e-3, default)": ("bias_sign", {"gamma": 1e-3}),
        "bias_sign (gamma=1e-2)": ("bias_sign", {"gamma": 1e-2}),
        "aux_loss (Adam lr=1e-2 on router offsets)": ("aux_loss", {"lr": 1e-2, "coef": 1e-2}),
        "none": ("none", {}),
    }
    curves, summary = {}, {}
    for label, (method, hp) in methods.items():
        t0 = time.perf_counter()
        r = simulate(method, src, steps, k, **hp)
        curves[label] = r
        first = next((i for i, v in enumerate(r) if v < 1.1), None)
        summary[label] = {
            "steps_until_below_1.1": first,
            "worst_max_mean_after_warmup": max(r[warmup:]),
            "mean_max_mean_after_warmup": statistics.fmean(r[warmup:]),
            "worst_max_mean_all_steps": max(r),
            "final_max_mean": r[-1],
            "sim_s": time.perf_counter() - t0,
        }
    info = {"tokens_per_step": tokens, "experts": n, "top_k": k, "steps": steps, "warmup_steps": warmup,
            "drift_period_steps": period, "skew_amplitude_logits": src.amplitude,
            "noise_floor_max_mean": noise_floor(tokens, n, k), "methods": summary}
    return info, curves


def plot(scenarios: dict[str, tuple[dict, dict[str, list[float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(scenarios), figsize=(13, 4.8), sharey=True)
    for ax, (title, (info, curves)) in zip(axes, scenarios.items()):
        for label, r in curves.items():
            ax.plot(r, label=label, lw=1.6 if label == "quantile" else 1.0)
        ax.axhline(1.1, color="k", ls="--", lw=0.8, label="max/mean = 1.1")
        floor = info["noise_floor_max_mean"]
        ax.axhline(floor, color="grey", ls=":", lw=0.8, label=f"noise floor ({floor:.3f})")
        ax.set_yscale("log")
        ax.set_yticks([1.0, 1.1, 1.25, 1.5, 2, 3, 4, 6])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel(f"step ({info['tokens_per_step']} fresh tokens each; b from step t used at t+1)")
        ax.set_title(f"{title}: skew rotates with period {info['drift_period_steps']} steps", fontsize=10)
    axes[0].set_ylabel("max / mean expert load (64 experts, top-4)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 30 steps; writes no files")
    args = ap.parse_args()
    repeats = 1 if args.quick else 5
    steps = 30 if args.quick else 200

    dispatch = bench_dispatch(4096, repeats)
    for name in ("routed_forward", "routed_forward_backward", "layer_forward"):
        d = dispatch[name]
        print(f"{name:24s}: dispatch {d['dispatch_s'] * 1e3:8.1f} ms  "
              f"dense loop {d['dense_loop_s'] * 1e3:8.1f} ms"
              f"  speedup {d['speedup']:5.1f}x (target >= 5x)")

    scenarios = {}
    for title, period in (("moderate drift", 1000), ("fast drift", 200)):
        info, curves = bench_balancing(32768, steps, period)
        scenarios[title] = (info, curves)
        print(f"{title} (period {period}), {steps} steps; "
              f"noise floor max/mean {info['noise_floor_max_mean']:.3f}")
        print(f"  {'method':44s} {'steps<1.1':>9s} {'worst>=20':>10s} {'mean>=20':>9s} {'final':>7s}")
        for label, m in info["methods"].items():
            first = "never" if m["steps_until_below_1.1"] is None else str(m["steps_until_below_1.1"])
            print(f"  {label:44s} {first:>9s} {m['worst_max_mean_after_warmup']:10.3f} "
                  f"{m['mean_max_mean_after_warmup']:9.3f} {m['final_max_mean']:7.3f}")

    if args.quick:
        return
    result = {"host": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0]},
              "dispatch": dispatch,
              "balancing": {title: info for title, (info, _) in scenarios.items()},
              "curves": {title: {k: [round(v, 4) for v in r] for k, r in curves.items()}
                         for title, (_, curves) in scenarios.items()}}
    out = ROOT / "bench" / "results" / "moe.json"
    out.write_text(json.dumps(result, indent=2))
    plot(scenarios, ROOT / "docs" / "img" / "balancing.png")
    print(f"wrote {out.relative_to(ROOT)} and docs/img/balancing.png")


if __name__ == "__main__":
    main()
