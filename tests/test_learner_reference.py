"""`Learner.step` (packed micro-batches, routing replay, chunked LM head) equals the reference step of
rl/learner/reference.py (one episode per forward, written top to bottom) on the same batch and weights."""

from __future__ import annotations

import copy

import pytest
import torch

from rl.learner import Learner
from rl.learner.reference import reference_step
from tests.learner_fixtures import ragged_batch, small_config


@pytest.mark.parametrize(
    "learner_keys",
    [
        {"advantage": "grpo", "scale_rewards": "group"},
        {"advantage": "rloo", "scale_rewards": "batch", "negative_advantage_weight": 0.5, "tis_cap": 1.0},
    ],
    ids=["grpo", "rloo-batch-scale-tis"],
)
def test_learner_step_equals_the_reference_step(learner_keys):
    cfg = small_config(lr=1e-3, micro_batch_tokens=96, **learner_keys)
    trajs = ragged_batch(seed=1)
    learner = Learner(cfg)
    policy = copy.deepcopy(learner.policy)
    lc = cfg.learner
    opt = torch.optim.AdamW(policy.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                            weight_decay=lc.weight_decay)
    want = reference_step(policy, opt, trajs, lc)
    got = learner.step(trajs)
    assert want["trained_trajectories"] == got["learner/trained_trajectories"] == 8
    assert want["tokens_scored"] == got["learner/tokens_scored"]
    assert got["learner/micro_batches"] > 1  # the learner packed several episodes per forward
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-8)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # the clipped gradients both steps applied (Adam's first step, ~lr * sign(g), would hide small ones)
    grads = [(n, a.grad, b.grad) for (n, a), b in zip(learner.policy.named_parameters(), policy.parameters())]
    assert sum(a is not None for _, a, _ in grads) > 10
    scale = max(float(a.abs().max()) for _, a, _ in grads if a is not None)
    for name, a, b in grads:
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_the_reference_refuses_what_it_does_not_cover():
    cfg = small_config(policy_loss="gspo", kl_coef=0.1)
    with pytest.raises(ValueError, match="learner.policy_loss, learner.kl_coef differ from it"):
        reference_step(torch.nn.Linear(1, 1), None, [], cfg.learner)
