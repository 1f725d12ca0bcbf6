"""Oracle tests for KDA (model/kda.py, model/kda_chunk.py, model/kda_reference.py) and its causal short conv
(model/short_conv.py).

Oracles: `naive_recurrent_kda` (token-by-token recurrence), `naive_chunk_kda` (the plain chunked form), a
literal matrix form of the recurrence, `naive_causal_short_conv` (per-sequence loop) and, for the layer,
each sequence run alone / in one pass.
Tolerances are relative RMS errors ||a - b|| / ||b||, stated in each test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import model.kda as kda_mod
from model import fused_cpu, kda_chunk, kda_cpu, kda_recurrent
from model.kda import (
    KDALayerState,
    KDAttention,
    chunk_kda,
    fused_recurrent_kda_step,
    kda_gate,
    naive_chunk_kda,
    naive_recurrent_kda,
    unbounded_kda_gate,
)
from model.short_conv import causal_short_conv, causal_short_conv_silu, naive_causal_short_conv

H, K, V = 2, 32, 32
FP32_TOL = 5e-3  # DESIGN.md: chunkwise == naive, rel-RMS < 5e-3 in fp32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: with 2 intra-op threads on a busy 2-core machine, thread barriers make
    each op 10x slower. Run this module single-threaded and restore the setting afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B: int, T: int, h: int = H, z_scale: float = 3.0, seed: int = 0, dtype=torch.float32):
    """q, k L2-normed (as in the layer; q also scaled by K^-1/2), g from the bounded gate."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, h, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, h, K, generator=gen), dim=-1)
    v = torch.randn(B, T, h, V, generator=gen)
    g = kda_gate(torch.randn(B, T, h, K, generator=gen) * z_scale, torch.zeros(h))
    beta = torch.rand(B, T, h, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def cu_from(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


# ------------------------------------------------------------------------------------------ gate / oracle
def test_kda_gate_is_lower_bounded():
    z = torch.linspace(-30, 30, 601).view(-1, 1, 1).expand(-1, H, K)
    A_log = torch.tensor([0.0, 2.0])
    g = kda_gate(z, A_log, g_min=-5.0)
    assert g.dtype == torch.float32 and g.shape == z.shape
    assert g.min().item() >= -5.0 and g.max().item() <= 0  # [g_min, 0); fp32 sigmoid may round to 0 or 1
    assert 16 * g.min().item() >= -80.0  # a 16-token tile sums to >= -80: e^80 fits fp32/bf16
    expected = -5.0 * torch.sigmoid(A_log.exp()[:, None] * z)  # the formula, exactly
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    assert torch.allclose(kda_gate(torch.zeros(1, H, K), torch.zeros(H)), torch.full((1, H, K), -2.5))
    # the control gate is unbounded: large z gives g ~ -z
    assert unbounded_kda_gate(torch.full((1, H, K), 30.0), torch.zeros(H)).max().item() < -29.0


def test_naive_matches_literal_matrix_recurrence():
    """naive (delta form (2)) == literal fp64 S_t = (I - b k k^T) Diag(a) S_{t-1} + b k v^T, o_t = S_t^T q_t.
    Tolerance: rel-RMS < 1e-5 (naive runs in fp32)."""
    B, T = 2, 9
    q, k, v, g, beta = make_inputs(B, T)
    S0 = torch.randn(B, H, K, V)
    o, S = naive_recurrent_kda(q, k, v, g, beta, S0)
    Sl = S0.double()
    eye = torch.eye(K, dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, bt = k[:, t].double(), beta[:, t].double()[..., None, None]
        trans = (eye - bt * kt[..., :, None] * kt[..., None, :]) @ torch.diag_embed(g[:, t].double().exp())
        Sl = trans @ Sl + bt * kt[..., :, None] * v[:, t].double()[..., None, :]
        outs.append((Sl.transpose(-1, -2) @ q[:, t].double()[..., None])[..., 0])
    assert rel_rms(o, torch.stack(outs, 1)) < 1e-5
    assert rel_rms(S, Sl) < 1e-5


# ------------------------------------------------------------------------------------------ chunk == naive
@pytest.fixture(params=["fused", "torch"])
def cpu_path(request, monkeypatch):
    """Without autograd, fp32 chunk_kda on CPU runs the fused kernels (model/kda_cpu.cpp); also run the torch
    reference path (`_wy_intra_chunk`, the autograd path) on the same inputs."""
    if request.param == "torch":
        monkeypatch.setenv("ODYSSEY_KDA_CPU_KERNEL", "0")
    return request.param


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_naive(chunk_size, with_state, cpu_path):
    """Fixed-length batch, T not a multiple of the chunk. Tolerance: rel-RMS < 5e-3 (fp32)."""
    B, T = 2, 100
    q, k, v, g, beta = make_inputs(B, T, seed=chunk_size)
    S0 = torch.randn(B, H, K, V) if with_state else None
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, S0)
    o, S = chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == torch.float32
    assert rel_rms(o, o_ref) < FP32_TOL
    assert rel_rms(S, S_ref) < FP32_TOL
    o_pc, S_pc = naive_chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size)  # the plain chunked oracle
    assert rel_rms(o, o_pc) < FP32_TOL and rel_rms(S, S_pc) < FP32_TOL


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, 128])
@pytest.mark.parametrize("with_state", [False, True])
def test_plain_chunked_reference_matches_recurrence(chunk_size, with_state):
    """The two references agree: the plain chunked form (3) (pairwise decays, triangular solve, any chunk
    size, T=100 not a multiple of it) == the token-by-token recurrence. Both fp32; tolerance rel-RMS < 1e-5
    (only the summation order differs), for o and the final state."""
    B, T = 2, 100
    q, k, v, g, beta = make_inputs(B, T, seed=20 + chunk_size)
    S0 = torch.randn(B, H, K, V) if with_state else None
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, S0)
    o, S = naive_chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size)
    assert o.shape == (B, T, H, V) and o.dtype == v.dtype and S.dtype == torch.float32
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(S, S_ref) < 1e-5
    o0, S0_out = naive_chunk_kda(*(x[:, :0] for x in (q, k, v, g, beta)), S0)  # T = 0: S0 passes through
    assert o0.shape == (B, 0, H, V)
    torch.testing.assert_close(S0_out, torch.zeros(B, H, K, V) if S0 is None else S0)


