"""One matmul for several projections of the same input (the no-autograd decode paths).

A decode step of a small model pays per op, so projections that read the same x are done as ONE matmul with
their weights concatenated along the output dimension. `ConcatWeight` keeps that concatenation and rebuilds
it only when one of the weights changed: each weight is keyed by its storage pointer and version counter,
which every in-place update bumps (optimizer steps, `load_state_dict`, `TorchEngine.update_weights`) and
every move or reassignment changes. The result is detached: it serves forwards without autograd only; with
autograd the modules' own projections run, so gradients reach the original parameters.
"""

from __future__ import annotations

import torch


class ConcatWeight:
    """cat(weights, dim=0), cached until a weight changes. Not a module attribute the state dict sees."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference
                self._weight = torch.cat([w.detach() for w in weights])
            self._key = key
        return self._weight
