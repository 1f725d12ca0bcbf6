"""Shared prompt prefixes (rl/learner/prefix_sharing.py): a GRPO group's common prompt computed once.

Oracles, fp32:
- layout: every token and scored position of the shared micro-batch is the unshared one's token at the same
  in-sequence position (positions_from_cu_seqlens with prefix_of); exactly (G - 1) P tokens are spared;
- forward: log-probs and entropies of the scored tokens, shared vs unshared micro-batch through the same
  HF policy (Llama with GQA, Qwen3 with a tied head), and vs HF's own eager forward of each whole sequence
  (<= 1e-5); gradients of a weighted loss (<= 1e-5);
- a learner step with learner.share_prefixes on vs off: same loss and gradients (<= 1e-5), fewer tokens
  through the model;
- packing: a sharing group lands in one micro-batch, nothing is lost or repeated, bins respect the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.hf_policy import HFPolicy, positions_from_cu_seqlens
from rl.learner.batch import Sample
from rl.learner.forward import TrainModule
from rl.learner.packing import collate
from rl.learner.prefix_sharing import MIN_SHARED_TOKENS, common_prefix, pack_shared, share_prefixes
from tests.learner_fixtures import scored_traj
from tests.test_hf_policy import V, make_llama, make_qwen3, reference

TOL = 1e-5


def _sample(index: int, ids: np.ndarray, n_prompt: int, group: object, segment_starts=()) -> Sample:
    scored = np.arange(n_prompt - 1, len(ids) - 1, dtype=np.int64)  # the completion's tokens are scored
    return Sample(index=index, name=f"s{index}", group=group, input_ids=ids[:-1].astype(np.int64),
                  scored=scored, targets=ids[scored + 1].astype(np.int64),
                  rollout_logp=np.zeros(len(scored), np.float32), replay=None,
                  segment_starts=np.asarray(segment_starts, np.int64))


def _groups(seed: int = 0, prompt: int = 40, sizes=(4, 3), lone: int = 2,
            same_start: int = 3) -> list[Sample]:
    """Groups of completions of one prompt each (the first `same_start` completion tokens alike in group
    0: a shared region that holds scored positions), plus `lone` samples without a group."""
    rng = np.random.default_rng(seed)
    out = []
    for g, n in enumerate(sizes):
        p = rng.integers(10, V, prompt)
        head = rng.integers(10, V, same_start if g == 0 else 0)
        for _ in range(n):
            ids = np.concatenate([p, head, rng.integers(10, V, int(rng.integers(5, 30)))])
            out.append(_sample(len(out), ids, prompt, f"g{g}"))
    for _ in range(lone):
        ids = rng.integers(10, V, int(rng.integers(20, 60)))
        out.append(_sample(len(out), ids, 10, None))
    return out


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix([a, np.array([1, 2, 9]), np.array([1, 2, 3])]) == 2
    assert common_prefix([a, a.copy()]) == 4
    assert common_prefix([a, np.array([7])]) == 0
    assert common_prefix([a, np.zeros(0, np.int64)]) == 0 and common_prefix([]) == 0


def test_layout_keeps_every_token_at_its_position():
    samples = _groups()
    mb = collate(samples, ("rollout_logp",))
    sh = share_prefixes(mb, samples)
    # group 0 (4 members) shares prompt + 3 alike completion tokens, group 1 (3) its prompt
    assert mb.n_tokens - sh.n_tokens == 3 * 43 + 2 * 40
    old_pos = positions_from_cu_seqlens(mb.cu_seqlens)
    new_pos = positions_from_cu_seqlens(sh.cu_seqlens, sh.prefix_of)
    assert torch.equal(sh.input_ids[sh.scored_pos], mb.input_ids[mb.scored_pos])
    assert torch.equal(new_pos[sh.scored_pos], old_pos[mb.scored_pos])
    assert torch.equal(sh.targets, mb.targets) and torch.equal(sh.seq, mb.seq)
    assert sh.prefix_of.shape[0] == sh.cu_seqlens.shape[0] - 1
    assert int((sh.prefix_of >= 0).sum()) == 7  # one suffix per grouped member
    # scored positions in the shared region are the one copy: member 0..3's first scored inputs coincide
    first = [int(sh.scored_pos[sh.seq == i][0]) for i in range(4)]
    assert len(set(first)) == 1
    # a group member alone in a micro-batch, or a short common prefix, is not shared
    few = samples[:1] + samples[-2:]
    assert share_prefixes(collate(few, ()), few).prefix_of is None


def test_prefix_stops_at_a_context_restart_and_keeps_a_suffix_token():
    rng = np.random.default_rng(1)
    p = rng.integers(10, V, 30)
    a = np.concatenate([p, rng.integers(10, V, 10)])
    b = np.concatenate([p, rng.integers(10, V, 10)])
    # b restarts its context at input 24: only its first 24 inputs can be shared
    samples = [_sample(0, a, 30, "g"), _sample(1, b, 30, "g", segment_starts=[24])]
    sh = share_prefixes(collate(samples, ()), samples)
    assert sh.n_tokens == samples[0].n_tokens + samples[1].n_tokens - 23  # capped one short of 24
    c = p[:MIN_SHARED_TOKENS].copy()
    short = [_sample(0, np.r_[c, 5, 6], MIN_SHARED_TOKENS, "h"),
             _sample(1, np.r_[c, 7, 8], MIN_SHARED_TOKENS, "h")]
    assert share_prefixes(collate(short, ()), short).prefix_of is not None
    short = [_sample(0, c[:-1], 5, "h"), _sample(1, c[:-1].copy(), 5, "h")]  # 15 alike: too short
    assert share_prefixes(collate(short, ()), short).prefix_of is None


def test_pack_shared_keeps_a_group_together_within_the_budget():
    samples = _groups(seed=3, sizes=(4, 4, 3), lone=3)
    budget = 200
    bins = pack_shared(samples, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(samples)))
    for b in bins:
        part = [samples[i] for i in b]
        assert share_prefixes(collate(part, ()), part).n_tokens <= budget
    for g in ("g0", "g1", "g2"):
        where = {k for k, b in enumerate(bins) for i in b if samples[i].group == g}
        assert len(where) == 1, (g, bins)
    # a budget below a group's shared size: its members are packed one by one, still all of them
    bins = pack_shared(samples, 60)
    assert sorted(i for b in bins for i in b) == list(range(len(samples)))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_dir(request, tmp_path_factory) -> str:
    make = {"llama": make_llama, "qwen3": make_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def test_shared_forward_equals_unshared_and_hf(hf_dir):
    """Log-probs and entropies: shared == unshared micro-batch == HF eager per sequence (<= 1e-5); the
    gradients of a weighted loss: shared == unshared (<= 1e-5)."""
    samples = _groups(seed=2)
    mb = collate(samples, ())
    sh = share_prefixes(mb, samples)
    assert sh.prefix_of is not None
    outs, grads = [], []
    for batch in (mb, sh):
        module = TrainModule(HFPolicy.from_pretrained(hf_dir).train())
        out = module(batch)
        w = torch.linspace(-1, 1, out.logp.shape[0], dtype=torch.float32)
        ((out.logp * w).sum() + 0.1 * out.entropy.sum()).backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert (outs[0].logp - outs[1].logp).abs().max().item() <= TOL
    assert (outs[0].entropy - outs[1].entropy).abs().max().item() <= TOL
    for n in grads[0]:
        scale = max(1.0, grads[0][n].abs().max().item())
        assert (grads[0][n] - grads[1][n]).abs().max().item() <= TOL * scale, n
    ref = reference(hf_dir)
    with torch.no_grad():
        want = torch.cat([torch.log_softmax(ref(input_ids=torch.from_numpy(s.input_ids)[None]).logits[0], -1)
                          [torch.from_numpy(s.scored), torch.from_numpy(s.targets)] for s in samples])
    assert (outs[1].logp.detach() - want).abs().max().item() <= TOL


def test_learner_step_equal_with_and_without_sharing(tmp_path):
    """Learner on groups of one prompt, learner.share_prefixes on vs off: the same loss and gradients of
    the step's micro-batches (<= 1e-5), the same step metrics, and fewer tokens through the model. (Weights
    after AdamW are not compared: its first step is lr * sign(g) where g ~ 0, so float noise flips it.)"""
    from rl.config import load_config
    from rl.learner import Learner

    hf = make_llama(tmp_path / "llama")
    rng = np.random.default_rng(0)
    trajs = []
    for g in range(3):
        prompt = scored_traj(rng, [("prompt", 50)], 0.0, "x", routed=False).tokens
        for i in range(4):
            t = scored_traj(rng, [("prompt", 50), ("assistant", int(rng.integers(8, 30)))], float(i % 2),
                            f"g{g}", routed=False)
            t.tokens[:50] = prompt
            t.tokens %= V
            trajs.append(t)
    (tmp_path / "c.yaml").write_text("env: {id: arith}\n")
    results = []
    for share in (False, True):
        cfg = load_config(tmp_path / "c.yaml", [f"model.hf_path={hf}", "learner.group_size=4",
                                                "rollout.episodes=12", "learner.lr=1e-3",
                                                f"learner.share_prefixes={share}"])
        learner = Learner(cfg)
        assert learner.share is share
        samples = learner.prepare(trajs).samples
        loss = learner.accumulate(samples, sum(s.n_scored for s in samples), len(samples))
        grads = {n: p.grad.clone() for n, p in learner.policy.named_parameters()}
        m = learner.step(trajs)
        results.append((loss, grads, m))
    (loss_off, g_off, off), (loss_on, g_on, on) = results
    assert abs(loss_off - loss_on) <= TOL and abs(off["loss"] - on["loss"]) <= TOL
    for n in g_off:
        scale = max(1.0, g_off[n].abs().max().item())
        assert (g_off[n] - g_on[n]).abs().max().item() <= TOL * scale, n
    assert abs(off["grad_norm"] - on["grad_norm"]) <= TOL * max(1.0, off["grad_norm"])
    assert off["tokens"] == on["tokens"] and off["learner/shared_prefix_tokens"] == 0
    assert on["learner/shared_prefix_tokens"] == 3 * (4 - 1) * 50  # (G - 1) P per group, P = the prompt