@pytest.fixture(params=["one_block", "block_per_step"])
def cpu_blocks(request, monkeypatch):
    """chunk_kda processes chunk steps in cache-sized blocks on CPU; also run with one step per block."""
    if request.param == "block_per_step":
        monkeypatch.setattr(kda_chunk, "_CPU_BLOCK_ELEMS", 1)
    return request.param


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_varlen_matches_naive_per_sequence(chunk_size, cpu_blocks, cpu_path):
    """Packed ragged lengths (with an empty one): state resets at each boundary, per-sequence initial
    states, no leakage; with one or many blocks. Tolerance: rel-RMS < 5e-3 (fp32) per sequence."""
    lens = [37, 64, 0, 5, 100]
    q, k, v, g, beta = make_inputs(1, sum(lens), seed=1)
    S0 = torch.randn(len(lens), H, K, V)
    cu = cu_from(lens)
    o, S = chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size, cu_seqlens=cu)
    assert S.shape == (len(lens), H, K, V)
    c = cu.tolist()
    for n in range(len(lens)):
        a, b = c[n], c[n + 1]
        o_ref, S_ref = naive_recurrent_kda(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S0[n : n + 1]
        )
        if b > a:
            assert rel_rms(o[:, a:b], o_ref) < FP32_TOL, n
        assert rel_rms(S[n : n + 1], S_ref) < FP32_TOL, n
    torch.testing.assert_close(S[2], S0[2])  # an empty sequence keeps its state


@pytest.mark.parametrize("packed", [False, True])
def test_chunk_gradients_match_naive(packed, cpu_blocks):
    """d/d(q, k, v, g, beta, initial_state) of a random loss on (o, final state).
    Tolerance: rel-RMS < 5e-3 (fp32) for every gradient."""
    lens = [21, 5, 40] if packed else [45]
    B = 1 if packed else 2
    T = sum(lens)
    N = len(lens) if packed else B
    base = list(make_inputs(B, T, seed=3)) + [torch.randn(N, H, K, V)]
    gen = torch.Generator().manual_seed(4)
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)

    def grads(fn):
        xs = [t.clone().requires_grad_() for t in base]
        o, S = fn(*xs)
        ((o * do).sum() + (S * dS).sum()).backward()
        return [x.grad for x in xs]

    if packed:
        cu = cu_from(lens)
        c = cu.tolist()

        def naive(q, k, v, g, beta, S0):  # one sequence at a time
            outs = [
                naive_recurrent_kda(*(t[:, c[n] : c[n + 1]] for t in (q, k, v, g, beta)), S0[n : n + 1])
                for n in range(N)
            ]
            return torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs])

        g_chunk = grads(lambda *xs: chunk_kda(*xs[:5], xs[5], chunk_size=16, cu_seqlens=cu))
    else:
        naive = naive_recurrent_kda
        g_chunk = grads(lambda *xs: chunk_kda(*xs[:5], xs[5], chunk_size=32))
    g_naive = grads(naive)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g_chunk, g_naive):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < FP32_TOL, (name, rel_rms(a, b))


