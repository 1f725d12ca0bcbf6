"""Routing replay (R3) bookkeeping: how often the learner's own routing agrees with the rollout's.

With `learner.routing_replay: true` every learner forward is given the experts the rollout engine used
(`Trajectory.routed_experts`, axis order = `model.moe_layer_indices`), packed like the tokens, so the
gradient flows through exactly the experts that produced the sampled tokens (the router keeps its gradient
through the weights p; model/moe.py). With it off the learner routes freely, and this module measures the
drift: per MoE layer, the fraction of tokens whose top-k expert *set* equals the rollout's.
"""

from __future__ import annotations

import torch


def routing_agreement(learner: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """Tokens whose top-k set matches, per MoE layer: learner, rollout [L, n_moe, k] (any int dtype) ->
    int64 [n_moe] counts (divide by L for the fraction)."""
    if learner.shape != rollout.shape:
        raise ValueError(f"routed experts {tuple(learner.shape)} and {tuple(rollout.shape)} differ in shape")
    a = learner.long().sort(dim=-1).values
    b = rollout.to(a.device).long().sort(dim=-1).values
    return (a == b).all(dim=-1).sum(dim=0)


__all__ = ["routing_agreement"]
