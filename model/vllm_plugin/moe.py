"""LatentMoE for vLLM: `model.moe.LatentMoE`'s routing and dispatch, with no training statistics.

Routing is the trainer's, bit for bit: s = sigmoid(W_r x), T = topk(s + b, k) with the frozen balancing
bias b (e_score_correction_bias), p = rsf * s_T / sum s_T; experts are SiTU-GLU in the latent, shared
experts full width. vLLM's FusedMoE is not used on CPU: its CPU kernels (cpu_fused_moe) implement
silu / swigluoai / gelu only, and its SiTU-GLU kernel (MoEActivation.SITU) is CUDA-only. So there are no
repacked expert weights either, and an in-place weight reload needs no post-processing.

Every forward exposes the experts it used (`topk_idx` [T, k]); the model collects them for the routed
experts side channel (R3), and `capture_fn` follows vLLM's `RoutedExpertsCaptureSource` protocol so
vLLM's own capturer (model runner V2, GPU) can bind to this layer too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.moe import LatentMoE


class VllmLatentMoE(LatentMoE):
    """LatentMoE at inference: forward(x [T, D], replay=None) -> (y [T, D], topk_idx [T, k] int64)."""

    def __init__(self, config, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.layer_id = int(layer_idx or 0)  # vLLM's RoutedExpertsCaptureSource: capture buffer row
        self.capture_fn: Callable[[torch.Tensor], None] | None = None

    def _observe(self, scores: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> None:
        """No balancing statistics, aux loss or load tracking at inference (the bias is frozen)."""
        self.aux_loss = None
        if self.capture_fn is not None:
            self.capture_fn(idx)