def test_two_halves_carrying_state_equal_whole():
    """Split at a non-chunk-aligned point and carry the final state. Tolerance: rel-RMS < 5e-3 (fp32)."""
    B, T, cut = 2, 150, 70
    q, k, v, g, beta = make_inputs(B, T, seed=5)
    o, S = chunk_kda(q, k, v, g, beta)
    o1, S1 = chunk_kda(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut])
    o2, S2 = chunk_kda(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], S1)
    assert rel_rms(torch.cat([o1, o2], 1), o) < FP32_TOL
    assert rel_rms(S2, S) < FP32_TOL


def test_single_step_decode_equals_chunk():
    """fused_recurrent_kda_step token by token == chunk_kda. Tolerance: rel-RMS < 5e-3 (fp32)."""
    B, T = 3, 40
    q, k, v, g, beta = make_inputs(B, T, seed=6)
    S0 = torch.randn(B, H, K, V)
    o_ref, S_ref = chunk_kda(q, k, v, g, beta, S0, chunk_size=16)
    S, outs = S0, []
    for t in range(T):
        o_t, S = fused_recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o_t)
    assert rel_rms(torch.stack(outs, 1), o_ref) < FP32_TOL
    assert rel_rms(S, S_ref) < FP32_TOL


# ------------------------------------------------------------------------------- lower bound: why it exists
def test_bf16_chunk_long_sequence_close_to_fp32():
    """T=4096, bf16 q/k/v through the dense tile matmuls, gate pushed towards its bound (large |z|, so
    tiles reach cumulative log-decay near -80, i.e. factors near e^80). Reference: fp32 naive recurrence.
    Tolerance: finite, and rel-RMS < 1e-2 for o and for the final state (measured ~4e-3 and ~3e-3; rounding
    the inputs to bf16 alone gives ~3e-3)."""
    T = 4096
    q, k, v, g, beta = make_inputs(1, T, h=1, z_scale=8.0, seed=7)
    assert (g.view(-1, 16, 1, K).sum(1).min() < -60).item()  # some tiles are close to the -80 bound
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o, S = chunk_kda(qb, kb, vb, g, beta, chunk_size=64)
    assert o.dtype == torch.bfloat16
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o.float(), o_ref) < 1e-2
    assert rel_rms(S, S_ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_control_unbounded_gate_overflows_dense_tiles(dtype):
    """Control: the unbounded gate -e^A softplus(z) with large z gives g ~ -20 per token, so a 16-token
    tile sums to ~ -320 and its diagonal-tile factor e^{+320} overflows (inf * 0 = nan) on the same matmul
    path. The recurrence itself is fine (naive is finite), and the bounded gate on the same z works
    (rel-RMS < 5e-3 vs naive in fp32, < 2e-2 in bf16). That is why the lower bound exists."""
    T = 64
    q, k, v, _, beta = make_inputs(1, T, h=1, seed=8)
    z = torch.full((1, T, 1, K), 20.0) + torch.rand(1, T, 1, K)
    g_unb = unbounded_kda_gate(z, torch.zeros(1))
    assert (g_unb.view(-1, 16, K).sum(1).max() < -300).item()
    o_naive, _ = naive_recurrent_kda(q, k, v, g_unb, beta)
    assert torch.isfinite(o_naive).all()  # the math is fine; the dense tile is not
    o_unb, _ = chunk_kda(q.to(dtype), k.to(dtype), v.to(dtype), g_unb, beta, check_decay_bound=False)
    assert not torch.isfinite(o_unb).all()
    with pytest.raises(ValueError, match="kda_gate"):  # by default the bound is checked with a clear error
        chunk_kda(q, k, v, g_unb, beta)
    g_b = kda_gate(z, torch.zeros(1))
    o_b, _ = chunk_kda(q.to(dtype), k.to(dtype), v.to(dtype), g_b, beta)
    o_b_ref, _ = naive_recurrent_kda(q, k, v, g_b, beta)
    assert torch.isfinite(o_b).all()
    assert rel_rms(o_b.float(), o_b_ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)


def test_fused_cpu_kernels_build():
    """`make setup` compiles model/kda_cpu.cpp; if it cannot, chunk_kda would fall back to the slower torch
    path with a warning. Here that is a failure, so CI never passes on the fallback unnoticed."""
    kernels = kda_cpu.load()
    assert kernels is not None, "kda_cpu.cpp did not build: run python -m model.kda_cpu --verbose"
    assert kernels.LOG2_FLOOR == kda_chunk._LOG2_FLOOR  # the same decay floor on both paths


def test_failed_kernel_build_warns_once_and_falls_back_to_the_torch_path(monkeypatch, tmp_path):
    """A machine without a compiler: the build error becomes one RuntimeWarning that names the fix, and
    chunk_kda still runs (torch path) and equals naive. (The real build is test_fused_cpu_kernels_build.)"""
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'odyssey_kda_cpu': g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(kda_cpu.KERNELS, "_loaded", False)  # forget the module this process loaded
    monkeypatch.setattr(kda_cpu.KERNELS, "_module", None)  # (both restored after the test)
    monkeypatch.setenv("ODYSSEY_CACHE_DIR", str(tmp_path))  # an empty cache: the build must run (and fail)
    q, k, v, g, beta = make_inputs(1, 40, seed=10)
    with pytest.warns(RuntimeWarning, match=r"g\+\+: command not found") as record:
        o, _ = chunk_kda(q, k, v, g, beta)
        chunk_kda(q, k, v, g, beta)  # cached: no second build attempt, no second warning
    assert len(record) == 1 and "python -m model.kda_cpu" in str(record[0].message)
    assert rel_rms(o, naive_recurrent_kda(q, k, v, g, beta)[0]) < FP32_TOL
    # the failed build left nothing in the cache but its (flock) lock file: no binary, no temp dir
    assert [p.name for p in (tmp_path / kda_cpu.CACHE_NAME).iterdir()] == [f"{kda_cpu.build_key()}.lock"]


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_fused_cpu_path_equals_torch_path(chunk_size, cpu_blocks, monkeypatch):
    """The fused kernels (tile factors with their own exp2, tile inverses, state recurrence) against the
    torch reference path on the same inputs: 3 heads, V != K, ragged packed lengths with an empty one,
    per-sequence initial states, one or many blocks. Only summation order and the exp2 polynomial
    (rel. error < 1e-7) differ: outputs and final states to rel-RMS < 1e-5; both equal naive (< 5e-3)."""
    gen = torch.Generator().manual_seed(chunk_size)
    lens, h, Vw = [70, 0, 16, 129], 3, 48
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, h, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(1, T, h, K, generator=gen), dim=-1)
    v = torch.randn(1, T, h, Vw, generator=gen)
    g = kda_gate(torch.randn(1, T, h, K, generator=gen) * 3.0, torch.zeros(h))
    beta = torch.rand(1, T, h, generator=gen)
    S0 = torch.randn(len(lens), h, K, Vw, generator=gen)
    cu = cu_from(lens)
    calls, fused_intra = [], kda_chunk._wy_intra_chunk_fused
    monkeypatch.setattr(kda_chunk, "_wy_intra_chunk_fused", lambda *a: calls.append(1) or fused_intra(*a))
    o_f, S_f = chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size, cu_seqlens=cu)
    assert calls, "the fused path was not taken"
    monkeypatch.setenv("ODYSSEY_KDA_CPU_KERNEL", "0")
    n_fused = len(calls)
    o_t, S_t = chunk_kda(q, k, v, g, beta, S0, chunk_size=chunk_size, cu_seqlens=cu)
    assert len(calls) == n_fused, "ODYSSEY_KDA_CPU_KERNEL=0 must take the torch path"
    assert rel_rms(o_f, o_t) < 1e-5 and rel_rms(S_f, S_t) < 1e-5
    c = cu.tolist()
    for n in range(len(lens)):
        a, b = c[n], c[n + 1]
        ref = (x[:, a:b] for x in (q, k, v, g, beta))
        o_ref, S_ref = naive_recurrent_kda(*ref, S0[n : n + 1])
        if b > a:
            assert rel_rms(o_f[:, a:b], o_ref) < FP32_TOL, n
        assert rel_rms(S_f[n : n + 1], S_ref) < FP32_TOL, n


