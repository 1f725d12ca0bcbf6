"""Gated MLA (model/mla.py): a from-scratch fp64 reference, absorbed == naive, cache == one pass, chunking."""

from __future__ import annotations

import pytest
import torch

from model import mla
from model.config import OdysseyConfig
from model.mla import GatedMLA, MLALatentCache, causal_attention


def make_mla(q_lora_rank: int = 0, seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    cfg = OdysseyConfig.from_preset("tiny", mla_q_lora_rank=q_lora_rank)
    m = GatedMLA(cfg, layer_idx=3)
    with torch.no_grad():  # larger-than-init weights so attention is far from uniform
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    return m


def reference_mla(m: GatedMLA, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Slow, obvious fp64 MLA: explicit latent, per-head K/V, masked softmax per sequence, gate, W_o."""
    x = x.double()
    W = {n: p.detach().double() for n, p in m.named_parameters()}
    H, Dh, eps = m.num_heads, m.head_dim, m.kv_a_norm.eps

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    if m.q_lora_rank:
        q = rms(x @ W["q_a_proj.weight"].T, W["q_a_norm.weight"]) @ W["q_b_proj.weight"].T
    else:
        q = x @ W["q_proj.weight"].T
    c = rms(x @ W["kv_a_proj.weight"].T, W["kv_a_norm.weight"])
    k = c @ W["k_b_proj.weight"].T
    v = c @ W["v_b_proj.weight"].T
    o = torch.zeros_like(q)
    for s, e in zip(cu[:-1], cu[1:]):
        for h in range(H):
            sl = slice(h * Dh, (h + 1) * Dh)
            scores = q[s:e, sl] @ k[s:e, sl].T / Dh**0.5
            scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
            o[s:e, sl] = scores.softmax(-1) @ v[s:e, sl]
    gate = torch.sigmoid(x @ W["g_proj.weight"].T)
    return (gate * o) @ W["o_proj.weight"].T


@pytest.mark.parametrize("q_lora_rank", [0, 48])
@pytest.mark.parametrize("absorb", [False, True])
def test_matches_fp64_reference(q_lora_rank, absorb):
    # tolerance: fp32 vs fp64 reference, atol 2e-5 on outputs of magnitude ~1
    m = make_mla(q_lora_rank)
    cu = [0, 7, 30, 31, 64]
    x = torch.randn(cu[-1], 128)
    y, present = m(x, torch.tensor(cu, dtype=torch.int32), absorb=absorb)
    assert present is None
    ref = reference_mla(m, x, cu)
    assert ref.abs().mean() > 0.1
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=1e-4)


def test_absorbed_equals_naive_with_cached_prefix():
    # absorbed (MQA over the latent) vs naive (decompressed K, V), fp32, atol 1e-5, with a cached prefix
    m = make_mla(q_lora_rank=32, seed=1)
    cu = torch.tensor([0, 5, 6, 20], dtype=torch.int32)
    x = torch.randn(20, 128)
    past = [m.compress_kv(torch.randn(n, 128)).detach() for n in (9, 0, 3)]
    y_naive, p1 = m(x, cu, past=past, absorb=False)
    y_abs, p2 = m(x, cu, past=past, absorb=True)
    torch.testing.assert_close(y_abs, y_naive, atol=1e-5, rtol=1e-5)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_incremental_with_latent_cache_equals_one_pass():
    # prefill 11 tokens, then 1 + 4 + 1 more with the latent cache (absorbed path): == full pass, atol 1e-5.
    m = make_mla(seed=2)
    x = torch.randn(17, 128)
    full, _ = m(x, torch.tensor([0, 17], dtype=torch.int32))
    past = [torch.zeros(0, m.kv_lora_rank)]
    outs = []
    for s, e in ((0, 11), (11, 12), (12, 16), (16, 17)):
        y, past = m(x[s:e], torch.tensor([0, e - s], dtype=torch.int32), past=past)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)
    # the cache holds only the compressed latent: [L, kv_lora_rank] per sequence
    assert len(past) == 1 and past[0].shape == (17, m.kv_lora_rank)
    torch.testing.assert_close(past[0], m.compress_kv(x), atol=1e-6, rtol=1e-5)


def test_packed_sequences_do_not_attend_across_boundaries_and_causal():
    m = make_mla(seed=3)
    cu = torch.tensor([0, 10, 25], dtype=torch.int32)
    x = torch.randn(25, 128)
    y, _ = m(x, cu)
    x2 = x.clone()
    x2[15] += 3.0  # perturb a token of sequence 2
    y2, _ = m(x2, cu)
    assert torch.equal(y[:15], y2[:15])  # sequence 1 and earlier tokens of sequence 2: unchanged
    assert (y[15:] - y2[15:]).abs().max() > 1e-3


@pytest.mark.parametrize("flash", [True, False])
def test_query_chunking_matches_single_shot(flash, monkeypatch):
    # the flash path and the masked chunked path (tiny score budget) equal an explicit masked-softmax
    # reference, atol 1e-6
    monkeypatch.setattr(mla, "_FLASH_ENABLED", flash)
    torch.manual_seed(4)
    t, prefix, H = 37, 13, 3
    q, k, v = torch.randn(t, H, 16), torch.randn(prefix + t, H, 16), torch.randn(prefix + t, H, 16)
    scores = torch.einsum("thd,lhd->htl", q, k) * 0.25
    allowed = torch.arange(prefix + t)[None, :] <= (prefix + torch.arange(t))[:, None]
    ref = torch.einsum("htl,lhd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    for budget in (1, H * (prefix + t) * 5, 1 << 25):
        torch.testing.assert_close(
            causal_attention(q, k, v, prefix, 0.25, score_budget=budget), ref, atol=1e-6, rtol=1e-5
        )
    # MQA form (one shared head) broadcasts over the query heads
    k1, v1 = k[:, :1], v[:, :1]
    ref1 = causal_attention(q, k1.expand(-1, H, -1), v1.expand(-1, H, -1), prefix, 0.25)
    torch.testing.assert_close(
        causal_attention(q, k1, v1, prefix, 0.25, score_budget=50), ref1, atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("shared_kv_head", [False, True])
def test_prefix_attention_gradients_match_masked_softmax_reference(shared_kv_head, flash, monkeypatch):
    """With a prefix and gradients, `causal_attention` runs `_FlashPrefixAttention` on CPU (prefix and own
    block as two flash calls merged by log-sum-exp, flash's backward given the merged output and lse), or
    `_ChunkedPrefixAttention` (masked query chunks, the backward recomputes one chunk at a time): output and
    the gradients of q, k, v equal the explicit masked softmax in fp64 (relative L2 <= 1e-5), for one chunk
    and for many (MQA: one shared key/value head broadcast)."""
    monkeypatch.setattr(mla, "_FLASH_ENABLED", flash)
    torch.manual_seed(6)
    t, prefix, H = 29, 17, 3
    Hk = 1 if shared_kv_head else H
    q0, k0, v0 = torch.randn(t, H, 16), torch.randn(prefix + t, Hk, 16), torch.randn(prefix + t, Hk, 16)
    w = torch.randn(t, H, 16)
    q, k, v = (x.double().requires_grad_() for x in (q0, k0, v0))
    scores = torch.einsum("thd,lhd->htl", q, k.expand(-1, H, -1)) * 0.25
    allowed = torch.arange(prefix + t)[None, :] <= (prefix + torch.arange(t))[:, None]
    ref = torch.einsum("htl,lhd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1),
                       v.expand(-1, H, -1))
    (ref * w.double()).sum().backward()
    for budget in (H * (prefix + t) * 5, 1 << 25):  # 5-query chunks, one chunk
        qf, kf, vf = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = causal_attention(qf, kf, vf, prefix, 0.25, score_budget=budget)
        (out * w).sum().backward()
        for got, want in ((out, ref), (qf.grad, q.grad), (kf.grad, k.grad), (vf.grad, v.grad)):
            assert float((got.detach().double() - want.detach()).norm() / want.detach().norm()) <= 1e-5


def test_cache_row_mismatch_is_a_clear_error():
    m = make_mla()
    with pytest.raises(ValueError, match="cache has 1 rows"):
        m(torch.randn(4, 128), torch.tensor([0, 2, 4], dtype=torch.int32), past=[torch.zeros(0, 64)])


def test_gradients_match_fp64_reference():
    # the flash-kernel path (4-D SDPA, equal-length runs batched) backpropagates like the fp64 formula:
    # input and parameter gradients within relative L2 1e-5 (fp32 vs fp64)
    m = make_mla(q_lora_rank=48, seed=5)
    cu = [0, 16, 32, 48, 53, 77]  # a run of three 16-token sequences, then ragged ones
    x = torch.randn(cu[-1], 128, requires_grad=True)
    w = torch.randn(cu[-1], 128)
    (m(x, torch.tensor(cu, dtype=torch.int32))[0] * w).sum().backward()
    x64 = x.detach().double().requires_grad_()
    ref_m = make_mla(q_lora_rank=48, seed=5).double()
    (reference_mla_autograd(ref_m, x64, cu) * w.double()).sum().backward()
    grads = [(x.grad, x64.grad)] + [(p.grad, r.grad) for p, r in zip(m.parameters(), ref_m.parameters())]
    for g, r in grads:
        assert float((g.double() - r).norm() / r.norm()) < 1e-5


def reference_mla_autograd(m: GatedMLA, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """`reference_mla` on m's own (fp64) parameters, differentiable."""
    H, Dh, eps = m.num_heads, m.head_dim, m.kv_a_norm.eps

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    q = rms(x @ m.q_a_proj.weight.T, m.q_a_norm.weight) @ m.q_b_proj.weight.T
    c = rms(x @ m.kv_a_proj.weight.T, m.kv_a_norm.weight)
    k, v = c @ m.k_b_proj.weight.T, c @ m.v_b_proj.weight.T
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        heads = []
        for h in range(H):
            sl = slice(h * Dh, (h + 1) * Dh)
            scores = q[s:e, sl] @ k[s:e, sl].T / Dh**0.5
            scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
            heads.append(scores.softmax(-1) @ v[s:e, sl])
        outs.append(torch.cat(heads, -1))
    return (torch.sigmoid(x @ m.g_proj.weight.T) * torch.cat(outs)) @ m.o_proj.weight.T


@torch.no_grad()
@pytest.mark.parametrize("q_lora_rank", [0, 32])
@pytest.mark.parametrize("fused", [True, False])
def test_batched_decode_step_equals_per_sequence_absorbed_attention(q_lora_rank, fused, monkeypatch):
    # the decode step (fused: one matmul for the q, latent and gate projections; both: one masked SDPA call
    # over the padded latent buffer) == attend_absorbed per sequence (two flash calls merged by lse on CPU:
    # another kernel, so atol 5e-6); the appended latents ==
    # compress_kv (atol 1e-5: a different matmul shape rounds differently)
    if not fused:
        monkeypatch.setenv("ODYSSEY_FUSED_CPU_KERNEL", "0")
    m = make_mla(q_lora_rank=q_lora_rank, seed=6)
    calls = []
    real = GatedMLA.decode_step_fused
    monkeypatch.setattr(GatedMLA, "decode_step_fused", lambda *a: calls.append(1) or real(*a))
    past = [m.compress_kv(torch.randn(n, 128)) for n in (9, 1, 30)]
    x = torch.randn(3, 128)
    y, present = m(x, torch.arange(4, dtype=torch.int32), past=past)
    assert calls == [1]
    c = m.compress_kv(x)
    q = m.project_q(x)
    o = torch.cat([m.attend_absorbed(q[n:n + 1], torch.cat([past[n], c[n:n + 1]]), past[n].shape[0])
                   for n in range(3)])
    torch.testing.assert_close(y, m.gated_output(x, o.reshape(3, -1)), atol=5e-6, rtol=1e-5)
    assert isinstance(present, MLALatentCache) and present.lens == [10, 2, 31]
    for n in range(3):
        torch.testing.assert_close(present[n], torch.cat([past[n], c[n:n + 1]]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_latent_cache_appends_in_place_and_branches_copy_on_write():
    m = make_mla(seed=7)
    cu1 = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu0 = torch.tensor([0, 4, 10], dtype=torch.int32)
    base = m(torch.randn(10, 128), cu0, past=MLALatentCache.empty(2, 64))[1]
    step1 = m(torch.randn(2, 128), cu1, past=base)[1]  # grows the buffer (capacity doubles)
    buf = step1.buffer
    steps = [step1]
    for _ in range(3):
        steps.append(m(torch.randn(2, 128), cu1, past=steps[-1])[1])
    assert all(s.buffer is buf for s in steps)  # token-by-token: written in place, no copy
    assert steps[-1].lens == [8, 10] and buf.shape[1] >= 10
    # branch: continue from step1 again with another token; the first branch's rows must not change
    before = [r.clone() for r in steps[-1]]
    xb = torch.randn(2, 128)
    branch = m(xb, cu1, past=step1)[1]
    assert branch.buffer is not buf
    for r, b in zip(steps[-1], before):
        assert torch.equal(r, b)
    torch.testing.assert_close(branch[0][-1], m.compress_kv(xb)[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(branch[0][:-1], step1[0])
    # select / concat / list compatibility
    sel = steps[-1].select([1, 1, 0])
    assert sel.lens == [10, 10, 8] and torch.equal(sel[2], steps[-1][0])
    cat = MLALatentCache.concat([sel, base])
    assert cat.lens == [10, 10, 8, 4, 6] and torch.equal(cat[3], base[0])
    assert MLALatentCache.from_latents(list(cat)).lens == cat.lens
    assert cat.nbytes() == sum(cat.lens) * 64 * 4


def test_latent_cache_from_inference_mode_is_copied_outside_it():
    m = make_mla(seed=8)
    with torch.inference_mode():
        cu = torch.tensor([0, 5], dtype=torch.int32)
        past = m(torch.randn(5, 128), cu, past=MLALatentCache.empty(1, 64))[1]
    with torch.no_grad():  # an inference tensor cannot be written outside inference mode: copied instead
        y, present = m(torch.randn(1, 128), torch.tensor([0, 1], dtype=torch.int32), past=past)
    assert present.lens == [6] and torch.isfinite(y).all()
