"""`Learner` end to end on a small policy: bad input named, MoE statistics recorded once per token, activation
checkpointing and bf16 against the plain fp32 update, save/load, the lr schedule, PPO with a value model,
routing agreement, and every step's bookkeeping."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from model.balancing import QuantileStats
from rl.learner import Learner
from tests.learner_fixtures import N_MOE, fingerprint, ragged_batch, scored_traj, small_config


@pytest.fixture(scope="module")
def batch():
    return ragged_batch(seed=0)


def _params(learner):
    return torch.cat([p.detach().reshape(-1).clone() for p in learner.module.parameters()])


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_gets_an_error_naming_the_trajectory(batch):
    learner = Learner(small_config())
    with pytest.raises(ValueError, match="empty batch"):
        learner.step([])
    trajs = copy.deepcopy(batch)
    trajs[2].rollout_logprobs[trajs[2].loss_mask == 1] = np.nan
    with pytest.raises(ValueError, match=r"trajectory 2 \(group_id='g0'\): .* no rollout log-prob"):
        learner.step(trajs)
    trajs = copy.deepcopy(batch)
    trajs[5].routed_experts = trajs[5].routed_experts[:, :2]
    with pytest.raises(ValueError, match=r"trajectory 5 .*routed_experts has shape .* expected \[T, n_moe"):
        learner.step(trajs)
    trajs = copy.deepcopy(batch)
    trajs[1].routed_experts = None
    with pytest.raises(ValueError, match=r"trajectory 1 .*no routed_experts but learner.routing_replay"):
        learner.step(trajs)
    trajs = copy.deepcopy(batch)
    trajs[6].metadata["tokenizer"] = "0123456789abcdef"
    with pytest.raises(ValueError, match=r"trajectory 6 .*tokenizer mismatch.*'0123456789abcdef'"):
        learner.step(trajs)
    trajs = copy.deepcopy(batch)
    trajs[3].metadata["tokenizer"] = "0123456789abcdef"
    trajs[3].infra_error = "sandbox died"  # excluded from training, but a wrong tokenizer is never silent
    with pytest.raises(ValueError, match=r"trajectory 3 .*tokenizer mismatch"):
        learner.step(trajs)
    before = _params(learner)
    assert torch.equal(before, _params(learner))  # nothing was applied by the refused steps
    assert learner.optimizer_steps == 0


def test_num_ranks_above_one_needs_a_learner_group():
    with pytest.raises(ValueError, match=r"learner.num_ranks is 2 but this process runs 1 rank\(s\): use "
                                         r"rl.learner.group.LearnerGroup"):
        Learner(small_config(num_ranks=2))


def test_rollout_records_the_tokenizer_fingerprint():
    """The agent loop writes metadata['tokenizer'] (what the check above compares)."""
    import asyncio

    import envs
    from model.tokenizer import load_tokenizer
    from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
    from tests.calc_oracle_engine import CalcOracleEngine

    codec = ChatCodec(load_tokenizer())
    env = envs.make("arith", difficulty=0, tools_in_prompt=False, use_sandbox=False)
    traj = asyncio.run(run_episode(CalcOracleEngine(), env, codec, EpisodeConfig(max_new_tokens=64), seed=1))
    assert traj.metadata["tokenizer"] == fingerprint() and len(fingerprint()) == 16


# ----------------------------------------------------------------------------------------- MoE statistics
def test_exactly_one_forward_per_micro_batch_feeds_the_balancer(batch, monkeypatch):
    """With a first pass (ppo_epochs 2), a reference model (kl_coef) and activation checkpointing (the
    backward recomputes every layer), the balancer and the load tracker still see each token once per
    optimizer step: only the forward with gradients records."""
    cfg = small_config(ppo_epochs=2, kl_coef=0.1, activation_checkpointing=True, micro_batch_tokens=100)
    learner = Learner(cfg)
    rows = []
    orig = QuantileStats.add
    monkeypatch.setattr(QuantileStats, "add", lambda self, s, b: (rows.append(s.shape[0]), orig(self, s, b)))
    biases = [moe.bias.clone() for moe in learner.policy.moe_layers()]
    m = learner.step(batch)
    tokens = int(m["tokens"])
    n_micro = m["learner/micro_batches"]
    assert m["learner/optimizer_steps"] == 2
    assert sum(rows) == 2 * tokens * N_MOE  # two optimizer steps, each token once per MoE layer
    assert len(rows) == 2 * n_micro * N_MOE
    for moe, b in zip(learner.policy.moe_layers(), biases):
        assert moe.load_tracker.steps == 2 and moe.load_metrics()["tokens"] == tokens
        assert not torch.equal(moe.bias, b)  # the balancer did update once per optimizer step


# ----------------------------------------------------------------------------------------- numerics
def test_activation_checkpointing_gives_the_same_update(batch):
    a = Learner(small_config(micro_batch_tokens=120))
    b = Learner(small_config(micro_batch_tokens=120, activation_checkpointing=True))
    ma, mb = a.step(batch), b.step(batch)
    assert _rel(_params(b), _params(a)) <= 1e-6
    assert abs(ma["loss"] - mb["loss"]) <= 1e-6 * max(1.0, abs(ma["loss"]))


BF16_REL = 5e-2  # bf16 has an 8-bit mantissa: relative rounding ~4e-3 per op, accumulated over layers


def test_bf16_autocast_gradients_match_fp32_within_tolerance(batch):
    """model.dtype bfloat16: fp32 master weights, bf16 autocast compute. Same loss and gradients as fp32 up to
    BF16_REL (relative L2), and the master weights stay fp32."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = small_config(micro_batch_tokens=10_000)
        cfg.model.dtype = dtype
        learner = Learner(cfg)
        samples = learner.prepare(batch).samples
        for s in samples:
            s.old_logp = s.rollout_logp.astype(np.float64)
        n_tok = sum(s.n_scored for s in samples)
        loss = learner.accumulate(samples, n_tok, len(samples), fused_old=False)
        grads = torch.cat([p.grad.reshape(-1) for p in learner.policy.parameters() if p.grad is not None])
        out[dtype] = (loss, grads)
        assert all(p.dtype == torch.float32 for p in learner.policy.parameters())
        assert learner.state_dict()["lm_head.weight"].dtype == getattr(torch, dtype)
    (l32, g32), (l16, g16) = out["float32"], out["bfloat16"]
    assert abs(l16 - l32) <= BF16_REL * abs(l32), (l16, l32)
    assert _rel(g16, g32) <= BF16_REL, _rel(g16, g32)