def test_decay_bound_check_is_exact_on_tile_sums():
    """The default bound check: g > 0 raises; a token below -5 is fine as long as every 16-token tile sums
    to >= -80 (then chunk equals naive, rel-RMS < 5e-3); a tile summing below -80 raises, packed too."""
    q, k, v, g, beta = make_inputs(1, 40, seed=9)
    with pytest.raises(ValueError, match="max g"):
        chunk_kda(q, k, v, g.clone().index_fill_(1, torch.tensor([7]), 0.01), beta)
    g_deep = g.clone()
    g_deep[:, 3] = -20.0  # one token far below -5; tile 0 still sums to >= -80
    assert g_deep[:, :16].sum(1).min() >= -80
    o, _ = chunk_kda(q, k, v, g_deep, beta)
    assert rel_rms(o, naive_recurrent_kda(q, k, v, g_deep, beta)[0]) < FP32_TOL
    g_deep[:, 4:8] = -20.0  # now tile 0 sums below -80
    with pytest.raises(ValueError, match="min tile sum"):
        chunk_kda(q, k, v, g_deep, beta)
    with pytest.raises(ValueError, match="min tile sum"):  # packed: the second sequence's first tile
        chunk_kda(q, k, v, g_deep.roll(10, 1), beta, cu_seqlens=cu_from([14, 26]))


