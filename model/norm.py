"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 and cast back to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) in fp32 (no weight). x [..., D] -> fp32 [..., D]."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned per-channel scale w [D] (initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D] in x.dtype (the same formula as rms_normalize(x) * w, in one call)."""
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
