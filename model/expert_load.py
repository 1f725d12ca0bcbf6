"""Per-layer expert-load observability for `model.moe.LatentMoE`.

A *step* is the span between two `close_step()` calls (LatentMoE.update_bias() closes it, so one
step = one optimizer step when the trainer calls `model.update_router_biases()` after each step).
Every recorded forward (`LatentMoE.record_statistics`) adds the token counts per expert of the experts
it actually ran (the replayed ones under routing replay), in train and eval mode alike. Under
torch.distributed, `LatentMoE.update_bias` sums the step over the data-parallel ranks first.

Metrics (`ExpertLoadTracker.metrics()`), on the most recent step: the step in progress if it has
seen tokens, else the last closed step:
- ``max_mean_load``: max_j load_j / mean_j load_j (1.0 = perfectly balanced, n/k = all on k experts).
- ``load_cv``: coefficient of variation std_j(load_j) / mean_j(load_j) (population std).
- ``dead_experts``: ids of experts with zero tokens in every step of the window (the last
  `window` closed steps plus the step in progress); ``n_dead_experts`` = their count.
- ``load_entropy``: entropy of the load distribution load_j / sum(load), normalised by log n
  (1.0 = uniform load across experts, 0.0 = one expert takes everything).
- ``weight_entropy``: mean over tokens of the entropy (nats) of the token's renormalised routing
  weights p_i over its k experts (log k = equal mixing, 0 = one expert dominates the mix).
- ``tokens_per_expert``: the counts themselves (list[int], length n); ``tokens``: sum_j load_j / k.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

_BATCH = 64  # forwards recorded per counting pass


class ExpertLoadTracker:
    """Accumulates per-step expert token counts [n] and routing-weight entropy; keeps a window of steps."""

    def __init__(self, n_experts: int, k: int, window: int = 100) -> None:
        if window < 1:
            raise ValueError(f"expert-load window must be >= 1 step, got {window}")
        self.n, self.k, self.window = n_experts, k, window
        # explicit device: from_pretrained builds the model under a meta-device context, and this plain
        # tensor (not a buffer) would otherwise stay on meta
        self._counts = torch.zeros(n_experts, dtype=torch.int64, device="cpu")
        self._entropy_sum = 0.0
        self._tokens = 0
        self._last: tuple[torch.Tensor, float, int] | None = None
        self._history: deque[torch.Tensor] = deque(maxlen=window)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.steps = 0

    @torch.no_grad()
    def record(self, topk_idx: torch.Tensor, weights: torch.Tensor) -> None:
        """topk_idx [T, k] experts run per token, weights [T, k] their mixing weights. Forwards are counted
        in batches of `_BATCH` (decoding records one tiny forward per layer and token); every reader of the
        counts flushes first."""
        self._pending.append((topk_idx.detach(), weights.detach()))
        if len(self._pending) >= _BATCH:
            self._flush()

    @torch.no_grad()
    def _flush(self) -> None:
        if not self._pending:
            return
        idx = torch.cat([i.reshape(-1) for i, _ in self._pending])
        p = torch.cat([w.float().reshape(-1, self.k) for _, w in self._pending])
        self._pending = []
        self._counts += torch.bincount(idx, minlength=self.n).cpu()
        p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        self._entropy_sum += float(-(p * p.clamp(min=1e-30).log()).sum())
        self._tokens += p.shape[0]

    @torch.no_grad()
    def all_reduce(self, process_group=None) -> None:
        """Sum the step in progress over the data-parallel ranks of `process_group` (torch.distributed
        must be initialised), so every rank's metrics describe the whole step. Call once, before
        `close_step`."""
        import torch.distributed as dist

        self._flush()  # forwards still pending their count belong to this step
        stats = torch.cat([self._counts.double(), torch.tensor([self._entropy_sum, float(self._tokens)],
                                                               dtype=torch.float64)])
        backend = dist.get_backend(process_group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        stats = stats.to(dev)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
        stats = stats.cpu()
        self._counts = stats[: self.n].round().long()
        self._entropy_sum, self._tokens = float(stats[self.n]), int(round(float(stats[self.n + 1])))

    def close_step(self) -> None:
        """End the current step: it becomes the 'last step' and enters the dead-expert window."""
        self._flush()
        if self._tokens == 0:
            return
        self._last = (self._counts.clone(), self._entropy_sum, self._tokens)
        self._history.append(self._counts.clone())
        self._counts.zero_()
        self._entropy_sum, self._tokens = 0.0, 0
        self.steps += 1

    def reset(self) -> None:
        self.__init__(self.n, self.k, self.window)

    def state_dict(self) -> dict[str, Any]:
        """Everything `metrics` reads (step in progress, last step, the dead-expert window), for checkpoints:
        a resumed run reports the same dead experts as an uninterrupted one."""
        self._flush()
        return {
            "counts": self._counts.clone(), "entropy_sum": self._entropy_sum, "tokens": self._tokens,
            "last": None if self._last is None else (self._last[0].clone(), *self._last[1:]),
            "history": [h.clone() for h in self._history], "steps": self.steps,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["counts"].numel() != self.n:
            n = state["counts"].numel()
            raise ValueError(f"expert-load state has {n} experts; this layer has {self.n}")
        self._pending = []
        self._counts = state["counts"].clone()
        self._entropy_sum, self._tokens, self.steps = state["entropy_sum"], state["tokens"], state["steps"]
        self._last = None if state["last"] is None else (state["last"][0].clone(), *state["last"][1:])
        self._history = deque((h.clone() for h in state["history"]), maxlen=self.window)

    def metrics(self) -> dict[str, float | int | list[int]]:
        """Metrics of the most recent step (see module docstring); empty dict before any token."""
        self._flush()
        if self._tokens:
            counts, ent_sum, tokens = self._counts, self._entropy_sum, self._tokens
        elif self._last is not None:
            counts, ent_sum, tokens = self._last
        else:
            return {}
        window = torch.stack([*self._history, self._counts]).sum(dim=0)
        dead = torch.nonzero(window == 0).flatten().tolist()
        load = counts.double()
        mean = load.mean()
        frac = load / load.sum()
        h = float(-(frac * frac.clamp(min=1e-300).log()).sum())
        return {
            "max_mean_load": float(load.max() / mean),
            "load_cv": float(load.std(unbiased=False) / mean),
            "n_dead_experts": len(dead),
            "dead_experts": dead,
            "load_entropy": h / math.log(self.n) if self.n > 1 else 1.0,
            "weight_entropy": ent_sum / tokens,
            "tokens": tokens,
            "tokens_per_expert": counts.tolist(),
        }