def test_chunk_kda_rejects_bad_input():
    q, k, v, g, beta = make_inputs(1, 20)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=40)
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_kda(*(torch.cat([t, t]) for t in (q, k, v, g, beta)), cu_seqlens=cu_from([10, 10]))
    with pytest.raises(ValueError, match="end at the packed length"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=cu_from([10, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, H, K, V), cu_seqlens=cu_from([20]))
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., 0], chunk_size=16)


# ------------------------------------------------------------------------------------------- short conv
def test_short_conv_matches_naive_across_boundaries():
    """Packed conv with per-sequence states (lengths 0, 1, 2 < W-1, and longer) == per-sequence loop.
    Tolerance: 1e-6 absolute (same sums, different order)."""
    lens, C, W = [5, 0, 1, 2, 9], 6, 4
    x = torch.randn(sum(lens), C)
    w = torch.randn(C, W)
    cu = cu_from(lens)
    for state in (None, torch.randn(len(lens), C, W - 1)):
        y, s = causal_short_conv(x, w, cu, state)
        y_ref, s_ref = naive_causal_short_conv(x, w, cu, state)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # same as nn.Conv1d with W-1 left zero padding, for one fresh sequence
    y, _ = causal_short_conv(x[:5], w, cu_from([5]))
    ref = F.conv1d(F.pad(x[:5].t(), (W - 1, 0))[None], w[:, None], groups=C)[0].t()
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ layer
def tiny_config(**kw) -> SimpleNamespace:
    """The KDA fields of OdysseyConfig (CONTRACTS.md), small enough for CPU tests."""
    cfg = dict(
        hidden_size=64,
        kda_num_heads=2,
        kda_head_dim=32,
        kda_conv_size=4,
        kda_g_min=-5.0,
        kda_chunk_size=16,
        rms_norm_eps=1e-6,
    )
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def make_layer(seed: int = 0, **kw) -> KDAttention:
    torch.manual_seed(seed)
    layer = KDAttention(tiny_config(**kw), layer_idx=0)
    with torch.no_grad():  # non-trivial conv taps, norm and gate weights
        for p in (layer.conv1d.weight, layer.o_norm.weight, layer.g_b_proj.bias, layer.A_log):
            p.add_(0.3 * torch.randn_like(p))
    return layer


def test_kda_layer_packed_equals_each_sequence_alone():
    """Packed forward == each sequence alone (output and state). Tolerance: rel-RMS < 1e-4. Also: every
    parameter receives a finite gradient."""
    layer = make_layer()
    lens = [7, 20, 1, 33]
    x = torch.randn(sum(lens), 64)
    y, st = layer(x, cu_from(lens))
    c = cu_from(lens).tolist()
    for n, L in enumerate(lens):
        y_n, st_n = layer(x[c[n] : c[n + 1]], cu_from([L]))
        assert rel_rms(y[c[n] : c[n + 1]], y_n) < 1e-4, n
        assert rel_rms(st.recurrent[n : n + 1], st_n.recurrent) < 1e-4, n
        torch.testing.assert_close(
            st.conv[n : n + 1], st_n.conv, rtol=0, atol=1e-5
        )  # projection GEMM blocking
    y.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_kda_layer_prefill_then_decode_equals_full_forward(monkeypatch):
    """Prefill (chunk path from zero state), a ragged multi-token continuation (chunk path from the cached
    recurrent + conv state), then one token per sequence (single-step path) == one full forward.
    Tolerance: rel-RMS < 1e-4."""
    layer = make_layer(1)
    full = [12, 20, 9]
    x = [torch.randn(L, 64) for L in full]
    y_full, st_full = layer(torch.cat(x), cu_from(full))
    y_full = list(y_full.split(full))

    steps = {"n": 0}
    real_step = kda_mod.fused_recurrent_kda_step

    def counting_step(*args):
        steps["n"] += 1
        return real_step(*args)

    monkeypatch.setattr(kda_mod, "fused_recurrent_kda_step", counting_step)
    pos, state, got = [0, 0, 0], None, [[] for _ in full]
    for plan in ([5, 16, 1], [3, 0, 4]) + ([1, 1, 1],) * 4:
        xs = [x[n][pos[n] : pos[n] + m] for n, m in enumerate(plan)]
        y, state = layer(torch.cat(xs), cu_from(plan), state)
        for n, y_n in enumerate(y.split(plan)):
            got[n].append(y_n)
            pos[n] += plan[n]
    assert steps["n"] == 4  # the 1-token rounds took the single-step path
    assert pos == full
    for n in range(3):
        assert rel_rms(torch.cat(got[n]), y_full[n]) < 1e-4, n
    assert rel_rms(state.recurrent, st_full.recurrent) < 1e-4
    torch.testing.assert_close(state.conv, st_full.conv, rtol=0, atol=1e-5)  # projection GEMM blocking


