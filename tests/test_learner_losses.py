"""Oracle: our GRPO-family objective against TRL 1.16's own `GRPOTrainer._compute_loss`, in float64.

TRL's loss is a method that recomputes log-probs and reads trainer attributes. The harness builds the trainer
object without its constructor, sets exactly the attributes `_compute_loss` reads, and stubs its per-token
log-prob helper to return our log-probs, so the same per-token log-probs, old log-probs, advantages and masks
go through both implementations. Loss and gradient w.r.t. the log-probs must agree within 1e-9.

Knob mapping (ours -> TRL), also in docs/learner.md:
  ppo_clip + token_mean            -> loss_type "bnpo" and "dapo" (one micro-batch, one process)
  ppo_clip + seq_mean_token_mean   -> loss_type "grpo"
  ppo_clip + seq_mean_token_sum    -> loss_type "dr_grpo", max_completion_length = C (rollout.max_tokens)
  gspo                             -> importance_sampling_level "sequence" (with grpo / dapo)
  cispo + token_mean               -> loss_type "cispo", epsilon_high = 1 + clip_eps_high
  clip_eps_low / clip_eps_high     -> epsilon_low / epsilon_high
  kl_coef, kl_estimator k3         -> beta (TRL's KL is k3 only)
  entropy_coef                     -> entropy_coef
  off-policy weights (TIS / MIS)   -> inputs["importance_sampling_ratio"] with use_vllm
Multi-turn: a completion holding observation tokens is TRL's tool_mask (mask = completion_mask * tool_mask).
k1 / k2 (not in TRL) are checked against a slow per-token reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.learner.losses import aggregation_weights, kl_penalty, objective, policy_loss, value_loss
from rl.learner.off_policy import correction_weights
from tests.trl_oracle import trl_loss

TOL = 1e-9


def make_batch(seed=0, B=5, T=9, multi_turn=False):
    """Padded [B, T] tensors (TRL's layout): ragged masks (>= 1 token each), log-probs near the old ones so
    that some ratios fall outside the clip range on both sides."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 1
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    tool_mask = None
    if multi_turn:  # observation tokens inside the completion (not generated): TRL's tool_mask
        tool_mask = (torch.rand(B, T, generator=g) > 0.3).long()
        tool_mask[:, 0] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    return logp, old, ref, adv, completion_mask, tool_mask, entropy


def flatten(mask, *tensors):
    """Ours: the scored tokens of every row, in row order, with their episode index."""
    m = mask.bool()
    seq = torch.arange(mask.shape[0])[:, None].expand_as(mask)[m]
    seq_tokens = mask.sum(-1)
    return seq, seq_tokens, [None if t is None else (t[m] if t.dim() == 2 else t[seq]) for t in tensors]


def ours(loss_agg, policy, logp, old, adv, mask, *, eps_low, eps_high, max_tokens=64, is_ratio=None, ref=None,
         kl_coef=0.0, kl_estimator="k3", entropy=None, entropy_coef=0.0):
    seq, seq_tokens, (lp, od, a, isw, rf, ent) = flatten(mask, logp, old, adv, is_ratio, ref, entropy)
    n_tokens = int(mask.sum())
    c = aggregation_weights(loss_agg, seq, seq_tokens, mask.shape[0], n_tokens, max_tokens)
    loss, _ = objective(lp, od, a, seq, seq_tokens, c, n_tokens, policy=policy, clip_eps_low=eps_low,
                        clip_eps_high=eps_high, is_weights=isw, ref_logp=rf, kl_coef=kl_coef,
                        kl_estimator=kl_estimator, entropy=ent, entropy_coef=entropy_coef)
    return loss


def assert_match(a, b, wrt):
    ga, = torch.autograd.grad(a, wrt, retain_graph=True)
    gb, = torch.autograd.grad(b, wrt, retain_graph=True)
    a, b = float(a.detach()), float(b.detach())
    assert abs(a - b) <= TOL * max(1.0, abs(b)), (a, b)
    assert (ga - gb).abs().max().item() <= TOL, (ga - gb).abs().max().item()
    assert gb.abs().max() > 0  # the comparison exercised a real gradient


CASES = [  # (ours: loss_agg, policy_loss) -> TRL loss_type, importance_sampling_level
    ("token_mean", "ppo_clip", "bnpo", "token"),
    ("token_mean", "ppo_clip", "dapo", "token"),
    ("seq_mean_token_mean", "ppo_clip", "grpo", "token"),
    ("seq_mean_token_sum", "ppo_clip", "dr_grpo", "token"),
    ("seq_mean_token_mean", "gspo", "grpo", "sequence"),
    ("token_mean", "gspo", "dapo", "sequence"),
]


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("loss_agg,policy,trl_type,level", CASES)
def test_ppo_family_matches_trl(loss_agg, policy, trl_type, level, multi_turn):
    logp, old, _, adv, cmask, tmask, _ = make_batch(seed=1, multi_turn=multi_turn)
    mask = cmask if tmask is None else cmask * tmask
    eps_low, eps_high = (0.2, 0.28) if policy == "ppo_clip" else (3e-3, 4e-3)
    ref_loss = trl_loss(trl_type, logp, old, adv, cmask, eps_low=eps_low, eps_high=eps_high, level=level,
                        max_completion_length=64, tool_mask=tmask)
    our = ours(loss_agg, policy, logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, max_tokens=64)
    assert_match(our, ref_loss, logp)


def test_clipping_happens_on_both_sides_in_the_oracle_batch():
    """The batch above is not trivially inside the trust region: both clip branches are exercised."""
    logp, old, _, adv, mask, _, _ = make_batch(seed=1)
    seq, seq_tokens, (lp, od, a) = flatten(mask, logp, old, adv)
    _, clipped = policy_loss("ppo_clip", lp, od, a, seq, seq_tokens, 0.2, 0.28)
    r = (lp - od).exp()
    assert bool((clipped & (a > 0) & (r > 1.28)).any()) and bool((clipped & (a < 0) & (r < 0.8)).any())


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_cispo_matches_trl(multi_turn):
    """TRL's CISPO caps the IS weight at the absolute epsilon_high; ours at 1 + clip_eps_high."""
    logp, old, _, adv, cmask, tmask, _ = make_batch(seed=2, multi_turn=multi_turn)
    mask = cmask if tmask is None else cmask * tmask
    ref_loss = trl_loss("cispo", logp, old, adv, cmask, eps_low=0.2, eps_high=1.0 + 0.28, tool_mask=tmask)
    our = ours("token_mean", "cispo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert_match(our, ref_loss, logp)


@pytest.mark.parametrize("loss_agg,trl_type", [("seq_mean_token_mean", "grpo"), ("token_mean", "dapo"),
                                               ("seq_mean_token_sum", "dr_grpo")])
def test_kl_k3_entropy_and_is_weights_match_trl(loss_agg, trl_type):
    """beta * k3 KL, the entropy bonus and per-token IS weights (TIS, then MIS masks) as TRL applies them."""
    logp, old, ref, adv, mask, _, entropy = make_batch(seed=3)
    rollout = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=old.dtype) * 0.4
    seq, _, (od, ro) = flatten(mask, old, rollout)
    w, _ = correction_weights(od, ro, seq, mask.shape[0], tis_cap=1.2, mis_band=[0.6, 1.6])
    assert 0 < int((w == 0).sum()) < w.numel() and bool((w == 1.2).any())  # both corrections are active
    is_ratio = torch.zeros_like(old)
    is_ratio[mask.bool()] = w
    ref_loss = trl_loss(trl_type, logp, old, adv, mask, eps_low=0.2, eps_high=0.28, beta=0.05, ref=ref,
                        entropy=entropy, entropy_coef=0.01, is_ratio=is_ratio)
    our = ours(loss_agg, "ppo_clip", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, is_ratio=is_ratio,
               ref=ref, kl_coef=0.05, kl_estimator="k3", entropy=entropy, entropy_coef=0.01)
    assert_match(our, ref_loss, logp)


def test_k1_k2_against_slow_reference():
    """k1 = log pi - log pi_ref, k2 = (log pi - log pi_ref)^2 / 2, token by token in Python floats."""
    g = torch.Generator().manual_seed(4)
    lp = (-torch.rand(20, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = lp.detach() + torch.randn(20, generator=g, dtype=torch.float64) * 0.5
    for est, fn in (("k1", lambda a, b: a - b), ("k2", lambda a, b: 0.5 * (a - b) ** 2)):
        got = kl_penalty(lp, ref, est)
        want = [fn(float(a), float(b)) for a, b in zip(lp, ref)]
        assert max(abs(x - y) for x, y in zip(got.tolist(), want)) <= TOL
    # k3 is the unbiased estimator of KL(pi || ref) on samples of pi and is never negative
    assert bool((kl_penalty(lp, ref, "k3") >= 0).all())


def test_value_loss_against_slow_reference():
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(30, generator=g, dtype=torch.float64) for _ in range(3))
    got = value_loss(v, old, ret, 0.2)
    for x, o, r, y in zip(v.tolist(), old.tolist(), ret.tolist(), got.tolist()):
        clipped = o + min(max(x - o, -0.2), 0.2)
        assert abs(y - 0.5 * max((x - r) ** 2, (clipped - r) ** 2)) <= TOL


def test_off_policy_weights_against_slow_reference():
    """TIS caps rho = exp(old - rollout); MIS token masks rho outside the band; MIS sequence masks whole
    episodes by their summed log-ratio (TRL's sequence_mask)."""
    g = torch.Generator().manual_seed(6)
    old = -torch.rand(40, generator=g, dtype=torch.float64) * 2
    roll = old + torch.randn(40, generator=g, dtype=torch.float64) * 0.3
    seq = torch.arange(8).repeat_interleave(5)
    w, sums = correction_weights(old, roll, seq, 8, tis_cap=1.2, mis_band=None)
    rho = [math.exp(a - b) for a, b in zip(old.tolist(), roll.tolist())]
    assert max(abs(x - min(r, 1.2)) for x, r in zip(w.tolist(), rho)) <= 1e-12
    assert abs(float(sums["kl_sum"]) - sum(r - 1 - math.log(r) for r in rho)) <= 1e-9
    w, _ = correction_weights(old, roll, seq, 8, tis_cap=None, mis_band=[0.8, 1.25])
    assert w.tolist() == [1.0 if 0.8 <= r <= 1.25 else 0.0 for r in rho]
    w, _ = correction_weights(old, roll, seq, 8, tis_cap=None, mis_band=[0.8, 1.25], mis_level="sequence")
    for e in range(8):
        r_seq = math.exp(sum(float(old[t] - roll[t]) for t in range(5 * e, 5 * e + 5)))
        want = 1.0 if 0.8 <= r_seq <= 1.25 else 0.0
        assert w[5 * e: 5 * e + 5].tolist() == [want] * 5
