"""Quantile balancing (model/balancing.py): convergence, the worked example, exact vs histogram quantile,
data-parallel agreement, and the sign-rule baseline."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.balancing import (
    QuantileStats,
    column_histograms,
    exact_balancing_quantile,
    histogram_balancing_quantile,
    quantile_bias_update,
    quantile_from_histogram,
    routing_residuals,
    sign_bias_update,
)


def skewed_scores(T: int = 4096, n: int = 64, seed: int = 0) -> torch.Tensor:
    """Sigmoid scores [T, n] fp32 whose logits are shifted by up to +2 for the last experts: heavily skewed.
    Tie-free within every row (rows with an fp32 collision are redrawn)."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.linspace(0, 2, n, dtype=torch.float64)
    s = torch.sigmoid(torch.randn(T, n, generator=g, dtype=torch.float64) + shift).float()
    while True:
        srt = s.sort(dim=-1).values
        tied = (srt[:, 1:] == srt[:, :-1]).any(dim=-1)
        if not tied.any():
            return s
        redraw = torch.randn(int(tied.sum()), n, generator=g, dtype=torch.float64)
        s[tied] = torch.sigmoid(redraw + shift).float()


def loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    idx = (scores + bias).topk(k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=scores.shape[1]).double()


def max_mean(load: torch.Tensor) -> float:
    return float(load.max() / load.mean())


@pytest.mark.parametrize("exact_max_tokens", [65536, 0], ids=["exact", "histogram"])
def test_quantile_balancing_converges_on_skewed_batch(exact_max_tokens: int):
    """4096 tokens, 64 experts, top-4, starting at max/mean ~3.5: repeated updates on the same batch reach
    max/mean <= 1.05 (updates 16-20 all within it; measured ~1.01) and b stays zero-mean (|mean| < 1e-6)."""
    T, n, k = 4096, 64, 4
    s = skewed_scores(T, n)
    srt = s.sort(dim=-1).values
    assert (srt[:, 1:] > srt[:, :-1]).all(), "the batch must be tie-free"
    b = torch.zeros(n)
    start = max_mean(loads(s, b, k))
    assert start > 3.0
    history = []
    for _ in range(20):
        b = quantile_bias_update(s, b, k, exact_max_tokens=exact_max_tokens, bins=1024)
        assert abs(float(b.mean())) < 1e-6
        history.append(max_mean(loads(s, b, k)))
    assert max(history[-5:]) <= 1.05, history


