"""The CUDA backend of chunk_kda (model/kda_fla.py): fla-core's Triton kernels behind our contract.

On a CPU machine fla's Triton kernels cannot run (not even under Triton's CPU interpreter), so what is
checked here is the adapter's argument mapping: the keyword arguments it builds are run through fla's
own torch reference (`fla.ops.kda.naive.naive_recurrent_kda`, the semantics of its `chunk_kda`: scale,
[B, T, H, K] layout, [N, H, K, V] state), one packed sequence at a time as fla's cu_seqlens means, and
must equal our reference. `test_fla_backend_on_cuda` runs the real kernels when a GPU is present.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

from model import kda as kda_mod
from model import kda_fla
from model.kda import chunk_kda, kda_gate, naive_recurrent_kda

H, K, V = 3, 32, 48
TOL = 1e-5  # fp32 references on both sides: only summation order differs


@pytest.fixture(scope="module")
def fla_ops():
    """fla-core is a declared dependency of the gpu and dev extras: missing here is a failure, not a skip."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform" on CPU machines
        import fla.ops.kda as ops
        from fla.ops.kda.naive import naive_recurrent_kda as fla_naive
    return ops.chunk_kda, fla_naive


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(lens: list[int], B: int = 1, seed: int = 0, dtype=torch.float32, z_scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens) if B == 1 else lens[0]
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = kda_gate(torch.randn(B, T, H, K, generator=gen) * z_scale, torch.zeros(H))
    beta = torch.rand(B, T, H, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def run_fla_semantics(fla_naive, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """What fla's chunk_kda computes for these keyword arguments, with fla's torch reference: the whole
    batch at once, or (cu_seqlens) each packed sequence from its own initial state."""
    common = dict(scale=kwargs["scale"], output_final_state=kwargs["output_final_state"])
    x = [kwargs[n] for n in ("q", "k", "v", "g", "beta")]
    h0 = kwargs["initial_state"]
    if kwargs["cu_seqlens"] is None:
        return fla_naive(*x, initial_state=h0, **common)
    cu = kwargs["cu_seqlens_cpu"].tolist()
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        h0_n = None if h0 is None else h0[n : n + 1]
        o, S = fla_naive(*(t[:, a:b] for t in x), initial_state=h0_n, **common)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs, 1), torch.cat(finals)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_argument_mapping_matches_our_reference(fla_ops, packed, with_state):
    """Our contract -> fla's arguments -> fla's semantics -> our outputs equals our reference: q not
    rescaled (scale=1.0), same layout, per-sequence states, empty sequences keep their initial state."""
    fla_chunk_kda, fla_naive = fla_ops
    lens = [37, 0, 64, 5, 0] if packed else [50, 50]
    B = 1 if packed else 2
    q, k, v, g, beta = inputs(lens, B)
    N = len(lens) if packed else B
    S0 = torch.randn(N, H, K, V) if with_state else None
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32) if packed else None
    call = kda_fla.fla_call(q, k, v, g, beta, S0, cu_seqlens=cu)
    kw = call.kwargs
    inspect.signature(fla_chunk_kda).bind(**kw)  # every name exists in fla's chunk_kda
    assert kw["scale"] == 1.0 and kw["output_final_state"] and kw["safe_gate"]  # kda_gate: g in [-5, 0)
    in_kernel = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "use_qk_l2norm_in_kernel")
    assert not any(kw[name] for name in in_kernel)  # g, beta and the q/k norms are computed by us
    assert kw["chunk_size"] in (32, 64)
    if packed:
        assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens_cpu"].device.type == "cpu"
        assert kw["cu_seqlens_cpu"].tolist() == [0, 37, 101, 106] and call.kept == [0, 2, 3]
    if kw["initial_state"] is not None:
        assert kw["initial_state"].dtype == torch.float32 and kw["initial_state"].shape[0] == len(call.kept)
    o, S = call.outputs(*run_fla_semantics(fla_naive, kw))
    assert o.shape == v.shape and o.dtype == v.dtype and S.shape == (N, H, K, V) and S.dtype == torch.float32
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for n in range(N):
        h0 = None if S0 is None else S0[n : n + 1]
        if packed:  # sequence n is tokens [starts[n], starts[n + 1]) of the one packed row
            seq = [t[:, starts[n] : starts[n + 1]] for t in (q, k, v, g, beta)]
            o_n = o[:, starts[n] : starts[n + 1]]
        else:  # sequence n is row n
            seq = [t[n : n + 1] for t in (q, k, v, g, beta)]
            o_n = o[n : n + 1]
        o_ref, S_ref = naive_recurrent_kda(*seq, h0)
        if o_n.shape[1]:
            assert rel_rms(o_n, o_ref) < TOL, n
        if S_ref.norm() > 0:
            assert rel_rms(S[n : n + 1], S_ref) < TOL, n
        else:  # an empty sequence without initial state
            assert torch.equal(S[n : n + 1], S_ref), n


