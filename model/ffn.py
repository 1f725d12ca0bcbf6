"""DenseFFN: the SiTU-GLU feed-forward block of the first `first_k_dense` layers (reusable elsewhere).

    y = W_down · situ_glu(W_gate x, W_up x)          x [T, D], W_gate/W_up [I, D], W_down [D, I]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import fused_cpu
from model.activations import situ_glu, situ_glu_gu
from model.config import OdysseyConfig
from model.fused_weights import ConcatWeight, small_linear


class DenseFFN(nn.Module):
    """SiTU-GLU FFN D -> I -> D without biases. `intermediate_size` defaults to config.intermediate_size."""

    def __init__(self, config: OdysseyConfig, intermediate_size: int | None = None,
                 hidden_size: int | None = None) -> None:
        super().__init__()
        d = hidden_size or config.hidden_size
        i = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self._gate_up = ConcatWeight()  # [W_gate; W_up]: one matmul without autograd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]. On fp32 CPU: one [gate | up] matmul and the fused SiTU-GLU kernel (same
        formula; with autograd the weights are concatenated per call, so their gradients stay separate)."""
        if fused_cpu.applies(x, self.gate_proj.weight) is not None and x.dim() == 2:
            return small_linear(situ_glu_gu(x @ self.gate_up_weight()), self.down_proj)
        if x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and fused_cpu.load() is not None:
            gu = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
            return self.down_proj(situ_glu_gu(gu))
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x)))

    def gate_up_weight(self) -> torch.Tensor:
        """[W_gate; W_up]^T [D, 2I], detached (no-autograd paths only)."""
        return self._gate_up(self.gate_proj.weight, self.up_proj.weight)