@torch.no_grad()
@pytest.mark.parametrize("conv_size", [4, 1])
def test_fused_decode_step_equals_torch_step(conv_size, monkeypatch):
    """Without autograd a one-token-per-sequence step runs ONE fused CPU kernel after a single matmul for the
    six input projections (model/fused_cpu.cpp `kda_decode`): outputs, recurrent and conv state equal the
    torch step (kernels off: projections, short conv, fused_recurrent_kda_step), rel-RMS < 1e-5,
    over 5 steps from a prefilled state; the kernel is really taken; the given state is left untouched; and a
    weight update (in place, as an optimizer or update_weights does) reaches the fused path at once."""
    kernels = fused_cpu.load()
    assert kernels is not None, "model/fused_cpu.cpp did not build"
    calls = {"n": 0}

    class Counting:
        def kda_decode(self, *args):
            calls["n"] += 1
            return kernels.kda_decode(*args)

    layer = make_layer(3, kda_conv_size=conv_size)
    lens = [7, 1, 13]
    _, state = layer(torch.randn(sum(lens), 64), cu_from(lens))
    cu1 = cu_from([1, 1, 1])
    st_fast, st_ref = state, state
    for step in range(5):
        if step == 3:
            layer.q_proj.weight.mul_(1.1)
        x = torch.randn(3, 64)
        before = st_fast.recurrent.clone(), st_fast.conv.clone()
        monkeypatch.setattr(fused_cpu, "load", lambda: Counting())
        y_fast, st_fast_new = layer(x, cu1, st_fast)
        assert torch.equal(st_fast.recurrent, before[0]) and torch.equal(st_fast.conv, before[1])
        monkeypatch.setattr(fused_cpu, "load", lambda: None)
        y_ref, st_ref = layer(x, cu1, st_ref)
        st_fast = st_fast_new
        assert rel_rms(y_fast, y_ref) < 1e-5
        assert rel_rms(st_fast.recurrent, st_ref.recurrent) < 1e-5
        assert rel_rms(st_fast.conv, st_ref.conv) < 1e-5
    assert calls["n"] == 5


