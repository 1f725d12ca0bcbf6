"""Off-policy correction between the rollout engine (behaviour policy mu) and the learner (pi_old).

The rollout engine's log-probs (`Trajectory.rollout_logprobs`) and the learner's recomputed ones differ: a
different kernel, precision or batch layout, or weights that moved since the episode was generated
(bounded staleness). Per generated token, with log rho_t = log pi_old(y_t) - log mu(y_t):

    TIS (truncated importance sampling):   w_t = min(rho_t, tis_cap)
    MIS (masked importance sampling), token level:     w_t *= [lo <= rho_t <= hi]
                                      sequence level:  w_t *= [lo <= rho_seq <= hi],
                                                       rho_seq = exp(sum_{t in episode} log rho_t)

`w` multiplies the per-token policy loss (never the KL term), with no gradient: it reweights which samples
the update trusts. These are TRL's `vllm_importance_sampling_mode` = token_truncate / token_mask /
sequence_mask rules (a masked token keeps its place in the normaliser, with weight 0).

Metrics (per scored token, over the step): KL(mu || pi_old) by the k3 estimator E_mu[rho - 1 - log rho]
(>= 0), the mean and max of rho, the fraction of tokens MIS masked and the fraction TIS truncated.
"""

from __future__ import annotations

import torch


def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    seq: torch.Tensor,
    n_seqs: int,
    tis_cap: float | None,
    mis_band: tuple[float, float] | list[float] | None,
    mis_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IS weights [M] (float64, no grad) for scored tokens, and metric sums.

    old_logp, rollout_logp [M]; seq int64 [M] (sequence of each token, 0..n_seqs-1). Returns (w, sums) with
    sums = {"tokens", "ratio_sum", "ratio_max", "kl_sum", "masked", "truncated"} (0-dim float64 tensors)."""
    log_rho = old_logp.detach().double() - rollout_logp.double()
    rho = log_rho.exp()
    w = torch.ones_like(rho)
    truncated = torch.zeros_like(rho, dtype=torch.bool)
    if tis_cap is not None:
        truncated = rho > tis_cap
        w = rho.clamp(max=tis_cap)
    masked = torch.zeros_like(truncated)
    if mis_band is not None:
        lo, hi = float(mis_band[0]), float(mis_band[1])
        if mis_level == "token":
            r = rho
        elif mis_level == "sequence":
            per_seq = torch.zeros(n_seqs, dtype=torch.float64, device=log_rho.device)
            r = per_seq.index_add_(0, seq, log_rho).exp()[seq]
        else:
            raise ValueError(f"mis_level must be 'token' or 'sequence', got {mis_level!r}")
        masked = (r < lo) | (r > hi)
        w = w.masked_fill(masked, 0.0)
    sums = {
        "tokens": torch.tensor(float(rho.numel()), dtype=torch.float64),
        "ratio_sum": rho.sum(),
        "ratio_max": rho.max() if rho.numel() else torch.zeros((), dtype=torch.float64),
        "kl_sum": (rho - 1.0 - log_rho).sum(),
        "masked": masked.sum().double(),
        "truncated": (truncated & ~masked).sum().double(),
    }
    return w, sums


__all__ = ["correction_weights"]