# ----------------------------------------------------------------------------------------- bookkeeping
def test_step_metrics_schedule_and_minibatches(batch):
    cfg = small_config(lr=1e-3, warmup_steps=2, lr_schedule="cosine", steps=2, num_minibatches=2)
    learner = Learner(cfg)
    lrs = []
    for _ in range(2):
        m = learner.step(batch)
        assert m["learner/optimizer_steps"] == 2 and m["learner/trained_trajectories"] == 8
        assert {"loss", "grad_norm", "tokens"} <= set(m) and m["grad_norm"] > 0
        assert m["tokens"] == sum(t.n_tokens - 1 for t in batch)
        lrs.append(m["learner/lr"])
    # 4 optimizer steps: warm-up over 2 (lr/2, lr), then cosine over the other 2 (lr/2, 0)
    assert lrs == pytest.approx([1e-3, 0.0], abs=1e-12)
    assert learner.optimizer_steps == 4 and learner.policy_steps == 2


def test_all_groups_dropped_means_no_update(batch):
    trajs = copy.deepcopy(batch)
    for t in trajs:
        t.rewards = {"total": 1.0}
    learner = Learner(small_config())
    before = _params(learner)
    m = learner.step(trajs)
    assert m["learner/equal_groups"] == 2 and m["learner/optimizer_steps"] == 0 and m["loss"] == 0.0
    assert torch.equal(before, _params(learner))


def test_equal_groups_in_normaliser_scales_the_step_by_the_kept_token_share(batch):
    """learner.equal_groups_in_normaliser through Learner.step: group g1 made all-equal is dropped either
    way; with the option its scored tokens join the token mean's N, so loss and gradient are those of the
    plain step times kept / (kept + tied) tokens (every weight 1/N; the forward is the same)."""
    trajs = copy.deepcopy(batch)
    for t in trajs[4:]:
        t.rewards = {"total": 1.0}
    tied = sum(int(np.count_nonzero(t.loss_mask[1:])) for t in trajs[4:])
    kept = sum(int(np.count_nonzero(t.loss_mask[1:])) for t in trajs[:4])
    plain = Learner(small_config(grad_clip=1e9)).step(trajs)
    counted = Learner(small_config(grad_clip=1e9, equal_groups_in_normaliser=True)).step(trajs)
    assert plain["learner/equal_groups"] == counted["learner/equal_groups"] == 1
    assert plain["learner/equal_group_tokens"] == counted["learner/equal_group_tokens"] == tied
    share = kept / (kept + tied)
    assert counted["grad_norm"] == pytest.approx(plain["grad_norm"] * share, rel=1e-5)
    assert counted["loss"] == pytest.approx(plain["loss"] * share, rel=1e-5, abs=1e-9)


