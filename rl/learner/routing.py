"""Routing replay (R3) bookkeeping: how often the learner's own routing agrees with the rollout's.

With `learner.routing_replay: true` every learner forward is given the experts the rollout engine used
(`Trajectory.routed_experts`, axis order = `model.moe_layer_indices`), packed like the tokens, so the
gradient flows through exactly the experts that produced the sampled tokens (the router keeps its gradient
through the weights p; model/moe.py). With it off the learner routes freely, and this module measures the
drift: per MoE layer, the fraction of tokens whose top-k expert *set* equals the rollout's.

With it on, `replay_agreement` measures the same thing inside the replayed forwards: a forward hook on each
MoE router compares the router's own free choice topk(s + b) (from the scores the replayed forward computes
anyway) with the replayed set, so `1 - agreement` is the share of tokens whose experts replay changed.
An HF MoE policy (model/hf_routing.py) counts the same in its own router hooks: `policy_replay_agreement`
picks the right one, `expert_layout` gives either model's [n_experts, k].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def routing_agreement(learner: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """Tokens whose top-k set matches, per MoE layer: learner, rollout [L, n_moe, k] (any int dtype) ->
    int64 [n_moe] counts (divide by L for the fraction)."""
    if learner.shape != rollout.shape:
        raise ValueError(f"routed experts {tuple(learner.shape)} and {tuple(rollout.shape)} differ in shape")
    a = learner.long().sort(dim=-1).values
    b = rollout.to(a.device).long().sort(dim=-1).values
    return (a == b).all(dim=-1).sum(dim=0)


@contextlib.contextmanager
def replay_agreement(
    routers: Sequence[torch.nn.Module], agree: torch.Tensor, counted: list[float]
) -> Iterator[None]:
    """While open, every router forward given replay_experts adds, per MoE layer j (routers in
    moe_layer_indices order), the tokens whose free top-k set equals the replayed set to agree[j] (float64
    [n_moe]), and the first router adds its token count to counted[0]. Routers called without replay add
    nothing. The router's forward(x [T, D], replay [T, k]) returns (scores [T, n], idx [T, k], weights)."""

    on_device: list[torch.Tensor | None] = [None] * len(routers)  # counts stay on the device until the end

    def hook(j: int):
        def count(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            replay = args[1] if len(args) > 1 else None
            if replay is None:
                return
            with torch.no_grad():
                free = module.select(output[0])
                n = routing_agreement(free[:, None, :], output[1][:, None, :])[0]
                on_device[j] = n if on_device[j] is None else on_device[j] + n
            if j == 0:
                counted[0] += float(output[1].shape[0])

        return count

    handles = [r.register_forward_hook(hook(j)) for j, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for j, n in enumerate(on_device):
            if n is not None:
                agree[j] += float(n)


def expert_layout(policy: torch.nn.Module) -> tuple[int, int]:
    """(routed experts per MoE layer, top-k) of the policy: Odyssey's from its config, an HF MoE's from its
    routers (model/hf_routing.py); (0, 0) for a dense model."""
    if not policy.moe_layer_indices:
        return 0, 0
    if getattr(policy, "routing", None) is not None:  # model.hf_policy.HFPolicy of an HF MoE
        return policy.n_routed_experts, policy.num_experts_per_tok
    return policy.config.n_routed_experts, policy.config.num_experts_per_tok


def policy_replay_agreement(policy: torch.nn.Module, replay: bool, agree: torch.Tensor,
                            counted: list[float]) -> contextlib.AbstractContextManager:
    """`replay_agreement` for the policy's MoE layers while `replay` is on (a null context otherwise):
    Odyssey's routers through the hook above, an HF MoE's through its router hooks (model/hf_routing.py
    `HFRouting.agreement`, same counts)."""
    if not replay or not policy.moe_layer_indices:
        return contextlib.nullcontext()
    if getattr(policy, "routing", None) is not None:
        return policy.routing.agreement(agree, counted)
    return replay_agreement([m.router for m in policy.moe_layers()], agree, counted)


__all__ = ["expert_layout", "policy_replay_agreement", "routing_agreement", "replay_agreement"]
