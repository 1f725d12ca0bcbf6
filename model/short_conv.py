"""Causal depthwise short convolution over packed variable-length sequences, with a decode state.

KDA (model/kda.py) runs q, k, v through a kernel-4 causal depthwise convolution before the
recurrence (DESIGN.md, "Model": ``q, k = L2Norm(SiLU(ShortConv4(Wx)))``). Per channel c, for token p
of one sequence

    y[p, c] = sum_{i=0}^{W-1} w[c, i] * x[p - (W-1) + i, c]

where positions before the first new token read the sequence's conv state: the last W-1 inputs it
saw (zeros for a fresh sequence). Packed sequences (``cu_seqlens``) never read each other's tokens.

Fast path: lay the stream out as ``[state_0, x_0, state_1, x_1, ...]`` (each segment W-1 + L_n
rows), run ONE "valid" depthwise ``conv1d`` over it, and keep only the outputs whose window lies in
its own segment. Windows that straddle two segments are computed and dropped, so nothing leaks.
Oracle: `naive_causal_short_conv`, a per-sequence, per-tap loop.

`causal_short_conv_silu` is the layer's entry point: SiLU(conv) with the same state semantics; on fp32 CPU
one fused kernel forward and one backward (model/fused_cpu.cpp `short_conv_silu`), else the two torch steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import fused_cpu


def seq_lens_from_cu(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """Validate packed-sequence offsets and return the per-sequence lengths.

    cu_seqlens: int [N+1], ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == total``.
    Empty sequences (length 0) are allowed: their state passes through unchanged.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [N+1] of sequence offsets (e.g. [0, 5, 12]); got "
            f"{type(cu_seqlens).__name__} {tuple(getattr(cu_seqlens, 'shape', ()))}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor (torch.int32), got {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or cu[-1] != total or min(lens) < 0:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at the packed length {total}; "
            f"got {cu[:8]}{'...' if len(cu) > 8 else ''} (last {cu[-1]})"
        )
    return lens