def test_save_and_load_resume_exactly(batch, tmp_path):
    cfg = small_config(lr=1e-3, kl_coef=0.05)
    a = Learner(cfg)
    a.step(batch)
    a.save(tmp_path / "ckpt")
    b = Learner(cfg)
    b.load(tmp_path / "ckpt")
    assert torch.equal(_params(a), _params(b))
    for ma, mb in zip(a.policy.moe_layers(), b.policy.moe_layers()):
        assert torch.equal(ma.bias, mb.bias)  # the balancer's state
    ma, mb = a.step(batch), b.step(batch)
    assert torch.equal(_params(a), _params(b))
    assert ma["loss"] == mb["loss"] and ma["learner/lr"] == mb["learner/lr"]
    moe_a, moe_b = ({k: v for k, v in m.items() if k.startswith("moe/")} for m in (ma, mb))
    assert moe_a == moe_b
    for la, lb in zip(a.policy.moe_layers(), b.policy.moe_layers()):  # the dead-expert window survives too
        ha, hb = la.load_tracker.state_dict()["history"], lb.load_tracker.state_dict()["history"]
        assert len(ha) == len(hb) == 2 and all(torch.equal(x, y) for x, y in zip(ha, hb))
    assert b.policy_steps == 2 and b.optimizer_steps == 2
    with pytest.raises(FileNotFoundError, match="holds no learner checkpoint"):
        b.load(tmp_path)


def test_off_policy_correction_is_applied_and_reported(batch):
    """Rollout log-probs 0.3 nats (std) away from the learner's: TIS truncates, MIS masks, and both change
    the update; with matching rollout log-probs neither does anything."""
    plain = Learner(small_config(tis_cap=None)).step(batch)
    assert plain["learner/offpolicy_truncated_frac"] == 0 and plain["learner/offpolicy_masked_frac"] == 0
    assert plain["learner/offpolicy_kl"] > 0.01  # the fixture's rollout log-probs are noisy
    tis = Learner(small_config(tis_cap=1.1)).step(batch)
    mis = Learner(small_config(tis_cap=None, mis_band=[0.9, 1.1])).step(batch)
    seq = Learner(small_config(tis_cap=None, mis_band=[0.5, 2.0], mis_level="sequence")).step(batch)
    assert 0 < tis["learner/offpolicy_truncated_frac"] < 1 and tis["learner/offpolicy_masked_frac"] == 0
    assert 0 < mis["learner/offpolicy_masked_frac"] < 1
    assert 0 < seq["learner/offpolicy_masked_frac"] < 1  # whole episodes are masked together
    assert len({plain["loss"], tis["loss"], mis["loss"], seq["loss"]}) == 4
    assert plain["learner/offpolicy_ratio_max"] == tis["learner/offpolicy_ratio_max"] > 1.1


def test_kl_to_reference_starts_at_zero_and_grows(batch):
    learner = Learner(small_config(lr=3e-3, kl_coef=0.1, ppo_epochs=2))
    first = learner.step(batch)
    assert first["learner/kl"] == pytest.approx(0.0, abs=1e-9)
    learner.step(batch)
    assert learner.step(batch)["learner/kl"] > 1e-6


def test_routing_agreement_is_reported_without_replay():
    """R3 off: agreement 1.0 when the recorded experts are the learner's own free choice, lower for random
    ones; per MoE layer (keys name the model layer)."""
    learner = Learner(small_config(routing_replay=False))
    trajs = ragged_batch(seed=8)
    m = learner.step(trajs)
    assert 0.0 <= m["learner/routing_agreement"] < 0.5
    assert {f"learner/routing_agreement/layer{l}" for l in (1, 2, 3)} <= set(m)
    learner = Learner(small_config(routing_replay=False))
    for t in trajs:
        with torch.no_grad():
            ids = torch.from_numpy(t.tokens.astype(np.int64))
            t.routed_experts = learner.policy(ids, return_routed_experts=True).routed_experts.numpy().astype(
                np.uint16)
    assert learner.step(trajs)["learner/routing_agreement"] == 1.0


@pytest.mark.parametrize("value_model", ["head", "critic"])
def test_ppo_value_loss_falls_on_a_fixed_batch(value_model):
    """advantage=gae: the value model learns the returns of a fixed batch (value loss falls), and the
    policy gets GAE advantages from it."""
    rng = np.random.default_rng(3)
    trajs = [scored_traj(rng, [("prompt", 6), ("assistant", 10), ("observation", 4), ("assistant", 8)],
                         float(i % 2), None) for i in range(6)]
    cfg = small_config(advantage="gae", group_size=1, value_model=value_model, lr=3e-3, gamma=0.99,
                       gae_lambda=0.95, value_coef=1.0, ppo_epochs=2)
    learner = Learner(cfg)
    losses = [learner.step(trajs)["learner/value_loss"] for _ in range(4)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(math.isfinite(v) for v in losses)
