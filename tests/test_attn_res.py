"""Block Attention Residuals (model/attn_res.py): the read, its oracles, the block bookkeeping."""

from __future__ import annotations

import pytest
import torch

from model import attn_res as attn_res_mod
from model import fused_cpu
from model.attn_res import AttnResRead, AttnResStream, attn_res_reference, full_attn_res_reference
from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM


def test_zero_queries_give_the_mean_of_the_sources():
    # zero-initialised pseudo-query => uniform softmax => mean of sources, for any norm scale (atol 1e-6)
    torch.manual_seed(0)
    read = AttnResRead(64)
    with torch.no_grad():
        read.norm_weight.uniform_(0.5, 2.0)
    sources = [torch.randn(9, 64) * s for s in (1.0, 10.0, 0.1, 3.0)]
    assert torch.count_nonzero(read.query) == 0  # init
    torch.testing.assert_close(read(sources), torch.stack(sources).mean(0), atol=1e-6, rtol=1e-6)


def test_read_matches_explicit_fp64_softmax_and_softmax_is_fp32():
    # random pseudo-query: equal to the explicit formula sum_i softmax_i(w^T RMSNorm(v_i)) v_i (atol 1e-5)
    torch.manual_seed(1)
    read = AttnResRead(64)
    with torch.no_grad():
        read.query.normal_(0, 1.0)
        read.norm_weight.uniform_(0.5, 2.0)
    sources = [torch.randn(5, 7, 64) * s for s in (1.0, 4.0, 0.5)]
    ref = attn_res_reference(read.query, read.norm_weight, sources, read.eps)
    torch.testing.assert_close(read(sources).double(), ref, atol=1e-5, rtol=1e-5)
    # bf16 sources: the mixture weights are still fp32, so the result is within bf16 rounding of fp64
    out_bf16 = read([s.bfloat16() for s in sources])
    assert out_bf16.dtype == torch.bfloat16
    ref_bf16 = attn_res_reference(read.query, read.norm_weight, [s.bfloat16() for s in sources], read.eps)
    torch.testing.assert_close(out_bf16.double(), ref_bf16, atol=0.05, rtol=2e-2)


def _model(block_size: int) -> OdysseyForCausalLM:
    """tiny preset with dense FFNs (no routing discontinuities) and random (non-zero) pseudo-queries."""
    torch.manual_seed(2)
    cfg = OdysseyConfig.from_preset("tiny", n_routed_experts=0, attn_res_block_size=block_size)
    model = OdysseyForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, AttnResRead):
                mod.query.normal_(0.0, 0.3)
    return model


def block_attn_res_reference(model: OdysseyForCausalLM, ids: torch.Tensor, S: int) -> torch.Tensor:
    """Naive Block AttnRes: remember every sublayer output with its layer index and rebuild the sources
    from scratch at every read: [embedding, sum of each completed block, sum of the open block]."""
    cu = torch.tensor([0, ids.shape[0]], dtype=torch.int32)
    emb = model.model.embed_tokens(ids)
    outputs: list[tuple[int, torch.Tensor]] = []

    def sources(l: int) -> list[torch.Tensor]:
        done = l // S
        srcs = [emb] + [sum(o for j, o in outputs if b * S <= j < (b + 1) * S) for b in range(done)]
        open_block = [o for j, o in outputs if j >= done * S]
        return srcs + ([sum(open_block)] if open_block else [])

    def read(r: AttnResRead, srcs: list[torch.Tensor]) -> torch.Tensor:
        return attn_res_reference(r.query, r.norm_weight, srcs, r.eps).to(emb.dtype)

    for l, layer in enumerate(model.model.layers):
        a = layer.mix(read(layer.attn_res.attn_read, sources(l)), cu, None, False)[0]
        outputs.append((l, a))
        f = layer.ffn(read(layer.attn_res.ffn_read, sources(l)), None)[0]
        outputs.append((l, f))
    L = len(model.model.layers)
    return model.model.norm(read(model.model.final_read, sources(L)))


