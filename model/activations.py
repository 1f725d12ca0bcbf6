"""SiTU-GLU, the gated activation of every FFN (DESIGN.md, "SiTU-GLU").

    situ_glu(G, U) = b_g * tanh(G / b_g) * sigmoid(G)  *  b_u * tanh(U / b_u),   b_g = 4, b_u = 25

It is SwiGLU (SiLU(G) * U) with both branches soft-capped by a scaled tanh: near 0,
b*tanh(x/b) = x + O(x^3/b^2), so the output equals SwiGLU to second order, while |out| <= b_g * b_u = 100
for any input, which bounds the activations that feed the down projection (a stability measure for very
deep/wide models).
"""

from __future__ import annotations

import torch

from model import fused_cpu


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU. gate, up [..., I] -> [..., I], |out| <= beta_gate * beta_up. Computed in the input dtype."""
    g = beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate)
    u = beta_up * torch.tanh(up / beta_up)
    return g * u


class _SituGluGu(torch.autograd.Function):
    """situ_glu_gu on fp32 CPU: one fused kernel forward, one backward (model/fused_cpu.cpp)."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        ctx.save_for_backward(gu)
        return fused_cpu.load().situ_glu_gu(gu)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        return fused_cpu.load().situ_glu_gu_backward(gu, dout.contiguous())


def situ_glu_gu(gu: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU of one projection holding [gate | up] on its last dim: [T, 2I] -> [T, I].

    On fp32 CPU tensors this is one fused kernel forward and one backward (model/fused_cpu.cpp
    `situ_glu_gu`, `situ_glu_gu_backward`: the formula above and its derivative, with the kernels' own
    vectorised exp/tanh) instead of nine elementwise ops and their fifteen gradient ops; otherwise
    `situ_glu(gate, up)`."""
    fused = gu.dim() == 2 and gu.shape[0] and gu.dtype == torch.float32 and gu.is_cpu
    if fused and fused_cpu.load() is not None:
        if torch.is_grad_enabled() and gu.requires_grad:
            return _SituGluGu.apply(gu)
        return fused_cpu.load().situ_glu_gu(gu.contiguous())
    gate, up = gu.chunk(2, dim=-1)
    return situ_glu(gate, up)
