"""Advantages and masking: GRPO / RLOO on hand-computed groups, GAE against the slow reverse loop, turn-level
credit on a 3-turn hand example, and what is excluded (never scored as zero)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.config import LearnerSection
from rl.learner.advantages import (
    discounted_cumsum,
    gae,
    gae_reference,
    group_advantages,
    raft_advantages,
    turn_returns,
    weight_negative,
)
from rl.learner.batch import ModelFacts, prepare_batch
from rl.learner.selection import select
from tests.traj_factory import make_traj

FACTS = ModelFacts(vocab_size=4096, n_moe_layers=3, n_experts=64, top_k=2, tokenizer="fp-ok")


def test_grpo_and_rloo_on_hand_computed_groups():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0]
    g = ["a", "a", "a", "a", "b", "b"]
    # group a: mean 0.5, Bessel std sqrt(1/3); group b: mean 3, std sqrt(2)
    sa, sb = math.sqrt(1 / 3), math.sqrt(2)
    want = [0.5 / (sa + 1e-4), -0.5 / (sa + 1e-4), -0.5 / (sa + 1e-4), 0.5 / (sa + 1e-4),
            -1 / (sb + 1e-4), 1 / (sb + 1e-4)]
    assert torch.allclose(group_advantages(r, g), torch.tensor(want, dtype=torch.float64), atol=1e-12)
    # Dr.GRPO: no std
    assert group_advantages(r, g, scale="none").tolist() == [0.5, -0.5, -0.5, 0.5, -1.0, 1.0]
    # batch std: every reward's Bessel std
    sbatch = float(np.std(r, ddof=1))
    got = group_advantages(r, g, scale="batch")
    assert torch.allclose(got, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0], dtype=torch.float64) /
                          (sbatch + 1e-4), atol=1e-12)
    # RLOO: r_i - mean of the others. a: member 0 -> 1 - (0+0+1)/3 = 2/3
    rloo = group_advantages(r, g, baseline="rloo", scale="none").tolist()
    assert rloo == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0], abs=1e-12)


def test_group_advantages_refuse_a_group_of_one():
    with pytest.raises(ValueError, match="group 'x' has 1 member"):
        group_advantages([1.0, 0.0, 1.0], ["x", "y", "y"])


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 300])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 1.0)])
def test_gae_matches_slow_reverse_loop(n, gamma, lam):
    g = torch.Generator().manual_seed(n)
    r = torch.randn(n, generator=g, dtype=torch.float64)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    adv, ret = gae(r, v, gamma, lam)
    ref_adv, ref_ret = gae_reference(r.tolist(), v.tolist(), gamma, lam)
    assert max(abs(a - b) for a, b in zip(adv.tolist(), ref_adv)) < 1e-9
    assert max(abs(a - b) for a, b in zip(ret.tolist(), ref_ret)) < 1e-9


def test_discounted_cumsum_long_sequence():
    x = torch.rand(10_000, dtype=torch.float64)
    got = discounted_cumsum(x, 0.999)
    want, acc = [0.0] * x.numel(), 0.0
    for t in range(x.numel() - 1, -1, -1):
        acc = float(x[t]) + 0.999 * acc
        want[t] = acc
    assert max(abs(a - b) for a, b in zip(got.tolist(), want)) < 1e-9 * max(want)


def _scored(traj, outcome: float, turn_rewards: list[float], **meta):
    traj.rewards = {"total": outcome + sum(turn_rewards), "outcome": outcome}
    traj.turn_rewards = list(turn_rewards)
    traj.metadata.update(meta)
    return traj


LAYOUT3 = [("prompt", 4), ("assistant", 3), ("observation", 2), ("assistant", 2), ("observation", 2),
           ("assistant", 4)]


def test_turn_level_credit_three_turn_hand_example():
    """Turn rewards [0.1, -0.1, 0.3], gamma 0.5: returns-to-go G = [0.1 - 0.05 + 0.075, -0.1 + 0.15, 0.3]
    = [0.125, 0.05, 0.3]. The outcome part (group-normalised) is shared by all three turns."""
    assert turn_returns([0.1, -0.1, 0.3], 0.5).tolist() == pytest.approx([0.125, 0.05, 0.3], abs=1e-12)
    a = _scored(make_traj(LAYOUT3, seed=1), 1.0, [0.1, -0.1, 0.3], group_id="g")
    b = _scored(make_traj(LAYOUT3, seed=2), 0.0, [0.1, -0.1, 0.3], group_id="g")
    lc = LearnerSection(group_size=2, turn_credit=True, gamma=0.5, scale_rewards="none", routing_replay=False)
    samples = prepare_batch([a, b], FACTS, lc).samples
    for s, outcome_adv in zip(samples, [0.5, -0.5]):
        # scored j predicts token j + 1: turn 0 = tokens 4..6, turn 1 = 9..10, turn 2 = 13..16
        turn_of = {4: 0, 5: 0, 6: 0, 9: 1, 10: 1, 13: 2, 14: 2, 15: 2, 16: 2}
        want = [outcome_adv + [0.125, 0.05, 0.3][turn_of[int(j) + 1]] for j in s.scored]
        assert s.advantages.tolist() == pytest.approx(want, abs=1e-12)
    # without turn credit the total reward is the group statistic and every token gets the same advantage
    lc = LearnerSection(group_size=2, scale_rewards="none", routing_replay=False)
    samples = prepare_batch([a, b], FACTS, lc).samples
    assert samples[0].advantages.tolist() == [0.5] * 9 and samples[1].advantages.tolist() == [-0.5] * 9


def _group(rewards, group="g", **fields):
    out = []
    for i, r in enumerate(rewards):
        t = make_traj([("prompt", 3), ("assistant", 4)], seed=10 + i, **fields)
        out.append(_scored(t, r, [0.0], group_id=group, tokenizer="fp-ok"))
    return out


def test_infra_failed_member_changes_nothing_for_the_others():
    """Masking, never fake rewards: an infra-failed member leaves its group's other advantages exactly as if
    it had never been there (its would-be reward does not enter the mean or the std)."""
    clean = _group([1.0, 0.0, 0.5])
    failed = make_traj([("prompt", 3), ("assistant", 4)], seed=99, infra_error="sandbox died")
    failed.metadata.update(group_id="g", tokenizer="fp-ok")
    lc = LearnerSection(group_size=4, routing_replay=False)
    with_failed = prepare_batch(clean + [failed], FACTS, lc)
    without = prepare_batch(clean, FACTS, lc)
    assert [s.index for s in with_failed.samples] == [0, 1, 2]
    for a, b in zip(with_failed.samples, without.samples):
        assert a.advantages.tolist() == b.advantages.tolist()
    assert with_failed.metrics["learner/infra_errors"] == 1.0 and without.metrics["learner/infra_errors"] == 0


def test_selection_counts_every_exclusion():
    g_ok = _group([1.0, 0.0], group="ok")
    g_equal = _group([1.0, 1.0, 1.0], group="equal")
    g_small = _group([1.0], group="small")
    bad_reward = make_traj([("prompt", 3), ("assistant", 4)], seed=50, reward_error="reward 'x' raised")
    bad_reward.metadata["group_id"] = "small"
    unscored = make_traj([("prompt", 3), ("assistant", 4)], seed=51, metadata={"group_id": "ok"})
    truncated = _group([0.5], group="ok")[0]
    truncated.truncated = True
    batch = g_ok + g_equal + g_small + [bad_reward, unscored, truncated]
    sel = select(batch, grouped=True, group_size=4, overlong_filter=True)
    assert sel.kept == [0, 1]  # the truncated member stays in group "ok"'s statistics but not in the loss
    assert sorted(sel.groups["ok"]) == [0, 1, 8]
    assert sel.counts == {
        "infra_errors": 0, "reward_errors": 1, "unscored": 1, "no_generated": 0, "small_groups": 1,
        "small_group_members": 1, "equal_groups": 1, "equal_group_members": 3, "no_success_groups": 0,
        "unsuccessful": 0, "below_best": 0, "overlong_filtered": 1,
    }
    # gae: no groups, only the trainability rules and the overlong filter
    assert select(batch, grouped=False, group_size=1, overlong_filter=False).kept == [0, 1, 2, 3, 4, 5, 8]


def test_oversized_group_is_refused_with_its_members_named():
    trajs = _group([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"group 'g' has 3 trajectories \(trajectory 0 \(group_id='g'\)"):
        select(trajs, grouped=True, group_size=2)


def test_gae_samples_get_placed_token_rewards():
    t = _scored(make_traj(LAYOUT3, seed=3), 1.0, [0.1, -0.1, 0.3], group_id="g", tokenizer="fp-ok")
    lc = LearnerSection(advantage="gae", group_size=1, routing_replay=False)
    (s,) = prepare_batch([t], FACTS, lc).samples
    # last generated token of each turn carries its turn reward; the episode's last carries the outcome
    assert s.rewards.tolist() == pytest.approx([0, 0, 0.1, 0, -0.1, 0, 0, 0, 1.3], abs=1e-6)
    assert s.advantages is None  # GAE needs the value model (the learner's first pass)


def test_negative_advantage_weight_scales_only_negative_tokens():
    adv = torch.tensor([1.5, -0.5, 0.0, -2.0], dtype=torch.float64)
    assert torch.equal(weight_negative(adv, 1.0), adv)
    f64 = torch.float64
    assert torch.equal(weight_negative(adv, 0.25), torch.tensor([1.5, -0.125, 0.0, -0.5], dtype=f64))
    assert torch.equal(weight_negative(adv, 0.0), torch.tensor([1.5, 0.0, 0.0, 0.0], dtype=f64))


def test_raft_trains_each_groups_best_successes_with_one_unit_of_weight_per_group():
    """raft: an all-success group is kept (grpo would drop it), an all-failure group is dropped and counted,
    failed members and successes below the group's best total reward (a detour the process reward marked
    down) are left out, and the kept members of a group share one unit of weight, identical or not."""
    assert raft_advantages(["a", "a", "b", "a"]).tolist() == [1 / 3, 1 / 3, 1.0, 1 / 3]
    solved = _group([1.0, 1.0, 1.0], group="solved")
    for t in solved:
        t.outcome = 1.0
    ranked = _group([1.2, 0.9, 1.2, 0.0], group="ranked")
    for t, won in zip(ranked, [1.0, 1.0, 1.0, 0.0]):
        t.outcome = won
    mixed = _group([1.0, 0.0], group="mixed")
    mixed[0].outcome, mixed[1].outcome = 1.0, 0.0
    failed = _group([0.0, 0.0], group="failed")
    for t in failed:
        t.outcome = 0.0
    batch = solved + ranked + mixed + failed
    sel = select(batch, grouped=True, group_size=4, successes_only=True)
    assert sel.kept == [0, 1, 2, 3, 5, 7]
    assert sel.counts["no_success_groups"] == 1 and sel.counts["unsuccessful"] == 4
    assert sel.counts["below_best"] == 1
    assert select(batch, grouped=True, group_size=4).counts["equal_groups"] == 2  # grpo drops solved too
    lc = LearnerSection(advantage="raft", group_size=4, routing_replay=False)
    prepared = prepare_batch(batch, FACTS, lc)
    adv = {s.index: set(s.advantages.tolist()) for s in prepared.samples}
    assert adv == {0: {1 / 3}, 1: {1 / 3}, 2: {1 / 3}, 3: {0.5}, 5: {0.5}, 7: {1.0}}
    assert prepared.metrics["learner/below_best"] == 1.0


def _varied_group(rewards, group, lengths):
    """A group of one-turn trajectories with the given completion lengths (scored tokens differ per member,
    so token and episode normalisers differ)."""
    return [_scored(make_traj([("prompt", 3), ("assistant", n)], seed=50 + 7 * i + len(group)), r, [0.0],
                    group_id=group, tokenizer="fp-ok")
            for i, (r, n) in enumerate(zip(rewards, lengths))]  # fmt: skip


LOSS_AGGS_TRL = [("token_mean", "dapo"), ("seq_mean_token_mean", "grpo"), ("seq_mean_token_sum", "dr_grpo")]


@pytest.mark.parametrize("loss_agg,trl_type", LOSS_AGGS_TRL)
def test_equal_groups_in_normaliser_is_trls_loss_over_every_group(loss_agg, trl_type):
    """TRL trains an all-equal group at advantage 0, so its tokens and episodes count in the loss normaliser.
    Ours drops the group from the batch; with learner.equal_groups_in_normaliser they still count, through
    selection -> prepare_batch -> plan_step. Oracle: TRL's own `_compute_loss` over every group (the tied
    rows at advantage 0) equals ours' loss over the kept groups, value and gradient within 1e-9. Without the
    option ours' normaliser is the kept groups' only (a larger loss)."""
    from rl.learner.losses import aggregation_weights, objective
    from rl.learner.sharding import plan_step
    from tests.trl_oracle import trl_loss

    batch = (_varied_group([1.0, 0.0, 0.5, 0.0], "a", [4, 2, 6, 3])
             + _varied_group([1.0, 1.0, 1.0, 1.0], "tied", [5, 1, 7, 2])
             + _varied_group([0.0, 2.0, 0.0, 1.0], "b", [3, 8, 2, 4]))  # fmt: skip
    max_tokens = 16
    lc = LearnerSection(group_size=4, routing_replay=False, loss_agg=loss_agg)
    prepared = prepare_batch(batch, FACTS, lc.model_copy(update={"equal_groups_in_normaliser": True}))
    tied_scored = [int(np.count_nonzero(t.loss_mask[1:])) for t in batch[4:8]]
    assert (prepared.extra_tokens, prepared.extra_episodes) == (sum(tied_scored), 4)
    assert prepared.metrics["learner/equal_group_tokens"] == sum(tied_scored)
    assert sorted(s.index for s in prepared.samples) == [0, 1, 2, 3, 8, 9, 10, 11]
    plain = prepare_batch(batch, FACTS, lc)
    assert (plain.extra_tokens, plain.extra_episodes) == (0, 0)
    assert plain.metrics["learner/equal_group_tokens"] == sum(tied_scored)  # measured either way

    # TRL's padded layout over all 12 trajectories; the tied rows at advantage 0
    scored = {s.index: s.n_scored for s in prepared.samples} | dict(zip(range(4, 8), tied_scored))
    B, T = len(batch), max(scored.values())
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(T)[None] < torch.tensor([scored[i] for i in range(B)])[:, None]).long()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.zeros(B, dtype=torch.float64)
    for s in prepared.samples:
        assert len(set(s.advantages.tolist())) == 1
        adv[s.index] = float(s.advantages[0])
    ref_loss = trl_loss(trl_type, logp, old, adv, mask, eps_low=0.2, eps_high=0.28,
                        max_completion_length=max_tokens)

    def our_loss(p):
        (plan,) = plan_step(p.samples, 1, 1, 0, p.extra_tokens, p.extra_episodes)
        (ids,) = plan.minibatches
        rows = torch.tensor(ids)
        seq_tokens = torch.tensor([scored[i] for i in ids])
        seq = torch.repeat_interleave(torch.arange(len(ids)), seq_tokens)
        tok = mask[rows].bool()
        n_tokens, n_episodes = plan.n_tokens[0], plan.n_episodes[0]
        c = aggregation_weights(loss_agg, seq, seq_tokens, n_episodes, n_tokens, max_tokens)
        loss, _ = objective(logp[rows][tok], old[rows][tok], adv[rows][seq], seq, seq_tokens, c, n_tokens,
                            clip_eps_low=0.2, clip_eps_high=0.28)
        return loss

    ours = our_loss(prepared)
    assert abs(float(ours) - float(ref_loss)) <= 1e-9 * max(1.0, abs(float(ref_loss)))
    g_ours, = torch.autograd.grad(ours, logp, retain_graph=True)
    g_trl, = torch.autograd.grad(ref_loss, logp, retain_graph=True)
    assert (g_ours - g_trl).abs().max().item() <= 1e-9 and g_trl.abs().max() > 0
    assert g_trl[4:8].abs().max() == 0  # TRL's tied rows carry no gradient: only the normaliser differs
    dapo = our_loss(plain)  # kept groups only: every weight larger by (kept + tied) / kept
    assert abs(float(dapo)) > abs(float(ours)) * 1.05
    # two minibatches: each gets the extra in proportion to its own tokens / episodes, summing to the step's
    plans = plan_step(prepared.samples, 2, 1, 0, prepared.extra_tokens, prepared.extra_episodes)[0]
    kept_tokens = sum(s.n_scored for s in prepared.samples)
    assert sum(plans.n_tokens) == pytest.approx(kept_tokens + sum(tied_scored), abs=1e-9)
    assert sum(plans.n_episodes) == pytest.approx(8 + 4, abs=1e-9)
    by_index = {s.index: s for s in prepared.samples}
    scale = 1 + sum(tied_scored) / kept_tokens
    for ids, n in zip(plans.minibatches, plans.n_tokens):
        assert n == pytest.approx(sum(by_index[i].n_scored for i in ids) * scale)


def test_equal_groups_in_normaliser_needs_a_grouped_estimator():
    from rl.config import load_config
    from rl.config.schema import ConfigError

    want = r"learner.equal_groups_in_normaliser .*gae has none to count: remove it, or use grpo/rloo"
    with pytest.raises(ConfigError, match=want):
        load_config("configs/tiny.yaml", ["learner.advantage=gae", "learner.group_size=1",
                                          "learner.equal_groups_in_normaliser=true"])
    cfg = load_config("configs/tiny.yaml", ["learner.equal_groups_in_normaliser=true"])
    assert cfg.learner.equal_groups_in_normaliser
