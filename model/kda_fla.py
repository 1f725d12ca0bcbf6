"""The CUDA backend of `chunk_kda`: fla-core's Triton `chunk_kda` (flash-linear-attention 0.6) behind our
contract. `model.kda.chunk_kda` picks it for CUDA tensors when fla-core is installed (the `gpu` extra);
ODYSSEY_KDA_FLA=0 turns it off (then CUDA runs the torch chunkwise form of model/kda_chunk.py).

NOT YET CHECKED ON A GPU: written from fla's source on a machine without one. What can run on CPU is
tested (tests/test_kda_fla.py): the argument mapping below, by running fla's own torch reference
(`fla.ops.kda.naive.naive_recurrent_kda`, same signature semantics as its Triton `chunk_kda`) on the
mapped arguments against our reference, and that fla imports. fla's Triton kernels themselves do not run
under Triton's CPU interpreter. The GPU check to run: tests/test_kda_fla.py::test_fla_backend_on_cuda.

Our contract (model/kda_chunk.py) -> fla's `chunk_kda(q, k, v, g, beta, scale, initial_state, ...)`:

    layout   the same: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [N, H, K, V]
             (K first, fla's default state_v_first=False)
    scale    we use q as given (the layer already scaled it by K^-1/2)   -> scale=1.0 (fla's default
             None would scale q by K^-1/2 a second time)
    gate     g is our log-decay (kda_gate), beta post-sigmoid, q/k L2-normed  -> use_gate_in_kernel,
             use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel all False
             every g in [-5, 0] (our lower bound)  -> safe_gate=True, fla's tensor-core intra-chunk path
             (its diagonal 16-blocks stay in fp32 range for gates >= -5, the same argument as our tiles);
             a token below -5 (possible when check_decay_bound=True lets it through) -> safe_gate=False,
             fla's exact token-parallel path, which has no tile-sum limit
    state    initial_state fp32 (fla asserts it); output_final_state=True always
    packing  cu_seqlens int64 [N+1] on the device plus the same on the CPU (cu_seqlens_cpu: no device
             sync inside fla); B = 1. Empty sequences are left out of fla's cu_seqlens and keep their
             initial state, as on our other paths
    chunk    fla supports 32 or 64: always 64 (the result does not depend on the chunk size)
    output   o in v's dtype, final state fp32
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from model import kda_chunk

FLA_CHUNK_SIZE = 64
_state: dict[str, Callable | None] = {}


def enabled() -> bool:
    """False when ODYSSEY_KDA_FLA=0 (then CUDA tensors take the torch chunkwise path)."""
    return os.environ.get("ODYSSEY_KDA_FLA", "1") != "0"


def load() -> Callable | None:
    """fla's `chunk_kda`, or None if fla-core cannot be imported (warned once). Imported on first use: fla
    imports Triton, which takes seconds and is only needed for CUDA tensors."""
    if "chunk_kda" not in _state:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
        except Exception as exc:  # not installed, or a broken Triton
            warnings.warn(
                f"fla-core is not importable ({type(exc).__name__}: {exc}), so chunk_kda on CUDA uses the "
                "slower torch chunkwise path. Install it with the gpu extra: pip install 'odyssey-rl[gpu]' "
                "(or set ODYSSEY_KDA_FLA=0 to silence this).",
                RuntimeWarning,
                stacklevel=3,
            )
            fla_chunk_kda = None
        _state["chunk_kda"] = fla_chunk_kda
    return _state["chunk_kda"]


def available() -> bool:
    """fla's kernels are switched on and importable."""
    return enabled() and load() is not None


@dataclass
class FlaCall:
    """One call of fla's `chunk_kda` for one call of ours: `kwargs` to pass, then `outputs(o, final)` maps
    fla's results back to our contract."""

    kwargs: dict[str, Any]
    n_seqs: int  # N, the number of sequences in our call
    kept: list[int]  # our sequences that fla sees (the non-empty ones), in order
    initial_state: torch.Tensor | None  # ours, [N, H, K, V]
    state_shape: tuple[int, int, int, int]  # [N, H, K, V]
    out_dtype: torch.dtype

    def outputs(self, o: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's o [B, T, H, V] and final state [len(kept), H, K, V] -> ours: o in v's dtype, final
        state fp32 [N, H, K, V] (sequences fla did not see keep their initial state)."""
        final = final.float()
        if len(self.kept) == self.n_seqs:
            return o.to(self.out_dtype), final
        if self.initial_state is None:
            S = final.new_zeros(self.state_shape)
        else:
            S = self.initial_state.float().clone()
        S[torch.tensor(self.kept, dtype=torch.long, device=S.device)] = final
        return o.to(self.out_dtype), S


def fla_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    check_decay_bound: bool = True,
) -> FlaCall:
    """Map a call of our `chunk_kda` to fla's keyword arguments (the table in this module's docstring).
    Checks our contract first (same errors as the torch path); with check_decay_bound, g > 0 raises."""
    lens = kda_chunk.check_inputs(q, k, v, g, beta, initial_state, chunk_size, cu_seqlens)
    B, T, H, K = q.shape
    N, V = len(lens), v.shape[-1]
    # the layer's g is >= g_min >= -5 by construction (it passes check_decay_bound=False)
    safe_gate = True
    if check_decay_bound:
        safe_gate = not kda_chunk._tokens_outside_bound(g)  # raises for g > 0; True if some g < -5
    kept = list(range(N))
    init = None if initial_state is None else initial_state.float()
    cu, cu_cpu = None, None
    if cu_seqlens is not None:
        kept = [i for i, n in enumerate(lens) if n > 0]
        ends = torch.tensor([lens[i] for i in kept], dtype=torch.int64).cumsum(0)
        cu_cpu = torch.cat([torch.zeros(1, dtype=torch.int64), ends])
        cu = cu_cpu.to(q.device)
        if init is not None and len(kept) < N:
            init = init[torch.tensor(kept, dtype=torch.long, device=init.device)]
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=1.0,
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        safe_gate=safe_gate,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        chunk_size=FLA_CHUNK_SIZE,
    )
    return FlaCall(kwargs, N, kept, initial_state, (N, H, K, V), v.dtype)


def chunk_kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    check_decay_bound: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_kda` on fla-core's Triton kernels (CUDA); same arguments, shapes and returns as
    `model.kda_chunk.chunk_kda`. Differentiable (fla's autograd function). Unchecked on a GPU so far."""
    if q.shape[1] == 0:  # nothing to run: the torch path returns the (initial) states
        return kda_chunk.chunk_kda(q, k, v, g, beta, initial_state, chunk_size, cu_seqlens, check_decay_bound)
    fla_chunk_kda = load()
    if fla_chunk_kda is None:
        raise RuntimeError("fla-core is not importable; check model.kda_fla.available() before calling")
    call = fla_call(q, k, v, g, beta, initial_state, chunk_size, cu_seqlens, check_decay_bound)
    o, final = fla_chunk_kda(**call.kwargs)
    return call.outputs(o, final)