def test_worked_example_8_tokens_4_experts_top1():
    """Scores s (8 tokens x 4 experts), b = 0, top-1; argmax loads are 4/3/1/0 (experts 0..3):

        s = [[.9 .4 .1 .7]   alpha (2nd largest)   r = alpha - s
             [.7 .3 .2 .1]        .7               [-.2  .3  .6  .0]
             [.7 .5 .6 .2]        .3               [-.4  .0  .1  .2]
             [.9 .4 .3 .1]        .6               [-.1  .1  .0  .4]
             [.5 .7 .1 .2]        .4               [-.5  .0  .1  .3]
             [.5 .9 .3 .8]        .5               [ .0 -.2  .4  .3]
             [.7 .9 .3 .5]        .8               [ .3 -.1  .5  .0]
             [.3 .8 .9 .5]]       .7               [ .0 -.2  .4  .2]
                                  .8               [ .5  .0 -.1  .3]

    m = T k / n = 2, so b_j = midpoint of the 2nd and 3rd smallest r in column j:
    col 0: -.5 -.4 | -.2 -> -.30;  col 1: -.2 -.2 | -.1 -> -.15;  col 2: -.1 .0 | .1 -> .05;
    col 3: .0 .0 | .2 -> .10.  Mean-centred (mean -.075): b = [-.225, -.075, .125, .175].
    New choices argmax(s + b) = [3, 0, 2, 0, 1, 3, 1, 2]: loads 2/2/2/2 after one update.
    """
    s = torch.tensor(
        [
            [0.9, 0.4, 0.1, 0.7],
            [0.7, 0.3, 0.2, 0.1],
            [0.7, 0.5, 0.6, 0.2],
            [0.9, 0.4, 0.3, 0.1],
            [0.5, 0.7, 0.1, 0.2],
            [0.5, 0.9, 0.3, 0.8],
            [0.7, 0.9, 0.3, 0.5],
            [0.3, 0.8, 0.9, 0.5],
        ],
        dtype=torch.float64,
    )
    assert loads(s, torch.zeros(4, dtype=torch.float64), 1).tolist() == [4, 3, 1, 0]
    r = routing_residuals(s, torch.zeros(4, dtype=torch.float64), 1)
    col0 = torch.tensor([-0.2, -0.4, -0.1, -0.5, 0, 0.3, 0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(r[:, 0].double(), col0)
    b = quantile_bias_update(s.float(), torch.zeros(4), 1)
    torch.testing.assert_close(b, torch.tensor([-0.225, -0.075, 0.125, 0.175]), atol=1e-6, rtol=0)
    assert (s.float() + b).argmax(-1).tolist() == [3, 0, 2, 0, 1, 3, 1, 2]
    assert loads(s.float(), b, 1).tolist() == [2, 2, 2, 2]


def test_exact_quantile_puts_exactly_m_residuals_below_b():
    """Hazen quantile at q = k/n on continuous (tie-free) columns: #{i : r_ij < b_j} = m = T k / n exactly."""
    T, n, k = 1000, 20, 3
    r = torch.randn(T, n, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 2, n)
    b = exact_balancing_quantile(r, T * k / n)
    assert ((r < b).sum(dim=0) == T * k // n).all()
    srt = r.sort(dim=0).values
    torch.testing.assert_close(b, (srt[T * k // n - 1] + srt[T * k // n]) / 2)
    # +inf padding rows (used by the data-parallel gather) do not change the result
    padded = torch.cat([r, torch.full((37, n), float("inf"))])
    assert torch.equal(exact_balancing_quantile(padded, T * k / n, n_valid=T), b)


def test_histogram_quantile_within_one_bin_width_of_exact():
    """20000 tokens, 64 experts, top-4, 1024 bins over [min r, max r] (width w):
    one level: |b_hist - b_exact| <= w for every expert, and b_hist lies within w of the m-th smallest r;
    two levels: b lies within w / 1024 of the m-th smallest r and within w / 1024 + the gap between the
    m-th and (m+1)-th smallest of b_exact (which sits mid-gap); the stateful path agrees the same way."""
    T, n, k, bins = 20000, 64, 4, 1024
    g = torch.Generator().manual_seed(2)
    # continuous residual-like columns (real residuals also carry an atom at the old b_j, see balancing.py)
    r = torch.randn(T, n, generator=g) * torch.linspace(0.05, 0.3, n) + torch.linspace(-0.5, 0.5, n)
    m = T * k / n
    lo, hi = r.min().item(), r.max().item()
    width = (hi - lo) / bins
    b_exact = exact_balancing_quantile(r, m)
    srt = r.sort(dim=0).values
    mth, gap = srt[int(m) - 1], srt[int(m)] - srt[int(m) - 1]
    b_one = quantile_from_histogram(column_histograms(r, bins, lo, hi), m, lo, hi)
    assert ((b_one - b_exact).abs() <= width).all(), (b_one - b_exact).abs().max() / width
    assert ((b_one - mth).abs() <= width + 1e-6).all()
    b_two = histogram_balancing_quantile(r, m, bins, lo, hi)
    fine = width / bins
    assert ((b_two - mth).abs() <= fine + 1e-6).all(), (b_two - mth).abs().max() / fine
    assert ((b_two - b_exact).abs() <= fine + gap + 1e-6).all()
    below = (r < b_two).sum(dim=0)
    assert ((below - m).abs() <= 1).all(), below
    s = skewed_scores(T, n, seed=2)  # the stateful path on real residuals: same estimator
    stats = QuantileStats(k)
    stats.add(s, torch.zeros(n))
    via_hist = stats.solve(n, exact_max_tokens=T - 1, bins=bins)  # above the exact limit: histogram
    r = routing_residuals(s, torch.zeros(n), k)
    want = histogram_balancing_quantile(r, m, bins, r.min().item(), r.max().item())
    torch.testing.assert_close(via_hist, want - want.mean(), atol=1e-6, rtol=0)


def test_sign_rule():
    load = torch.tensor([5.0, 1.0, 3.0, 3.0])
    b = sign_bias_update(torch.zeros(4), load, 0.5)
    assert b.tolist() == [-0.5, 0.5, 0.0, 0.0]


def _dist_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        s = skewed_scores(3000, 16, seed=7)
        bias = torch.linspace(-0.1, 0.1, 16)
        part = s[:1300] if rank == 0 else s[1300:]  # unequal shards: the exact gather pads with +inf
        results = {}
        for name, exact_max in (("exact", 65536), ("hist", 100)):
            stats = QuantileStats(k=2)
            stats.add(part, bias)
            results[name] = stats.solve(16, exact_max_tokens=exact_max, bins=256)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_agree_with_single_process(tmp_path):
    """2 gloo ranks with 1300 / 1700 tokens produce the same b as one process on all 3000 tokens, on both
    the exact (gathered) path and the histogram (MIN/MAX + SUM all-reduced) path. Tolerance 1e-6."""
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    s = skewed_scores(3000, 16, seed=7)
    bias = torch.linspace(-0.1, 0.1, 16)
    for name, exact_max in (("exact", 65536), ("hist", 100)):
        stats = QuantileStats(k=2)
        stats.add(s, bias)
        want = stats.solve(16, exact_max_tokens=exact_max, bins=256)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=f"{name} rank {rank}")