def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over packed sequences.

    Args:
        x: [T, C] packed inputs (N sequences, no padding).
        weight: [C, W] per-channel taps; ``weight[:, -1]`` multiplies the current token
            (same convention as ``nn.Conv1d(C, C, W, groups=C)`` with W-1 left padding).
        cu_seqlens: int [N+1] offsets of the sequences in x.
        conv_state: [N, C, W-1] the last W-1 inputs of each sequence, oldest first; None = zeros.

    Returns:
        y: [T, C] (no activation applied), and the new conv state [N, C, W-1] (x's dtype).
    """
    T, C = x.shape
    W = weight.shape[-1]
    lens = seq_lens_from_cu(cu_seqlens, T)
    N, P = len(lens), W - 1
    if weight.shape != (C, W):
        raise ValueError(f"weight must be [C={C}, W], got {tuple(weight.shape)}")
    if conv_state is None:
        conv_state = x.new_zeros(N, C, P)
    if conv_state.shape != (N, C, P):
        raise ValueError(
            f"conv_state must be [N={N}, C={C}, W-1={P}] (one row per sequence in cu_seqlens), "
            f"got {tuple(conv_state.shape)}"
        )
    dev = x.device
    lens_t = torch.tensor(lens, device=dev)
    bos = torch.tensor([0, *lens], device=dev).cumsum(0)[:-1]
    seq_id = torch.repeat_interleave(torch.arange(N, device=dev), lens_t)  # [T]
    # source rows: T new tokens, then N*(W-1) state rows; segment n starts at bos_n + n*(W-1)
    src = torch.cat([x, conv_state.to(x.dtype).transpose(1, 2).reshape(N * P, C)])
    seg_start = bos + torch.arange(N, device=dev) * P  # [N]
    idx = torch.empty(T + N * P, dtype=torch.long, device=dev)
    tap = torch.arange(P, device=dev)
    idx[(seg_start[:, None] + tap).flatten()] = T + torch.arange(N * P, device=dev)
    idx[torch.arange(T, device=dev) + seq_id * P + P] = torch.arange(T, device=dev)
    xe = src[idx]  # [T + N(W-1), C]
    # valid conv: out[r] = sum_i w[i] * xe[r + i]; token t of sequence n sits at r = t + n(W-1)
    ye = F.conv1d(xe.t().unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=C)[0].t()
    y = ye[torch.arange(T, device=dev) + seq_id * P]
    # new state: the last W-1 rows of each segment (state rows too when L_n < W-1)
    new_state = xe[(seg_start + lens_t)[:, None] + tap]  # [N, W-1, C]
    return y, new_state.transpose(1, 2).contiguous()


def naive_causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle for `causal_short_conv`: one sequence at a time, one tap at a time. Same shapes."""
    T, C = x.shape
    W = weight.shape[-1]
    lens = seq_lens_from_cu(cu_seqlens, T)
    cu = cu_seqlens.tolist()
    ys, states = [], []
    for n, L in enumerate(lens):
        past = x.new_zeros(W - 1, C) if conv_state is None else conv_state[n].t().to(x.dtype)
        xs = torch.cat([past, x[cu[n] : cu[n + 1]]])  # [W-1+L, C]
        y = sum(weight[:, i] * xs[i : i + L] for i in range(W))
        ys.append(y)
        states.append(xs[L:].t())
    return torch.cat(ys), torch.stack(states)


def _state_as_input(x: torch.Tensor, weight: torch.Tensor, lens: list[int], conv_state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_short_conv_silu` with a differentiable state: sequence n becomes [state_n^T; x_n] (W-1 + L_n
    rows) run from a zero state, and its first W-1 outputs are dropped. Same outputs and new state (the last
    W-1 rows of each extended sequence); the gradient reaches the state through the prepended rows."""
    W = weight.shape[-1]
    parts, keep, pos, s = [], [], 0, 0
    for n, L in enumerate(lens):
        parts += [conv_state[n].t().to(x.dtype), x[s:s + L]]
        keep.append(torch.arange(pos + W - 1, pos + W - 1 + L, device=x.device))
        pos, s = pos + W - 1 + L, s + L
    ext_lens = [L + W - 1 for L in lens]
    cu = torch.tensor([0, *torch.tensor(ext_lens).cumsum(0).tolist()], dtype=torch.int32, device=x.device)
    y, state = causal_short_conv_silu(torch.cat(parts), weight, cu, None)
    return y[torch.cat(keep)], state


class _ShortConvSilu(torch.autograd.Function):
    """silu(causal_short_conv(x, weight, cu, state)) and the new state, fused (fp32 CPU). Gradients reach x
    (through y and the new state) and weight; the state must not need one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, cu: list[int]):
        y, new_state = fused_cpu.load().short_conv_silu(x, weight, cu, state)
        ctx.save_for_backward(x, weight, state)
        ctx.cu = cu
        return y, new_state

    @staticmethod
    def backward(ctx, dy: torch.Tensor, d_state: torch.Tensor | None):
        x, weight, state = ctx.saved_tensors
        cu = ctx.cu
        dy = dy if dy is not None else torch.zeros_like(x)
        dx, dw = fused_cpu.load().short_conv_silu_backward(x, weight, cu, state, dy.contiguous())
        if d_state is not None:  # new state column j of sequence n = input row L_n - (W-1) + j, if a token
            P = d_state.shape[-1]
            n_idx, j_idx = torch.meshgrid(torch.arange(len(cu) - 1), torch.arange(P), indexing="ij")
            ends = torch.tensor(cu[1:])[:, None]
            rows = ends - P + j_idx
            from_x = rows >= torch.tensor(cu[:-1])[:, None]
            dx.index_add_(0, rows[from_x], d_state.transpose(1, 2)[from_x])
        return dx, dw, None, None


def causal_short_conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal_short_conv(x, weight, cu_seqlens, conv_state)) and the new conv state; same shapes.
    On fp32 CPU tensors one fused kernel forward and one backward; a state that needs a gradient (sequence
    chunking carries it between windows) is prepended to its sequence as W-1 input rows instead, whose
    outputs are dropped (`_state_as_input`)."""
    T, C = x.shape
    W = weight.shape[-1]
    lens = seq_lens_from_cu(cu_seqlens, T)
    N = len(lens)
    if (conv_state is not None and conv_state.requires_grad and torch.is_grad_enabled() and W > 1
            and conv_state.shape == (N, C, W - 1)):
        return _state_as_input(x, weight, lens, conv_state)
    fused = (x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu
             and (conv_state is None or (conv_state.dtype == torch.float32 and not conv_state.requires_grad))
             and fused_cpu.load() is not None)
    if not fused:
        y, new_state = causal_short_conv(x, weight, cu_seqlens, conv_state)
        return F.silu(y), new_state
    if weight.shape != (C, W):
        raise ValueError(f"weight must be [C={C}, W], got {tuple(weight.shape)}")
    if conv_state is not None and conv_state.shape != (N, C, W - 1):
        raise ValueError(
            f"conv_state must be [N={N}, C={C}, W-1={W - 1}] (one row per sequence in cu_seqlens), "
            f"got {tuple(conv_state.shape)}"
        )
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    state = conv_state.contiguous() if conv_state is not None else x.new_empty(0)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ShortConvSilu.apply(x.contiguous(), weight.contiguous(), state, cu)
    return tuple(fused_cpu.load().short_conv_silu(x.contiguous(), weight.contiguous(), cu, state))
