"""Expert-load balancing for the sigmoid top-k router of `model.moe.LatentMoE`.

Notation (DESIGN.md, "Quantile balancing"): T tokens, n routed experts, top-k, router scores
s [T, n] in (0, 1) (sigmoid), per-expert selection bias b [n]. A token i picks
T_i = topk_j(s_ij + b_j); its mixing weights use the *unbiased* s, so b only moves the choice.

Algorithms (selected by `config.balancing`):

- ``quantile`` (default). After a step, with the bias b that was used in that step:

      alpha_i = (k+1)-th largest of s_i + b                (the "entry bar" of token i)
      r_ij    = alpha_i - s_ij                              (residual, [T, n])
      b'_j    = Q_j(m),  m = T k / n                        (balanced count per expert)
      b'      = b' - mean(b')

  Token i picks expert j (given the bars alpha) iff s_ij + b'_j > alpha_i, i.e. iff r_ij < b'_j.
  So expert j receives exactly #{i : r_ij < b'_j} tokens, and balance means that count is m.
  Q_j(m) is therefore the value with exactly m residuals of column j strictly below it. We use the
  Hazen (type-5) quantile at q = k/n: sort column j ascending (r_(0) <= ... <= r_(T-1)) and take the
  linear interpolation at position q*T - 0.5 = m - 0.5. For integer m this is the midpoint
  (r_(m-1) + r_(m)) / 2, which has exactly m residuals below it (ties aside), and it sits in the
  middle of the gap rather than on a sample. (torch.quantile's default position q*(T-1) = m - q also
  falls in (m-1, m), so it would balance too, only less symmetrically.) The bars alpha move when b
  changes, so one update is a fixed-point step; repeated on the same batch it converges (tests).
  Mean-centring does not change any top-k (a shift common to all experts) and keeps b bounded.

  Large batches (more than `quantile_exact_max_tokens` tokens in the step, summed over ranks) use a
  per-expert histogram of r instead of a sort/gather: B = `quantile_hist_bins` bins over [lo, hi]
  (the data range, agreed across data-parallel ranks by a MIN/MAX all-reduce), counts all-reduced
  (SUM), and the same quantile read off the interpolated CDF. Because k/n is small (1/16 here, 1/56
  for k3), one bin near the target can hold several percent of the m tokens, so a second level
  re-bins only the located coarse bin into B fine bins (a second SUM all-reduce of [n, B] counts):
  the estimate lies in the fine bin, width (hi - lo) / B^2, holding the m-th smallest residual.
  Point masses: the (k+1)-th expert of token i has r_ij = b_j exactly, so every column has an atom
  at its old bias; the exact path resolves it like any tie, the histogram places it in one fine bin.

- ``bias_sign`` (DeepSeek-V3 baseline): b_j += gamma * sign(mean_load - load_j) after each step.

- ``aux_loss`` (Switch / DeepSeek baseline): L = coef * sum_j f_j P_j with
  f_j = n / (k T) * #{i : j in T_i} and P_j = mean_i s_ij / sum_l s_il. Equal to coef at balance.

- ``none``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BALANCING_METHODS = ("quantile", "bias_sign", "aux_loss", "none")


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def routing_residuals(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """r_ij = alpha_i - s_ij with alpha_i the (k+1)-th largest of s_i + b.

    scores [T, n] fp32, bias [n] -> r [T, n] fp32. Requires k < n.
    """
    z = scores.float() + bias.float()
    alpha = z.topk(k + 1, dim=-1).values[:, -1:]  # [T, 1]
    return alpha - scores.float()


def exact_balancing_quantile(r: torch.Tensor, m: float, n_valid: int | None = None) -> torch.Tensor:
    """Per-column Hazen quantile at position m - 0.5 of the ascending sort (exactly m values below).

    r [T, n] (rows beyond the valid ones may be +inf padding, which sorts last), m = T_valid * k / n.
    Returns b [n] fp32.
    """
    T = r.shape[0] if n_valid is None else n_valid
    if T == 0:
        raise ValueError("exact_balancing_quantile needs at least one token")
    srt = r.float().sort(dim=0).values  # [T_pad, n]
    pos = min(max(m - 0.5, 0.0), T - 1.0)
    lo = int(pos)
    hi = min(lo + 1, T - 1)
    f = pos - lo
    return srt[lo] * (1.0 - f) + srt[hi] * f


def _bin_index(r: torch.Tensor, lo, width, bins: int) -> torch.Tensor:
    """floor((r - lo) / width) clamped to [0, bins - 1]; lo, width: floats or per-column [n] tensors."""
    return ((r.double() - lo) / width).floor().clamp_(0, bins - 1).long()


def column_histograms(r: torch.Tensor, bins: int, lo, hi, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-column histogram of r [T, n] over [lo, hi] (floats or per-column [n] tensors) with `bins` equal
    bins -> counts [n, bins] int64. Values outside [lo, hi] are clamped into the edge bins; only entries
    with mask [T, n] True are counted when a mask is given.
    """
    T, n = r.shape
    idx = _bin_index(r, lo, (hi - lo) / bins, bins)
    flat = (torch.arange(n, device=r.device) * bins).unsqueeze(0) + idx
    flat = flat[mask] if mask is not None else flat.reshape(-1)
    return torch.bincount(flat, minlength=n * bins).reshape(n, bins)