@pytest.mark.parametrize("block_size", [1, 2, 3, 8])
@torch.no_grad()
def test_model_block_bookkeeping_matches_naive_reference(block_size):
    # the model's incremental blocks/partial sums == sources rebuilt from every sublayer output (atol 1e-4).
    # float64 weights, so the margin is not eaten by fp32 rounding amplified through 8 layers (up to ~2e-4 in
    # fp32 on AVX-512 machines); the AttnRes softmax stays fp32 by design, which leaves ~1e-5. A bookkeeping
    # error (a wrong block sum) moves the output by O(0.1).
    model = _model(block_size).double()
    ids = torch.randint(0, model.config.vocab_size, (24,))
    h, _, _, _ = model.model(ids, torch.tensor([0, 24], dtype=torch.int32))
    ref = block_attn_res_reference(model, ids, block_size)
    torch.testing.assert_close(h, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_block_size_one_is_full_attn_res():
    # S = 1: every layer's output is its own source == the naive full AttnRes (atol 1e-4)
    model = _model(1)
    ids = torch.randint(0, model.config.vocab_size, (20,))
    cu = torch.tensor([0, 20], dtype=torch.int32)
    layers = [
        (
            layer.attn_res.attn_read,
            lambda h, layer=layer: layer.mix(h, cu, None, False)[0],
            layer.attn_res.ffn_read,
            lambda h, layer=layer: layer.ffn(h, None)[0],
        )
        for layer in model.model.layers
    ]
    ref = full_attn_res_reference(
        model.model.embed_tokens(ids), layers, model.model.final_read, model.model.final_read.eps
    )
    h, _, _, _ = model.model(ids, cu)
    torch.testing.assert_close(h, model.model.norm(ref), atol=1e-4, rtol=1e-4)
    # and the block rule matters: a different block size gives a different function
    model3 = _model(3)
    h3, _, _, _ = model3.model(ids, cu)
    assert (h3 - h).abs().max() > 1e-3


def test_fresh_model_has_zero_queries_and_unit_norms():
    model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", n_routed_experts=0))
    reads = [m for m in model.modules() if isinstance(m, AttnResRead)]
    assert len(reads) == 2 * model.config.num_hidden_layers + 1  # two per layer + the final read
    for r in reads:
        assert torch.count_nonzero(r.query) == 0 and torch.all(r.norm_weight == 1)


def test_read_gradients_match_fp64_reference():
    # sources, pseudo-query and norm scale get the gradients of the explicit fp64 formula (relative L2 1e-5);
    # the read folds the norm scale into the query and multiplies by each source's inverse RMS afterwards
    torch.manual_seed(3)
    read = AttnResRead(32)
    with torch.no_grad():
        read.query.normal_(0, 1.0)
        read.norm_weight.uniform_(0.5, 2.0)
    sources = [(torch.randn(11, 32) * s).requires_grad_() for s in (1.0, 3.0, 0.3, 2.0)]
    ct = torch.randn(11, 32)
    (read(sources) * ct).sum().backward()
    got = [read.query.grad, read.norm_weight.grad] + [s.grad for s in sources]
    q64, g64 = (p.detach().double().requires_grad_() for p in (read.query, read.norm_weight))
    s64 = [s.detach().double().requires_grad_() for s in sources]
    (attn_res_reference(q64, g64, s64, read.eps) * ct.double()).sum().backward()
    for g, r in zip(got, [q64.grad, g64.grad] + [s.grad for s in s64]):
        assert float((g.double() - r).norm() / r.norm()) < 1e-5


def test_stream_reads_reuse_each_sources_inverse_rms(monkeypatch):
    # the stream computes each source's inverse RMS once (a sealed block keeps its own); reads through the
    # stream equal reads that recompute everything (atol 1e-6)
    torch.manual_seed(4)
    reads = [AttnResRead(16) for _ in range(3)]
    with torch.no_grad():
        for r in reads:
            r.query.normal_(0, 1.0)
    stream = AttnResStream([torch.randn(6, 16)])
    computed: list[torch.Tensor] = []
    real = attn_res_mod.inverse_rms
    for step in range(6):
        for r in reads:
            monkeypatch.setattr(attn_res_mod, "inverse_rms",
                                lambda v, eps: computed.append(v) or real(v, eps))
            h = r.read(stream)
            monkeypatch.setattr(attn_res_mod, "inverse_rms", real)
            torch.testing.assert_close(h, r(stream.sources()), atol=1e-6, rtol=1e-6)
        stream.add(torch.randn(6, 16))
        if step % 2:
            stream.seal()
    # sources ever read: the embedding, the partial after step 0, block 1, the partial after step 2,
    # block 2, the partial after step 4: six, each normalised once for all three reads
    assert len(computed) == 6 and len({id(v) for v in computed}) == 6


@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_read_forward_and_gradients_equal_the_torch_read(with_norm, monkeypatch):
    """On fp32 CPU with autograd a stream read (+ the sublayer RMSNorm after it) is one fused kernel
    forward and one backward (model/fused_cpu.cpp); its output and the gradients of every source (through
    the read and through their cached inverse RMS), the pseudo-query, the read's norm scale and the RMSNorm
    weight equal the torch read (kernels off), rel L2 < 1e-5. Two reads share the stream's inverse RMS."""
    from model.norm import RMSNorm

    torch.manual_seed(6)
    reads = [AttnResRead(32) for _ in range(2)]
    norm = RMSNorm(32)
    with torch.no_grad():
        for r in reads:
            r.query.normal_(0, 1.0)
            r.norm_weight.uniform_(0.5, 1.5)
        norm.weight.uniform_(0.5, 1.5)
    base = [torch.randn(40, 32) * s for s in (1.0, 3.0, 0.5, 2.0)]
    cts = [torch.randn(40, 32) for _ in reads]

    def run():
        for m in [*reads, norm]:
            m.zero_grad()
        srcs = [b.clone().requires_grad_() for b in base]
        stream = AttnResStream(srcs[:3], srcs[0] * 0.3 + srcs[3])
        outs = [r.read(stream, norm if with_norm else None) for r in reads]
        sum((o * c).sum() for o, c in zip(outs, cts)).backward()
        params = [p.grad.clone() for m in reads for p in m.parameters()]
        params += [norm.weight.grad.clone()] if with_norm else []
        return [o.detach() for o in outs] + [s.grad for s in srcs] + params

    fused = run()
    monkeypatch.setattr(fused_cpu, "load", lambda: None)
    ref = run()
    assert len(fused) == len(ref)
    for a, b in zip(fused, ref):
        assert float((a - b).norm() / b.norm()) < 1e-5
