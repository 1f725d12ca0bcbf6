"""Sequence chunking (model/sequence_chunks.py, learner.sequence_chunk_tokens): the oracle is the unchunked
computation. Chunked forward + backward equals the unchunked one at 4K and 8K tokens, with the chunk size
dividing the length and not (rel <= 1e-5, fp32, every parameter's gradient included, routing replay on);
packing and chunking compose: a learner micro-batch of one long and many short trajectories, cut into
windows across sequence boundaries, gives the per-sequence (one micro-batch each, unchunked) loss and
gradients; the first pass (no gradients) and the value head take the same path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from model.sequence_chunks import chunked_forward, plan_windows
from model.short_conv import causal_short_conv_silu, naive_causal_short_conv
from rl.learner import Learner
from rl.learner.forward import head_logprobs
from rl.learner.packing import collate
from tests.learner_fixtures import N_EXPERTS, N_MOE, SMALL, TOP_K, scored_traj, small_config

REL = 1e-5


def test_plan_windows_hand_example():
    # sequences 5, 0, 3, 9 (packed: [0,5) [5,8) [8,17)) in windows of 4
    w = plan_windows([5, 0, 3, 9], 4)
    assert [(x.start, x.end, x.lens, x.carry_in, x.carry_out) for x in w] == [
        (0, 4, (4,), False, True),
        (4, 8, (1, 3), True, False),
        (8, 12, (4,), False, True),
        (12, 16, (4,), True, True),
        (16, 17, (1,), True, False),
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(1, 40))
def test_plan_windows_properties(lens, C):
    windows = plan_windows(lens, C)
    L = sum(lens)
    assert [(w.start, w.end) for w in windows] == [(s, min(L, s + C)) for s in range(0, L, C)]
    assert all(sum(w.lens) == w.end - w.start and min(w.lens) > 0 for w in windows)
    # the pieces, glued back across carried boundaries, are the non-empty sequences
    glued = []
    for w in windows:
        ps = list(w.lens)
        if w.carry_in:
            glued[-1] += ps.pop(0)
        glued += ps
    assert glued == [n for n in lens if n]
    assert all(a.carry_out == b.carry_in for a, b in zip(windows, windows[1:]))
    assert not windows or not windows[-1].carry_out


def test_short_conv_with_a_differentiable_state_matches_naive():
    """The carried conv tail needs a gradient between windows: `causal_short_conv_silu` prepends it as input
    rows (lengths 0, 1, 2 < W-1 and longer). Outputs, new state and the gradients of x, weight and the
    state equal the per-sequence, per-tap loop."""
    torch.manual_seed(0)
    lens, C, W = [5, 0, 1, 2, 9], 6, 4
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    x0, w0, s0 = torch.randn(sum(lens), C), torch.randn(C, W), torch.randn(len(lens), C, W - 1)
    dy, ds = torch.randn(sum(lens), C), torch.randn(len(lens), C, W - 1)
    results = []
    for fn in ("fast", "naive"):
        x, w, s = (t.clone().requires_grad_() for t in (x0, w0, s0))
        if fn == "fast":
            y, new = causal_short_conv_silu(x, w, cu, s)
        else:
            y, new = naive_causal_short_conv(x, w, cu, s)
            y = torch.nn.functional.silu(y)
        ((y * dy).sum() + (new * ds).sum()).backward()
        results.append([y.detach(), new.detach(), x.grad, w.grad, s.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert results[0][4].abs().sum() > 0


# ------------------------------------------------------------------------------------ model-level oracle
def _model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", **SMALL)).float().train()


def _inputs(lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lens)
    ids = torch.randint(0, 4096, (L,), generator=g)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    targets = torch.randint(0, 4096, (L,), generator=g)
    replay = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:TOP_K] for _ in range(L * N_MOE)])
    weights = torch.randn(L, generator=g, dtype=torch.float64)
    return ids, cu, targets, replay.view(L, N_MOE, TOP_K), weights


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _unchunked(model, ids, cu, targets, replay, weights):
    model.zero_grad(set_to_none=True)
    h, _, _, _ = model.model(ids, cu, None, replay, False)
    lp, ent = head_logprobs(h, targets, model.lm_head.weight)
    ((lp.double() * weights).sum() + ent.double().sum() * 1e-2).backward()
    return lp.detach(), ent.detach(), _grads(model)


def _chunked(model, ids, cu, targets, replay, weights, C, checkpoint_layers=False):
    model.zero_grad(set_to_none=True)

    def head(h, w):
        return head_logprobs(h, targets[w.start:w.end], model.lm_head.weight)

    outs, _, windows = chunked_forward(model.model, ids, cu, replay, C, head, checkpoint_layers)
    lp, ent = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    ((lp.double() * weights).sum() + ent.double().sum() * 1e-2).backward()
    return lp.detach(), ent.detach(), _grads(model), windows


def _assert_close(ref, got):
    lp, ent, g = ref
    lp2, ent2, g2 = got[:3]
    assert float((lp2 - lp).norm() / lp.norm()) <= REL
    assert float((ent2 - ent).norm() / ent.norm()) <= REL
    assert set(g2) == set(g) and len(g) > 20
    for name in g:  # every parameter: embedding, KDA, MLA, AttnRes, MoE, head
        scale = float(g[name].norm())  # 0 for a few (the first layer's AttnRes queries: one source)
        assert float((g2[name] - g[name]).norm()) <= REL * scale, name
    assert sum(float(t.norm()) > 0 for t in g.values()) > 20


@pytest.mark.parametrize("T,C", [(4096, 1024), (4096, 1000), (8192, 2048), (8192, 3000)])
def test_chunked_forward_backward_equals_unchunked(T, C):
    """One sequence of T tokens, windows of C (dividing T or not; the last window short): R3 on."""
    model = _model()
    args = _inputs([T], seed=T + C)
    ref = _unchunked(model, *args)
    got = _chunked(model, *args, C)
    assert len(got[3]) == -(-T // C) > 1
    _assert_close(ref, got)


def test_chunked_packed_windows_with_layer_checkpoints():
    """Packed sequences cut across their boundaries (a window holds the tail of one, whole ones, the head of
    the next; one sequence spans several windows; one has a single token), per-layer checkpoints on."""
    model = _model()
    args = _inputs([700, 1, 45, 300, 2, 513], seed=1)
    ref = _unchunked(model, *args)
    got = _chunked(model, *args, 128, checkpoint_layers=True)
    assert any(len(w.lens) > 1 and w.carry_in for w in got[3])
    _assert_close(ref, got)


def test_chunked_forward_without_gradients_equals_unchunked():
    """The first pass (no_grad): the fused prefill kernels take the carried state as well."""
    model = _model()
    ids, cu, targets, replay, _ = _inputs([600, 90], seed=2)
    with torch.no_grad():
        h, _, routed, _ = model.model(ids, cu, None, replay, True)
        lp, _ = head_logprobs(h, targets, model.lm_head.weight)
        outs, routed_c, _ = chunked_forward(
            model.model, ids, cu, replay, 200,
            lambda h, w: head_logprobs(h, targets[w.start:w.end], model.lm_head.weight))
    lp_c = torch.cat([o[0] for o in outs])
    assert float((lp_c - lp).norm() / lp.norm()) <= REL
    assert torch.equal(routed_c, routed)


# --------------------------------------------------------------------------- learner: packing x chunking
def _long_and_short_batch(long_tokens: int) -> list:
    """Two groups of 4: the first holds one long two-turn trajectory; the rest are short."""
    rng = np.random.default_rng(7)
    out = []
    for g in range(2):
        for i in range(4):
            if g == 0 and i == 0:
                n = long_tokens // 2
                layout = [("prompt", 40), ("assistant", n - 40), ("observation", 30),
                          ("assistant", long_tokens - n - 30)]
            else:
                p = int(rng.integers(2, 30))
                layout = [("prompt", p), ("assistant", int(rng.integers(2, 60)))]
            out.append(scored_traj(rng, layout, float((i + g) % 3), f"g{g}"))
    return out


def _accumulate(cfg, trajs):
    torch.manual_seed(0)
    learner = Learner(cfg)
    samples = learner.prepare(trajs).samples
    for s in samples:  # pi_old != pi: ratios move and the clip is live
        s.old_logp = s.rollout_logp.astype(np.float64)
    n_tokens, n_episodes = sum(s.n_scored for s in samples), len(samples)
    loss = learner.accumulate(samples, n_tokens, n_episodes, fused_old=False)
    grads = torch.cat([p.grad.reshape(-1) for p in learner.module.parameters() if p.grad is not None])
    return loss, grads, learner, samples


@pytest.mark.parametrize("micro_batch_tokens", [100_000, 1024], ids=["all-in-one", "long-alone"])
def test_packing_and_chunking_compose(micro_batch_tokens):
    """Reference: every trajectory its own micro-batch, unchunked. Chunked: one micro-batch for all (windows
    cut across sequence boundaries), or the long one alone and the short ones packed."""
    trajs = _long_and_short_batch(2500)
    ref_loss, ref_g, _, _ = _accumulate(small_config(micro_batch_tokens=1, tis_cap=None), trajs)
    cfg = small_config(micro_batch_tokens=micro_batch_tokens, sequence_chunk_tokens=384, tis_cap=None)
    loss, g, learner, samples = _accumulate(cfg, trajs)
    assert learner.module.chunks(collate(samples)) > 6
    scale = max(abs(ref_loss), float(np.mean([np.abs(s.advantages).mean() for s in samples])))
    assert abs(loss - ref_loss) <= REL * scale, (loss, ref_loss)
    assert float((g - ref_g).norm() / ref_g.norm()) <= REL
    assert ref_g.norm() > 0


def test_learner_step_chunked_equals_unchunked_with_value_head_and_first_pass():
    """gae with a value head: the first pass (old log-probs, old values) and the update both chunked."""
    trajs = _long_and_short_batch(1200)
    base = dict(advantage="gae", group_size=4, micro_batch_tokens=100_000, tis_cap=None)
    metrics = []
    for C in (0, 256):
        torch.manual_seed(0)
        learner = Learner(small_config(sequence_chunk_tokens=C, **base))
        metrics.append(learner.step(trajs))
    ref, got = metrics
    assert got["learner/sequence_chunks"] > ref["learner/sequence_chunks"] == 1
    for k in ("loss", "learner/value_loss", "learner/entropy", "learner/policy_loss"):
        assert abs(got[k] - ref[k]) <= REL * max(1.0, abs(ref[k])), k
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= REL * ref["grad_norm"]


def test_chunking_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="critic"):
        Learner(small_config(sequence_chunk_tokens=64, advantage="gae", value_model="critic"))
    cfg = small_config(sequence_chunk_tokens=64)
    cfg.model.overrides["balancing"] = "aux_loss"
    with pytest.raises(ValueError, match="auxiliary balancing loss"):
        Learner(cfg)


# ------------------------------------------------------------------ KDA state composition (toward CP)
def test_kda_shard_composition_equals_whole_sequence():
    """Context parallelism's KDA step: shards summarised independently (M, S_local) and composed by the scan
    S_out = M S_in + S_local give the whole sequence's state at every shard boundary; each shard re-run from
    its composed S_in gives the whole sequence's outputs (uneven shards, 2 rows, fp32, rel <= 1e-5)."""
    from model.kda import kda_gate, kda_sequence
    from model.kda_compose import compose, shard_summary
    from model.kda_reference import naive_recurrent_kda

    g_ = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 96, 2, 16, 8
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    g = kda_gate(torch.randn(B, T, H, K, generator=g_) - 4, torch.zeros(H))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g_))
    S0 = torch.randn(B, H, K, V, generator=g_)
    o, S_T = naive_recurrent_kda(q, k, v, g, beta, S0)
    cuts = [0, 37, 38, 70, T]  # one shard of a single token
    shards = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    for recurrence in (naive_recurrent_kda, kda_sequence):
        summaries = [shard_summary(k[:, s], v[:, s], g[:, s], beta[:, s], recurrence) for s in shards]
        starts, S_end = compose(summaries, S0)
        assert float((S_end - S_T).norm() / S_T.norm()) <= REL
        outs = []
        for s, S_in in zip(shards, starts):
            o_r, _ = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], S_in)
            outs.append(o_r)
        assert float((torch.cat(outs, 1) - o).norm() / o.norm()) <= REL
    # the composed start of a shard is not the zero state: the test would see a wrong scan
    assert float(starts[2].norm()) > 0.1