def _locate(counts: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For counts [n, bins] and per-column targets [n] (a count of values below), the bin beta holding the
    target, the count before that bin and the fraction (target - before) / count_in_bin: each [n]."""
    c = counts.double()
    cum = c.cumsum(dim=1)
    t = target.double().unsqueeze(1)
    beta = torch.searchsorted(cum.contiguous(), t, right=True).clamp_(max=counts.shape[1] - 1)  # [n, 1]
    in_bin = c.gather(1, beta)
    before = cum.gather(1, beta) - in_bin
    frac = ((t - before) / in_bin.clamp(min=1.0)).clamp(0.0, 1.0)
    return beta.squeeze(1), before.squeeze(1), frac.squeeze(1)


def _target(m: float, total: int, n: int, device) -> torch.Tensor:
    """The Hazen position m - 0.5 as a count of values below, clamped to [0, total - 0.5]; [n] fp64."""
    return torch.full((n,), min(max(m - 0.5, 0.0), total - 0.5), dtype=torch.float64, device=device)


def quantile_from_histogram(counts: torch.Tensor, m: float, lo: float, hi: float) -> torch.Tensor:
    """One-level estimate: invert the interpolated per-column CDF of counts [n, bins] at m - 0.5 -> [n] fp32.

    Mass in a bin is taken as uniform: the result lies in the bin holding the m-th smallest value.
    """
    n, bins = counts.shape
    beta, _, frac = _locate(counts, _target(m, int(counts[0].sum()), n, counts.device))
    return (lo + (beta.double() + frac) * ((hi - lo) / bins)).float()


def histogram_balancing_quantile(r: torch.Tensor, m: float, bins: int, lo: float, hi: float,
                                 total: int | None = None, reduce=None) -> torch.Tensor:
    """Two-level histogram estimate of the Hazen quantile (count m below) per column of r [T, n] -> [n] fp32.

    Level 1: `bins` bins over [lo, hi] locate, per expert, the coarse bin holding the target. Level 2:
    `bins` bins inside that coarse bin (only its values are counted) resolve it to width
    (hi - lo) / bins^2; the result lies in the fine bin holding the m-th smallest value. `reduce(counts)`
    sums the count tensors across data-parallel ranks (identity when None); `total` is the global count.
    """
    reduce = reduce or (lambda c: c)
    n = r.shape[1]
    total = r.shape[0] if total is None else total
    width = (hi - lo) / bins
    target = _target(m, total, n, r.device)
    coarse = reduce(column_histograms(r, bins, lo, hi))
    beta, before, _ = _locate(coarse, target)
    lo2 = lo + beta.double() * width  # [n]
    in_bin = _bin_index(r, lo, width, bins) == beta.unsqueeze(0)
    fine = reduce(column_histograms(r, bins, lo2, lo2 + width, mask=in_bin))
    beta2, _, frac2 = _locate(fine, target - before)
    return (lo2 + (beta2.double() + frac2) * (width / bins)).float()


def quantile_bias_update(
    scores: torch.Tensor, bias: torch.Tensor, k: int, exact_max_tokens: int = 65536, bins: int = 1024
) -> torch.Tensor:
    """One quantile-balancing step on one local batch: scores [T, n], bias [n] -> new b [n]."""
    acc = QuantileStats(k)
    acc.add(scores, bias)
    return acc.solve(scores.shape[1], exact_max_tokens, bins)


class QuantileStats:
    """Accumulates the residuals r of one optimizer step (over micro-batches) and solves for the new b.

    Memory: the residuals of the step, T_step x n fp32 (same size as the router scores). With
    torch.distributed initialised, the exact path gathers all ranks' residuals (+inf padded) and the
    histogram path all-reduces the per-bin counts, so every rank computes the same b.
    """

    def __init__(self, k: int, process_group=None) -> None:
        self.k = k
        self.process_group = process_group
        self._chunks: list[torch.Tensor] = []

    def add(self, scores: torch.Tensor, bias: torch.Tensor) -> None:
        if scores.shape[0]:
            self._chunks.append(routing_residuals(scores.detach(), bias.detach(), self.k))

    def clear(self) -> None:
        self._chunks = []

    @torch.no_grad()
    def solve(self, n: int, exact_max_tokens: int, bins: int,
              device: torch.device | str | None = None) -> torch.Tensor | None:
        """New mean-centred b [n] fp32 from the accumulated residuals, or None if no rank saw tokens.

        device: where a rank that saw no tokens this step builds its empty [0, n] residuals (the bias's
        device), so its all-reduce / all-gather tensors sit where the other ranks' do (NCCL needs CUDA).
        """
        device = self._chunks[0].device if self._chunks else device
        r = torch.cat(self._chunks) if self._chunks else torch.empty(0, n, device=device)
        self.clear()
        local = r.shape[0]
        total = local
        if _dist_active():
            t = torch.tensor([local], dtype=torch.int64, device=r.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
            total = int(t.item())
        if total == 0:
            return None
        m = total * self.k / n
        if total <= exact_max_tokens:
            if _dist_active():
                r = _gather_padded(r, self.process_group)
            b = exact_balancing_quantile(r, m, n_valid=total)
        else:
            lo = r.min().item() if local else float("inf")
            hi = r.max().item() if local else float("-inf")
            if _dist_active():
                ext = torch.tensor([-lo, hi], dtype=torch.float64, device=r.device)
                dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=self.process_group)
                lo, hi = -ext[0].item(), ext[1].item()
            if hi <= lo:
                hi = lo + 1e-6
            b = histogram_balancing_quantile(r, m, bins, lo, hi, total=total, reduce=self._sum_counts)
        return b - b.mean()

    def _sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if _dist_active():
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.process_group)
        return counts


def _gather_padded(r: torch.Tensor, group) -> torch.Tensor:
    """all_gather [T_rank, n] tensors of different T_rank: pad with +inf to the max T, concatenate."""
    world = dist.get_world_size(group)
    t = torch.tensor([r.shape[0]], dtype=torch.int64, device=r.device)
    sizes = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(sizes, t, group=group)
    tmax = max(int(s.item()) for s in sizes)
    pad = torch.full((tmax - r.shape[0], r.shape[1]), float("inf"), dtype=r.dtype, device=r.device)
    rp = torch.cat([r, pad]).contiguous()
    out = [torch.empty_like(rp) for _ in range(world)]
    dist.all_gather(out, rp, group=group)
    return torch.cat(out)


class SignStats:
    """Accumulates per-expert load counts of one step for the DeepSeek-V3 sign rule."""

    def __init__(self, n: int, process_group=None) -> None:
        self.n = n
        self.process_group = process_group
        self.counts = torch.zeros(n, dtype=torch.int64, device="cpu")  # not a buffer: never on meta

    def add(self, topk_idx: torch.Tensor) -> None:
        c = torch.bincount(topk_idx.reshape(-1), minlength=self.n)
        self.counts = self.counts.to(c.device) + c

    @torch.no_grad()
    def solve(self, bias: torch.Tensor, gamma: float) -> torch.Tensor | None:
        """b_j + gamma * sign(mean_load - load_j) [n] fp32, or None if no tokens were seen."""
        counts = self.counts.to(bias.device)
        self.counts = torch.zeros_like(counts)
        if _dist_active():
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.process_group)
        if int(counts.sum()) == 0:
            return None
        load = counts.double()
        return sign_bias_update(bias, load, gamma)


def sign_bias_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3 auxiliary-loss-free rule: b_j += gamma * sign(mean(load) - load_j)."""
    load = load.double()
    return (bias.double() + gamma * torch.sign(load.mean() - load)).float()


def aux_balance_loss(scores: torch.Tensor, topk_idx: torch.Tensor, n: int, coef: float) -> torch.Tensor:
    """coef * sum_j f_j P_j; scores [T, n] (sigmoid, with grad), topk_idx [T, k]. f_j = n/(kT) load_j,
    P_j = mean_i s_ij / sum_l s_il. Scalar fp32; equals coef when load and probabilities are uniform.
    """
    T, k = topk_idx.shape
    if T == 0:
        return scores.sum() * 0.0
    load = torch.bincount(topk_idx.reshape(-1), minlength=n).to(scores.dtype)
    f = load * (n / (k * T))
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    return coef * (f * p).sum()
