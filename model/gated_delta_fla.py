"""The CUDA backend of the gated delta rule (Gated DeltaNet of Qwen3-Next / Qwen3.5): fla-core's Triton
`chunk_gated_delta_rule` (flash-linear-attention 0.6) behind the contract of model/gated_delta.py.
model/hf_linear_attention.py (`stateful_gdn`) picks it for CUDA tensors when fla-core is installed (the `gpu`
extra) and `applies` holds: the learner's packed forward and TorchEngine prefills. Decode steps and short
continuations (no sequence longer than RECURRENT_MAX_LEN) keep the torch token-step form, where a 64-token
chunk would be mostly padding; CPU tensors always take the torch forms. ODYSSEY_GDN_FLA=0 turns it off.

NOT YET CHECKED ON A GPU: written from fla's source on a machine without one. What runs on CPU is tested
(tests/test_hf_gated_delta.py): the argument mapping below, by running fla's own torch reference
(`fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule`, the same semantics as its Triton kernel)
on the mapped arguments against our naive oracle. The GPU check: tests/test_hf_gated_delta.py::
test_fla_backend_on_cuda (bench/gpu_hybrid.sh).

Our contract (model/gated_delta.py, recurrence (1)) -> fla's `chunk_gated_delta_rule(q, k, v, g, beta, ...)`:

    layout   the same: q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; state [N, H, K, V] (K first,
             fla's default state_v_first=False). The layer repeats q, k to the value heads before the call,
             so fla's GVA (HV > H) is not used
    scale    q is used as given (the layer scaled it by K^-1/2)  -> scale=1.0 (fla's default None would scale
             it by K^-1/2 a second time)
    norm     q, k already L2-normed by the layer (`l2norm`)       -> use_qk_l2norm_in_kernel=False
    gate     g is the per-head log-decay -e^{A_log} softplus(a + dt_bias), beta post-sigmoid
                                                                   -> use_gate_in_kernel=False,
             use_beta_sigmoid_in_kernel=False (fla's default), allow_neg_eigval=False
    state    initial_state fp32; output_final_state=True always
    packing  cu_seqlens int64 [N+1] on the device plus the same on the CPU (cu_seqlens_cpu: no device sync
             inside fla); B = 1. Empty sequences are left out of fla's cu_seqlens and keep their initial
             state, as on the torch paths
    chunk    64 (fla accepts 16, 32, 64; the result does not depend on it)
    dtypes   fp32, bf16, fp16 as given (the layer passes fp32); fp64 (the tests' rounding-free truth) is not
             supported by the Triton kernels and stays on the torch forms (`applies`)
    output   o in q's dtype, final state fp32 (as model/gated_delta.py returns)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from model import gated_delta as gd

FLA_CHUNK_SIZE = 64
#: the dtypes fla's Triton kernels take
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_state: dict[str, Callable | None] = {}


def enabled() -> bool:
    """False when ODYSSEY_GDN_FLA=0 (then CUDA tensors take the torch forms of model/gated_delta.py)."""
    return os.environ.get("ODYSSEY_GDN_FLA", "1") != "0"


def load() -> Callable | None:
    """fla's `chunk_gated_delta_rule`, or None if fla-core cannot be imported (warned once). Imported on first
    use: fla imports Triton, which takes seconds and is only needed for CUDA tensors."""
    if "chunk" not in _state:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception as exc:  # not installed, or a broken Triton
            warnings.warn(
                f"fla-core is not importable ({type(exc).__name__}: {exc}), so the gated delta rule on CUDA "
                "uses the slower torch chunkwise path. Install it with the gpu extra: pip install "
                "'odyssey-rl[gpu]' (or set ODYSSEY_GDN_FLA=0 to silence this).",
                RuntimeWarning,
                stacklevel=3,
            )
            chunk_gated_delta_rule = None
        _state["chunk"] = chunk_gated_delta_rule
    return _state["chunk"]


def available() -> bool:
    """fla's kernel is switched on and importable."""
    return enabled() and load() is not None


def applies(q: torch.Tensor, lens: list[int]) -> bool:
    """Use fla for this call: CUDA tensor in a dtype fla takes, fla available, and some sequence longer than
    RECURRENT_MAX_LEN (else the token-step form is the cheaper exact path). lens: the N sequence lengths."""
    return (q.is_cuda and q.dtype in FLA_DTYPES and max(lens, default=0) > gd.RECURRENT_MAX_LEN
            and available())


def fla_kwargs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None) -> tuple[dict[str, Any], list[int], int]:
    """Map a call of our gated delta rule to fla's keyword arguments (the table in the module docstring).
    Checks our contract first (same errors as the torch forms). Returns (kwargs, kept, N): `kept` are our
    sequences fla sees (the non-empty ones, in order), N the number of sequences in our call."""
    lens = gd.check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    N = len(lens)
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
    kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                  cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_size=FLA_CHUNK_SIZE)
    return kwargs, kept, N


def outputs(o: torch.Tensor, final: torch.Tensor, kept: list[int], n_seqs: int,
            initial_state: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's o [B, T, H, V] and final state [len(kept), H, K, V] -> ours: o in out_dtype, final state fp32
    [N, H, K, V] (sequences fla did not see keep their initial state, zeros if None)."""
    final = final.float()
    if len(kept) == n_seqs:
        return o.to(out_dtype), final
    if initial_state is None:
        S = final.new_zeros(n_seqs, *final.shape[1:])
    else:
        S = initial_state.float().clone()
    S[torch.tensor(kept, dtype=torch.long, device=S.device)] = final
    return o.to(out_dtype), S


def chunk_gated_delta_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                          cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (1) on fla-core's Triton kernels (CUDA); same arguments, shapes and returns as
    `model.gated_delta.chunk_gated_delta`. Differentiable (fla's autograd function). Unchecked on a GPU."""
    if q.shape[1] == 0:  # nothing to run: the torch form returns the (initial) states
        return gd.chunk_gated_delta(q, k, v, g, beta, initial_state, cu_seqlens)
    chunk = load()
    if chunk is None:
        raise RuntimeError("fla-core is not importable; check model.gated_delta_fla.available() before "
                           "calling")
    kwargs, kept, N = fla_kwargs(q, k, v, g, beta, initial_state, cu_seqlens)
    o, final = chunk(**kwargs)
    return outputs(o, final, kept, N, initial_state, q.dtype)


__all__ = ["FLA_CHUNK_SIZE", "applies", "available", "chunk_gated_delta_fla", "enabled", "fla_kwargs", "load",
           "outputs"]