def test_control_fla_default_scale_would_rescale_q(fla_ops):
    """Control for the test above: with fla's default scale (None = K^-1/2) the same call gives a different
    result, so the mapping test would catch a missing scale=1.0."""
    _, fla_naive = fla_ops
    q, k, v, g, beta = inputs([50, 50], B=2, seed=1)
    kw = kda_fla.fla_call(q, k, v, g, beta).kwargs | {"scale": None}
    o, _ = kda_fla.fla_call(q, k, v, g, beta).outputs(*run_fla_semantics(fla_naive, kw))
    assert rel_rms(o, naive_recurrent_kda(q, k, v, g, beta)[0]) > 0.5


def test_gate_bound_chooses_fla_path_and_contract_errors_are_ours():
    """g below -5 on some token (allowed by our contract when the tiles still sum >= -80): fla's exact
    token-parallel path (safe_gate=False). g > 0 and malformed shapes raise our own errors."""
    q, k, v, g, beta = inputs([40], seed=2)
    g_deep = g.clone()
    g_deep[:, 3] = -20.0
    assert kda_fla.fla_call(q, k, v, g_deep, beta).kwargs["safe_gate"] is False
    assert kda_fla.fla_call(q, k, v, g_deep, beta, check_decay_bound=False).kwargs["safe_gate"] is True
    with pytest.raises(ValueError, match="max g"):
        kda_fla.fla_call(q, k, v, g.clone().fill_(0.01), beta)
    with pytest.raises(ValueError, match="beta must be"):
        kda_fla.fla_call(q, k, v, g, beta[..., 0])
    with pytest.raises(ValueError, match="initial_state"):
        kda_fla.fla_call(q, k, v, g, beta, torch.zeros(3, H, K, V))


def test_backend_choice(monkeypatch):
    """fla imports on this machine (declared dependency); ODYSSEY_KDA_FLA=0 switches it off; CPU tensors
    never take it (chunk_kda == the torch path here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert kda_fla.available()
    monkeypatch.setenv("ODYSSEY_KDA_FLA", "0")
    assert not kda_fla.available()
    monkeypatch.delenv("ODYSSEY_KDA_FLA")
    called = []
    monkeypatch.setattr(kda_fla, "chunk_kda_fla", lambda *a: called.append(a))
    q, k, v, g, beta = inputs([20], seed=3)
    o, _ = chunk_kda(q, k, v, g, beta)
    assert not called and rel_rms(o, naive_recurrent_kda(q, k, v, g, beta)[0]) < 5e-3
    assert kda_mod.chunk_kda is chunk_kda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on CPU CI machines)")
def test_fla_backend_on_cuda():
    """On a GPU: the layer's path (chunk_kda picks fla for CUDA tensors) equals our reference, packed with
    an empty sequence and initial states, fp32 and bf16, forward and gradients."""
    dev = torch.device("cuda")
    lens = [37, 0, 130, 5]
    q, k, v, g, beta = (t.to(dev) for t in inputs(lens, seed=4))
    S0 = torch.randn(len(lens), H, K, V, device=dev)
    cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for dtype, tol in ((torch.float32, 5e-3), (torch.bfloat16, 2e-2)):
        xs = [t.to(dtype) if i < 3 else t for i, t in enumerate((q, k, v, g, beta))]
        o, S = chunk_kda(*xs, S0, cu_seqlens=cu, check_decay_bound=False)
        for n in range(len(lens)):
            a, b = starts[n], starts[n + 1]
            o_ref, S_ref = naive_recurrent_kda(*(t[:, a:b] for t in (q, k, v, g, beta)), S0[n : n + 1])
            if b > a:
                assert rel_rms(o[:, a:b].float(), o_ref) < tol, (dtype, n)
            assert rel_rms(S[n : n + 1], S_ref) < tol, (dtype, n)
    xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o, S = chunk_kda(*xs[:5], xs[5], cu_seqlens=cu)
    (o.square().sum() + S.square().sum()).backward()
    ys = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    loss = 0.0
    for n in range(len(lens)):
        o_n, S_n = naive_recurrent_kda(*(t[:, starts[n] : starts[n + 1]] for t in ys[:5]), ys[5][n : n + 1])
        loss = loss + o_n.square().sum() + S_n.square().sum()
    loss.backward()
    for name, a, b in zip("q k v g beta S0".split(), xs, ys):
        assert rel_rms(a.grad, b.grad) < 5e-3, name