def test_kda_layer_conv_and_state_do_not_leak_across_boundaries():
    """Changing sequence 0 (its last tokens, which the next sequence's conv window would see if it leaked)
    leaves sequence 1's outputs and state unchanged. Tolerance: 1e-6 absolute."""
    layer = make_layer(2)
    lens = [10, 6]
    x = torch.randn(sum(lens), 64)
    y, st = layer(x, cu_from(lens))
    x2 = x.clone()
    x2[:10] += torch.randn(10, 64)
    y2, st2 = layer(x2, cu_from(lens))
    assert (y2[:10] - y[:10]).abs().max() > 1e-3  # sequence 0 did change
    torch.testing.assert_close(y2[10:], y[10:], rtol=0, atol=1e-6)
    torch.testing.assert_close(st2.recurrent[1], st.recurrent[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(st2.conv[1], st.conv[1], rtol=0, atol=1e-6)


def test_kda_layer_state_helpers_and_config_errors():
    cfg = tiny_config()
    z = KDALayerState.zeros(cfg, 3)
    assert z.recurrent.shape == (3, 2, 32, 32) and z.recurrent.dtype == torch.float32
    assert z.conv.shape == (3, 3 * 2 * 32, 3)
    layer = make_layer(3)
    lens = [4, 7, 2]
    _, st = layer(torch.randn(sum(lens), 64), cu_from(lens))
    back = KDALayerState.concat([st.select([2]), st.select([0, 1])]).select([1, 2, 0])
    assert torch.equal(back.recurrent, st.recurrent) and torch.equal(back.conv, st.conv)
    assert st.nbytes() == st.recurrent.numel() * 4 + st.conv.numel() * 4
    # a zero state behaves like None
    x = torch.randn(sum(lens), 64)
    torch.testing.assert_close(layer(x, cu_from(lens), z)[0], layer(x, cu_from(lens))[0])
    with pytest.raises(ValueError, match="kda_g_min"):
        KDAttention(tiny_config(kda_g_min=-6.0))
    with pytest.raises(ValueError, match="kda_chunk_size"):
        KDAttention(tiny_config(kda_chunk_size=40))
    with pytest.raises(ValueError, match="select"):
        layer(torch.randn(5, 64), cu_from([5]), z)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        layer(torch.randn(1, 5, 64))


# ------------------------------------------------------------------------- the CPU backend: the recurrence
@pytest.mark.parametrize("packed", [True, False])
def test_recurrent_backend_forward_and_gradients_match_naive(packed):
    """model/kda_recurrent.py (the recurrence in C++, its adjoint for the backward, one block checkpoint every
    64 tokens) == naive_recurrent_kda: o and final state, and d/d(q, k, v, g, beta, initial_state) of a random
    loss on both, rel-RMS < 1e-5 (fp32: the same operations in another order). Packed sequences of 150 (three
    checkpoint blocks), 0, 5 and 64 tokens; or a batch of 2 rows."""
    lens = [150, 0, 5, 64] if packed else [70]
    B = 1 if packed else 2
    T = sum(lens)
    N = len(lens) if packed else B
    base = list(make_inputs(B, T, seed=11)) + [torch.randn(N, H, K, V)]
    gen = torch.Generator().manual_seed(12)
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)
    cu = cu_from(lens) if packed else None

    def run(fn):
        xs = [t.clone().requires_grad_() for t in base]
        o, S = fn(*xs)
        ((o * do).sum() + (S * dS).sum()).backward()
        return [o.detach(), S.detach()] + [x.grad for x in xs]

    def naive(q, k, v, g, beta, S0):
        if not packed:
            return naive_recurrent_kda(q, k, v, g, beta, S0)
        c = cu.tolist()
        outs = [naive_recurrent_kda(*(t[:, c[n]:c[n + 1]] for t in (q, k, v, g, beta)), S0[n:n + 1])
                for n in range(N)]
        return torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs])

    got = run(lambda *xs: kda_recurrent.recurrent_kda(*xs[:5], xs[5], cu))
    ref = run(naive)
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"], got, ref):
        assert rel_rms(a, b) < 1e-5, name
    with torch.no_grad():  # without autograd: no checkpoints, same result
        o_ng, S_ng = kda_recurrent.recurrent_kda(*base[:5], base[5], cu)
    assert torch.equal(o_ng, got[0]) and torch.equal(S_ng, got[1])


def test_layer_uses_the_recurrent_backend_on_cpu_and_equals_the_chunk_backend(monkeypatch):
    """KDAttention on fp32 CPU runs the C++ recurrence (kda_sequence); with ODYSSEY_KDA_CPU_BACKEND=chunk it
    runs chunk_kda. Outputs, final states and all parameter gradients agree, rel-RMS < 1e-4."""
    layer = make_layer(5)
    lens = [40, 70, 3]
    x = torch.randn(sum(lens), 64)
    calls = []
    real = kda_recurrent.recurrent_kda
    monkeypatch.setattr(kda_recurrent, "recurrent_kda", lambda *a: calls.append(1) or real(*a))
    results = []
    for backend in ("recurrent", "chunk"):
        monkeypatch.setenv("ODYSSEY_KDA_CPU_BACKEND", backend)
        layer.zero_grad()
        y, st = layer(x, cu_from(lens))
        (y * torch.cos(torch.arange(y.numel()).view_as(y).float())).sum().backward()
        results.append([y.detach(), st.recurrent] + [p.grad.clone() for p in layer.parameters()])
    assert calls == [1]
    for a, b in zip(*results):
        assert rel_rms(a, b) < 1e-4


@pytest.mark.parametrize("with_state", [False, True])
def test_fused_short_conv_silu_equals_torch_path(with_state, monkeypatch):
    """causal_short_conv_silu on fp32 CPU (one fused kernel forward, one backward: model/fused_cpu.cpp) ==
    F.silu(causal_short_conv(...)) (the torch path, kernels off): output, new state, and the gradients of x
    and the taps through both (a random loss on y and on the new state); packed lengths 0, 1, 2 (< W-1,
    the state shows through), 9 and 30; rel-RMS < 1e-5."""
    lens = [9, 0, 1, 30, 2]
    T, C, W = sum(lens), 24, 4
    gen = torch.Generator().manual_seed(21)
    x0, w0 = torch.randn(T, C, generator=gen), torch.randn(C, W, generator=gen)
    state = torch.randn(len(lens), C, W - 1, generator=gen) if with_state else None
    dy, dst = torch.randn(T, C, generator=gen), torch.randn(len(lens), C, W - 1, generator=gen)
    cu = cu_from(lens)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y, st = causal_short_conv_silu(x, w, cu, state)
        ((y * dy).sum() + (st * dst).sum()).backward()
        return [y.detach(), st.detach(), x.grad, w.grad]

    fused = run()
    monkeypatch.setattr(fused_cpu, "load", lambda: None)
    ref = run()
    for name, a, b in zip(["y", "state", "dx", "dw"], fused, ref):
        assert rel_rms(a, b) < 1e-5, name


