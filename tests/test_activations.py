"""SiTU-GLU: the formula, the output bound, and agreement with SwiGLU near 0 (model/activations.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import fused_cpu
from model.activations import situ_glu, situ_glu_gu


def test_formula_matches_design_in_float64():
    # DESIGN.md: 4*tanh(G/4)*sigmoid(G) * 25*tanh(U/25); checked elementwise in fp64 (tolerance 1e-12).
    g = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    u = torch.linspace(-300, 300, 1001, dtype=torch.float64).flip(0)
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ_glu(g, u), expected, atol=1e-12, rtol=0)
    # custom betas enter the same places
    torch.testing.assert_close(
        situ_glu(g, u, beta_gate=2.0, beta_up=3.0),
        2 * torch.tanh(g / 2) * torch.sigmoid(g) * 3 * torch.tanh(u / 3),
        atol=1e-12,
        rtol=0,
    )


def test_output_bounded_by_100_with_finite_gradients():
    g = (torch.randn(10000) * 1e4).requires_grad_()
    u = (torch.randn(10000) * 1e4).requires_grad_()
    out = situ_glu(g, u)
    assert out.abs().max() <= 100.0
    out.sum().backward()
    assert torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
    # the bound is approached: large positive gate and large |up|
    assert situ_glu(torch.tensor(1e3), torch.tensor(-1e3)).item() < -99.9


def test_close_to_swiglu_near_zero():
    # b*tanh(x/b) = x - x^3/(3 b^2) + ...: for |x| <= 0.5 the relative gap to SiLU(G)*U is < 1%,
    # and for |x| <= 0.05 it is < 1e-4.
    torch.manual_seed(0)
    for scale, tol in ((0.5, 1e-2), (0.05, 1e-4)):
        g = (torch.rand(4096, dtype=torch.float64) * 2 - 1) * scale
        u = (torch.rand(4096, dtype=torch.float64) * 2 - 1) * scale
        swiglu = F.silu(g) * u
        rel = (situ_glu(g, u) - swiglu).abs() / swiglu.abs().clamp_min(1e-300)
        assert rel.max() < tol, (scale, rel.max())


def test_fused_situ_glu_kernel_matches_the_formula():
    """The no-autograd fp32 CPU kernel (model/fused_cpu.cpp `situ_glu_gu`, its own vectorised exp/tanh) equals
    the fp64 formula over inputs from 1e-4 to 1e4 in magnitude: |error| <= 2e-6 * max(1, |out|); and
    situ_glu_gu falls back to situ_glu with autograd (gradients flow)."""
    kernels = fused_cpu.load()
    assert kernels is not None, "model/fused_cpu.cpp did not build"
    g = torch.Generator().manual_seed(0)
    mag = 10.0 ** torch.empty(4096, 2).uniform_(-4, 4, generator=g)
    gu = (mag * torch.randn(4096, 2, generator=g).sign()).reshape(64, 128)  # [gate | up], I = 64
    with torch.no_grad():
        out = situ_glu_gu(gu)
    ref = situ_glu(gu[:, :64].double(), gu[:, 64:].double())
    assert torch.all((out.double() - ref).abs() <= 2e-6 * ref.abs().clamp(min=1.0))
    torch.testing.assert_close(kernels.situ_glu_gu(gu), out, atol=0, rtol=0)


def test_fused_situ_glu_gradient_matches_the_formula():
    """With autograd the fused path runs its own backward kernel (`situ_glu_gu_backward`): d/d[gate | up]
    equals fp64 autograd of the formula, |error| <= 2e-5 * max(1, |grad|), for inputs from 1e-3 to 1e3 in
    magnitude and a random output gradient (fp32 rounding of the inputs and factors up to 25: torch's own
    fp32 autograd of the formula is off by up to 8.5e-6 here, the kernel by 7.7e-6); the forward value equals
    the no-autograd kernel exactly."""
    g = torch.Generator().manual_seed(1)
    mag = 10.0 ** torch.empty(64, 256).uniform_(-3, 3, generator=g)
    gu = (mag * torch.randn(64, 256, generator=g).sign()).requires_grad_()
    dout = torch.randn(64, 128, generator=g)
    out = situ_glu_gu(gu)
    (out * dout).sum().backward()
    ref_in = gu.detach().double().requires_grad_()
    (situ_glu(ref_in[:, :128], ref_in[:, 128:]) * dout.double()).sum().backward()
    assert torch.all((gu.grad.double() - ref_in.grad).abs() <= 2e-5 * ref_in.grad.abs().clamp(min=1.0))
    with torch.no_grad():
        assert torch.equal(situ_glu_gu(gu), out.detach())
