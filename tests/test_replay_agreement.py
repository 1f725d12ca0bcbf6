"""Routing agreement with routing replay (R3) on: how much replay changed, per MoE layer, measured inside
the replayed forwards (rl/learner/routing.py `replay_agreement`); and the balancer's bias range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.learner import Learner
from tests.learner_fixtures import ragged_batch, small_config


def _own_routing(learner: Learner, trajs) -> None:
    """Record, as the rollout's routed experts, the policy's own free choice on each trajectory."""
    for t in trajs:
        with torch.no_grad():
            ids = torch.from_numpy(t.tokens.astype(np.int64))
            t.routed_experts = learner.policy(ids, return_routed_experts=True).routed_experts.numpy().astype(
                np.uint16
            )


def _never_chosen_at_last_layer(learner: Learner, trajs) -> None:
    """Replace the last MoE layer's recorded experts by the k experts the router ranks lowest (s + b), a
    set its free choice never equals; replay at the last layer cannot change the layers before it."""
    moe = learner.policy.model.layers[learner.policy.moe_layer_indices[-1]].mlp
    router = moe.router
    captured = []  # the MoE layer's input x [T, D]
    handle = moe.register_forward_pre_hook(
        lambda m, args: captured.append(args[0].reshape(-1, args[0].shape[-1]))
    )
    try:
        for t in trajs:
            captured.clear()
            with torch.no_grad():
                learner.policy(torch.from_numpy(t.tokens.astype(np.int64)))
            s = router.scores(captured[0]) + router.e_score_correction_bias
            worst = (-s).topk(router.k, dim=-1).indices  # [T, k]
            re = t.routed_experts.copy()
            re[:, -1, :] = worst.numpy().astype(np.uint16)
            t.routed_experts = re
    finally:
        handle.remove()


@pytest.mark.parametrize("replay", [True, False])
def test_agreement_is_one_on_own_routing_and_zero_where_the_recording_is_never_chosen(replay):
    """Same numbers with R3 on (free choice vs the replayed set, inside the replayed forward) and off (the
    learner's free routing vs the recording): 1.0 on the policy's own routing; with the last layer's
    recording replaced by experts the router never picks, that layer 0.0 and the others 1.0."""
    learner = Learner(small_config(routing_replay=replay))
    trajs = ragged_batch(seed=8)
    _own_routing(learner, trajs)
    fresh = Learner(small_config(routing_replay=replay))  # same seed: same weights as `learner`
    m = fresh.step(trajs)
    layers = fresh.policy.moe_layer_indices
    assert m["learner/routing_agreement"] == 1.0
    assert all(m[f"learner/routing_agreement/layer{l}"] == 1.0 for l in layers)
    if replay:
        assert m["learner/replay_changed"] == 0.0
    else:
        assert "learner/replay_changed" not in m
    _never_chosen_at_last_layer(learner, trajs)
    m = Learner(small_config(routing_replay=replay)).step(trajs)
    assert m[f"learner/routing_agreement/layer{layers[-1]}"] == 0.0
    assert all(m[f"learner/routing_agreement/layer{l}"] == 1.0 for l in layers[:-1])
    assert m["learner/routing_agreement"] == pytest.approx((len(layers) - 1) / len(layers))
    if replay:
        assert m["learner/replay_changed"] == pytest.approx(1 / len(layers))


def test_bias_range_is_the_spread_of_each_layers_balancing_bias():
    learner = Learner(small_config(lr=1e-3))
    trajs = ragged_batch(seed=3)
    m = learner.step(trajs)
    m = learner.step(trajs)
    spreads = []
    for l in learner.policy.moe_layer_indices:
        b = learner.policy.model.layers[l].mlp.router.e_score_correction_bias
        spreads.append(float(b.max() - b.min()))
        assert m[f"moe/layer{l}/bias_range"] == spreads[-1]
    assert m["moe/bias_range_max"] == max(spreads) > 0.0  # the balancer moved the biases apart