@pytest.mark.parametrize("kv", [(16, 24), (64, 64)])
def test_recurrent_backend_other_head_sizes(kv):
    """The C++ recurrence is compiled for K = V in {32, 64, 128} and generic otherwise: a non-square head
    (16 x 24, the generic loops) and 64 x 64 (its own instance) also equal naive_recurrent_kda, forward and
    gradients, rel-RMS < 1e-5."""
    k_dim, v_dim = kv
    gen = torch.Generator().manual_seed(31)
    T, h = 90, 3
    base = [F.normalize(torch.randn(1, T, h, k_dim, generator=gen), dim=-1) * k_dim**-0.5,
            F.normalize(torch.randn(1, T, h, k_dim, generator=gen), dim=-1),
            torch.randn(1, T, h, v_dim, generator=gen),
            kda_gate(torch.randn(1, T, h, k_dim, generator=gen) * 3, torch.zeros(h)),
            torch.rand(1, T, h, generator=gen), torch.randn(1, h, k_dim, v_dim, generator=gen)]
    do = torch.randn(1, T, h, v_dim, generator=gen)

    def run(fn):
        xs = [t.clone().requires_grad_() for t in base]
        o, S = fn(*xs)
        ((o * do).sum() + S.square().sum()).backward()
        return [o.detach(), S.detach()] + [x.grad for x in xs]

    got = run(lambda *xs: kda_recurrent.recurrent_kda(*xs))
    ref = run(naive_recurrent_kda)
    for a, b in zip(got, ref):
        assert rel_rms(a, b) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("conv_size", [4, 1])
def test_fused_prefill_equals_torch_layer(conv_size, monkeypatch):
    """Without autograd on fp32 CPU the layer's prefill is one matmul, the gates' up-projections and ONE fused
    kernel (model/fused_cpu.cpp `kda_prefill`) before the output projection; outputs, recurrent and conv
    states equal the torch path (kernels off) for a fresh ragged batch (lengths 1, 2 < W-1, 30, 70) and for
    a ragged continuation from those states, rel-RMS < 1e-5; the fused call is really taken."""
    kernels = fused_cpu.load()
    calls = []

    class Counting:
        def kda_prefill(self, *a):
            calls.append(1)
            return kernels.kda_prefill(*a)

    layer = make_layer(7, kda_conv_size=conv_size)
    lens1, lens2 = [1, 2, 30, 70], [5, 0, 17, 3]
    x1, x2 = torch.randn(sum(lens1), 64), torch.randn(sum(lens2), 64)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fused_cpu, "load", (lambda: Counting()) if fused else (lambda: None))
        y1, st1 = layer(x1, cu_from(lens1))
        y2, st2 = layer(x2, cu_from(lens2), st1)
        results.append([y1, st1.recurrent, st1.conv, y2, st2.recurrent, st2.conv])
    assert calls == [1, 1]
    for a, b in zip(*results):
        assert rel_rms(a, b) < 1e-5


def test_fused_layer_training_path_equals_torch_path(monkeypatch):
    """With autograd on fp32 CPU the layer runs fused kernels forward and backward around its matmuls (short
    conv + SiLU, q/k norms + decay gate + beta, the recurrence, head norm + output gate); with the kernels off
    it runs the torch reference (chunk_kda). Packed ragged batch from a given state (no gradient through it):
    output, final states and every parameter's gradient agree, rel-RMS < 1e-4."""
    layer = make_layer(9)
    lens = [33, 2, 64, 9]
    x = torch.randn(sum(lens), 64)
    with torch.no_grad():
        _, st0 = layer(torch.randn(sum(lens), 64), cu_from(lens))
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fused_cpu, "load", lambda: None)
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y, st = layer(xi, cu_from(lens), st0)
        (y * torch.sin(torch.arange(y.numel()).view_as(y).float())).sum().backward()
        results.append([y.detach(), st.recurrent.detach(), st.conv.detach(), xi.grad]
                       + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*results):
        assert rel_rms(a, b) < 1e-4
