"""Packing: first-fit decreasing bins, and the oracle that the learner's packed, micro-batched loss and
gradients equal the per-sequence, unpadded computation (rel <= 1e-5, fp32), with routing replay on and off,
over ragged lengths down to a single model input. R3 under packing routes every token to its recorded
experts, checked inside the MoE layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.learner import Learner
from rl.learner.losses import aggregation_weights, objective
from rl.learner.packing import collate, pack
from tests.learner_fixtures import ragged_batch, small_config

REL = 1e-5


def test_pack_first_fit_decreasing_hand_example():
    # visit 9, 8, 5, 3, 2: 9 -> new bin, 8 -> new bin, 5 -> new bin, 3 -> third bin (room 5), 2 -> second bin
    assert pack([5, 3, 8, 2, 9], 10) == [[4], [2, 3], [0, 1]]
    # an over-long item gets a bin of its own, nothing joins it
    assert pack([12, 1, 1], 10) == [[0], [1, 2]]
    assert pack([], 10) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 40))
def test_pack_properties(lengths, budget):
    bins = pack(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every item exactly once
    sums = [sum(lengths[i] for i in b) for b in bins]
    for b, total in zip(bins, sums):
        assert total <= budget or len(b) == 1  # within budget, or a lone over-long item
    # first fit: a bin was opened only when its first item fitted in no earlier bin, so no two bins could
    # have been one (their sizes add up to more than the budget)
    assert all(sums[i] + sums[j] > budget for i in range(len(bins)) for j in range(i + 1, len(bins)))
    # decreasing: within a bin, items arrive longest first
    assert all([lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True) for b in bins)
    assert pack(lengths, budget) == bins  # deterministic


def _per_sequence_loss(policy, samples, n_tokens, n_episodes, lc, max_tokens, replay):
    """The slow reference: every trajectory alone through token_logprobs (no packing, no padding), same
    objective and normalisers, losses summed."""
    total = 0.0
    for s in samples:
        ids = torch.from_numpy(s.input_ids)
        targets = torch.from_numpy(np.concatenate([s.input_ids[1:], s.targets[-1:]]))
        targets[torch.from_numpy(s.scored)] = torch.from_numpy(s.targets)
        rep = torch.from_numpy(s.replay.astype(np.int64)) if replay else None
        lp = policy.token_logprobs(ids, targets, replay_experts=rep)[torch.from_numpy(s.scored)].double()
        seq = torch.zeros(s.n_scored, dtype=torch.int64)
        seq_tokens = torch.tensor([s.n_scored])
        c = aggregation_weights(lc.loss_agg, seq, seq_tokens, n_episodes, n_tokens, max_tokens)
        loss, _ = objective(lp, torch.from_numpy(s.old_logp), torch.from_numpy(s.advantages), seq, seq_tokens,
                            c, n_tokens, policy=lc.policy_loss, clip_eps_low=lc.clip_eps_low,
                            clip_eps_high=lc.clip_eps_high)
        total = total + loss
    return total


def _grads(module):
    return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])


@pytest.mark.parametrize("routing_replay", [True, False], ids=["r3", "free-routing"])
@pytest.mark.parametrize("loss_agg,policy", [("token_mean", "ppo_clip"), ("seq_mean_token_mean", "gspo"),
                                             ("seq_mean_token_sum", "cispo")])
def test_packed_loss_and_gradients_equal_per_sequence(routing_replay, loss_agg, policy):
    cfg = small_config(routing_replay=routing_replay, micro_batch_tokens=96, loss_agg=loss_agg,
                       policy_loss=policy, tis_cap=None)
    learner = Learner(cfg)
    trajs = ragged_batch(seed=3)
    trajs[0] = ragged_batch(seed=4, lengths=[2] * 8)[0]  # one model input, one scored token
    trajs[0].metadata["group_id"] = "g0"
    samples = learner.prepare(trajs).samples
    assert len(samples) == 8 and samples[0].n_tokens == 1
    for s in samples:  # pi_old != pi, so ratios move and both clip branches are live
        s.old_logp = s.rollout_logp.astype(np.float64)
    n_tokens, n_episodes = sum(s.n_scored for s in samples), len(samples)
    assert len(pack([s.n_tokens for s in samples], 96)) > 1  # several micro-batches: accumulation is tested
    packed = learner.accumulate(samples, n_tokens, n_episodes, fused_old=False)
    g_packed = _grads(learner.policy).clone()
    learner.policy.zero_grad(set_to_none=True)
    ref = _per_sequence_loss(learner.policy, samples, n_tokens, n_episodes, cfg.learner,
                             cfg.rollout.max_tokens, routing_replay)
    ref.backward()
    g_ref = _grads(learner.policy)
    # the loss is a sum of +-A terms that nearly cancel (advantages have zero mean per group): relative to
    # the size of its terms (mean |A|), not to the sum, or fp32 rounding of the terms reads as a large error
    scale = max(abs(float(ref)), float(np.mean([np.abs(s.advantages).mean() for s in samples])))
    assert abs(packed - float(ref)) <= REL * scale, (packed, float(ref), scale)
    rel = float((g_packed - g_ref).norm() / g_ref.norm())
    assert rel <= REL, rel
    assert g_ref.norm() > 0


def test_r3_under_packing_routes_every_token_to_its_recorded_experts():
    """Hooks on every LatentMoE see the experts it ran; under replay they are the trajectory's recorded ones,
    token for token, across sequence boundaries of the packed micro-batch."""
    cfg = small_config(routing_replay=True, micro_batch_tokens=10_000)
    learner = Learner(cfg)
    samples = learner.prepare(ragged_batch(seed=5)).samples
    seen = {}
    hooks = [moe.register_forward_hook(lambda m, i, o, l=l: seen.__setitem__(l, o[1].clone()))
             for l, moe in enumerate(learner.policy.moe_layers())]
    mb = collate(samples, with_replay=True)
    with torch.no_grad():
        learner.module(mb, replay=True)
        replayed = dict(seen)
        free = learner.module(mb, replay=False, return_routed=True).routed
    for h in hooks:
        h.remove()
    recorded = torch.from_numpy(np.concatenate([s.replay for s in samples]).astype(np.int64))
    assert len(replayed) == 3
    for l, idx in replayed.items():
        assert torch.equal(idx, recorded[:, l]), l
    assert not torch.equal(free, recorded)  # the recorded experts are not simply the free choice


def test_no_whole_vocab_logits_tensor_in_forward_or_backward(monkeypatch):
    """The LM head runs in chunks of HEAD_CHUNK_ELEMENTS / vocab rows, in the forward and in the backward's
    recompute: a dispatch mode sees every tensor any aten op produces during a whole learner micro-batch
    (forward, loss, backward) and none with a vocab-wide last dim has more rows than one chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import rl.learner.forward as fwd

    cfg = small_config(micro_batch_tokens=10_000)
    learner = Learner(cfg)
    samples = learner.prepare(ragged_batch(seed=6)).samples
    for s in samples:
        s.old_logp = s.rollout_logp.astype(np.float64)
    vocab, hidden = learner.policy.lm_head.weight.shape
    rows = 16  # head_logprobs' minimum chunk
    monkeypatch.setattr(fwd, "HEAD_CHUNK_ELEMENTS", rows * vocab)
    n_scored = sum(s.n_scored for s in samples)
    assert n_scored > max(4 * rows, hidden)  # several chunks, so a whole [L, vocab] tensor would be caught
    weight_t = (hidden, vocab)  # the head weight (and its gradient) transposed: not logits

    class WidestVocabTensor(TorchDispatchMode):
        most_rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab and \
                        tuple(t.shape) != weight_t:
                    self.most_rows = max(self.most_rows, t.numel() // vocab)
            return out

    with WidestVocabTensor() as seen:
        learner.accumulate(samples, n_scored, len(samples), fused_old=False)
    assert 0 < seen.most_rows <= rows, seen.most_rows  # the head ran, in chunks only
    assert _grads(learner.policy).norm() > 0
