"""Block Attention Residuals (DESIGN.md, "Block Attention Residual"; Kimi's *Attention Residuals*).

Instead of the residual sum h_l = x_0 + sum_{j<l} f_j, each sublayer reads a softmax mixture of
*sources* (per token t, sources v_i [T, D]):

    h = sum_i softmax_i( w^T RMSNorm(v_i) ) * v_i          w [D]: pseudo-query, zero-initialised

Softmax over the source axis, in fp32. Sources, for decoder layer l (0-based) with block size S:

    v_0          = token embedding
    b_1 .. b_m   = sealed block sums, b_n = sum of every sublayer output in layers [(n-1)S, nS)
    p            = partial sum of the current block: outputs of the sublayers of this block so far

What is added to the partial sum: every sublayer's output, i.e. the mixer (KDA/MLA) output
a_l = Mixer(RMSNorm(h_attn)) and the FFN output f_l = FFN(RMSNorm(h_ffn)), exactly once each.
Per layer (see `AttnResStream` and `OdysseyDecoderLayer`):

    h_attn = read_attn(v_0, b_1..b_m, p)    (p omitted when the block has no outputs yet)
    p     += a_l
    h_ffn  = read_ffn(v_0, b_1..b_m, p)
    p     += f_l
    if (l + 1) % S == 0: seal p as b_{m+1}; p = empty

The model's final hidden state is one more read (`final_read`) over all sources, then RMSNorm + LM head.

Properties (tests/test_attn_res.py):
- zero pseudo-queries  =>  h = mean of the sources (this is the init; after the final RMSNorm it is the
  same direction as the standard residual sum v_0 + sum of outputs, since RMSNorm is scale-invariant);
- S = 1  =>  "full AttnRes" at layer granularity: every earlier layer's output a_j + f_j is its own
  source (`full_attn_res_reference` below is the naive version of that rule);
- everything is per token, so AttnRes never mixes positions: causality in time is preserved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from model import fused_cpu


def inverse_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(v^2, -1) + eps) in fp32: v [..., D] -> [...] (RMSNorm(v) = v * inverse_rms(v) * g)."""
    v = v.float()
    return torch.rsqrt(v.pow(2).mean(-1) + eps)


class AttnResRead(nn.Module):
    """One AttnRes read: its own RMSNorm scale g [D] and zero-initialised pseudo-query w [D].

    logits_i = w^T (g * rms_normalize(v_i)) = ((g * w)^T v_i) * inverse_rms(v_i),
    h = sum_i softmax_i(logits) v_i                                               (all in fp32)

    A source's inverse RMS does not depend on the read, so `AttnResStream` computes it once per source and
    every read of the stream (`read`) reuses it.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))

    def forward(self, sources: list[torch.Tensor], inv_rms: list[torch.Tensor] | None = None) -> torch.Tensor:
        """sources: S tensors [..., D] (same shape) -> h [..., D] in the sources' dtype.

        inv_rms: the sources' `inverse_rms(v, eps)` [...] if already known (else computed here)."""
        if not sources:
            raise ValueError("AttnResRead needs at least one source (the embedding)")
        if inv_rms is None:
            inv_rms = [inverse_rms(v, self.eps) for v in sources]
        w = self.query.float() * self.norm_weight.float()  # fold the norm scale into the query
        vs = [v.float() for v in sources]
        logits = torch.stack([v @ w for v in vs], dim=-1) * torch.stack(inv_rms, dim=-1)  # [..., S] fp32
        p = torch.softmax(logits, dim=-1)
        h = vs[0] * p[..., :1]
        for i in range(1, len(vs)):
            h = torch.addcmul(h, vs[i], p[..., i:i + 1])
        return h.to(sources[0].dtype)

    def read(self, stream: AttnResStream, norm: nn.Module | None = None) -> torch.Tensor:
        """This read over the stream's sources (with their cached inverse RMS); with `norm` (an RMSNorm),
        norm(h). Without autograd on fp32 CPU tensors [T, D] the whole read, norm included, is one fused
        kernel (model/fused_cpu.cpp `attn_res_read`)."""
        sources = stream.sources()
        fp32 = [*sources, self.query, self.norm_weight] + ([norm.weight] if norm is not None else [])
        fused = sources[0].dim() == 2 and all(t.dtype == torch.float32 and t.is_cpu for t in fp32)
        if not fused or fused_cpu.load() is None:
            h = self(sources, stream.inv_rms(self.eps))
            return h if norm is None else norm(h)
        out_norm = norm.weight if norm is not None else self.query.new_empty(0)
        out_eps = norm.eps if norm is not None else 0.0
        if torch.is_grad_enabled() and any(t.requires_grad for t in fp32):  # fused forward and backward
            inv = stream.inv_rms(self.eps)  # each source's r once, differentiable
            return _FusedRead.apply(self.query, self.norm_weight, out_norm, out_eps, len(sources), *sources,
                                    *inv)
        known = stream.inv_rms(self.eps, compute=False)
        h, *new = fused_cpu.load().attn_res_read([v.contiguous() for v in sources], known, self.query,
                                                 self.norm_weight, self.eps, out_norm, out_eps, False)
        stream.set_inv_rms(self.eps, known + new)
        return h


class _FusedRead(torch.autograd.Function):
    """An AttnRes read (+ the RMSNorm after it) on fp32 CPU: one kernel forward, one backward
    (model/fused_cpu.cpp `attn_res_read`, `attn_res_read_backward`). Inputs: query, norm_weight, out_norm
    ([D] or empty), out_eps, S, then the S sources [T, D] and their inverse RMS [T] (whose gradients flow
    back through `inverse_rms`)."""

    @staticmethod
    def forward(ctx, query, norm_weight, out_norm, out_eps, n, *tensors):
        sources, inv = [t.contiguous() for t in tensors[:n]], [t.contiguous() for t in tensors[n:]]
        out, p, *h_pre = fused_cpu.load().attn_res_read(sources, inv, query, norm_weight, 0.0, out_norm,
                                                         out_eps, True)
        ctx.save_for_backward(query, norm_weight, out_norm, p, *h_pre, *sources, *inv)
        ctx.n, ctx.out_eps, ctx.normed = n, out_eps, bool(h_pre)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, norm_weight, out_norm, p, *rest = ctx.saved_tensors
        h_pre = rest.pop(0) if ctx.normed else p.new_empty(0)
        n = ctx.n
        dq, dnw, don, *grads = fused_cpu.load().attn_res_read_backward(
            rest[:n], rest[n:], query, norm_weight, out_norm, ctx.out_eps, p, h_pre, dout.contiguous())
        return (dq, dnw, don if ctx.normed else None, None, None, *grads)


@dataclass
class AttnResStream:
    """The residual state carried through the layer stack: embedding + sealed blocks, and the open block.

    blocks: [v_0 = embedding, b_1, ..., b_m], each [T, D]; partial: sum of this block's outputs, or None.
    The inverse RMS of each source is computed once, on first use, and kept with it (`inv_rms`).
    """

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None = None
    # eps -> (inverse RMS of the blocks known so far, of the partial sum or None)
    _inv: dict[float, tuple[list[torch.Tensor], torch.Tensor | None]] = field(default_factory=dict,
                                                                              repr=False)

    def inv_rms(self, eps: float, compute: bool = True) -> list[torch.Tensor]:
        """`inverse_rms(v, eps)` [T] of every source (order of `sources()`), each computed once.
        compute=False: only those already known (a prefix of the sources)."""
        blocks_r, partial_r = self._inv.get(eps, ([], None))
        blocks_r = blocks_r[: len(self.blocks)]
        if not compute:
            complete = len(blocks_r) == len(self.blocks) and partial_r is not None
            return [*blocks_r, partial_r] if complete else list(blocks_r)
        blocks_r += [inverse_rms(v, eps) for v in self.blocks[len(blocks_r):]]
        if self.partial is not None and partial_r is None:
            partial_r = inverse_rms(self.partial, eps)
        self._inv[eps] = (blocks_r, partial_r)
        return blocks_r if self.partial is None else [*blocks_r, partial_r]

    def set_inv_rms(self, eps: float, inv_rms: list[torch.Tensor]) -> None:
        """Store the inverse RMS of every source (order of `sources()`), computed elsewhere."""
        nb = len(self.blocks)
        self._inv[eps] = (list(inv_rms[:nb]), inv_rms[nb] if self.partial is not None else None)

    def sources(self) -> list[torch.Tensor]:
        """The tensors [T, D] an AttnRes read mixes: blocks, plus the partial sum when it is open."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def add(self, out: torch.Tensor) -> None:
        """Add one sublayer output to the open block."""
        self.partial = out if self.partial is None else self.partial + out
        self._inv = {eps: (blocks_r, None) for eps, (blocks_r, _) in self._inv.items()}

    def set_open(self, partial: torch.Tensor, seal: bool) -> None:
        """Make `partial` the open block (the output of a layer run on a copy of this stream, as under
        activation checkpointing) and seal it when the layer ends a block."""
        self.partial = partial
        self._inv = {eps: (blocks_r, None) for eps, (blocks_r, _) in self._inv.items()}
        if seal:
            self.seal()

    def seal(self) -> None:
        """Close the open block: it becomes a source of its own."""
        if self.partial is not None:
            for eps, (blocks_r, partial_r) in self._inv.items():
                if partial_r is not None and len(blocks_r) == len(self.blocks):  # the new block keeps its r
                    blocks_r = [*blocks_r, partial_r]
                self._inv[eps] = (blocks_r, None)
            self.blocks.append(self.partial)
            self.partial = None


class BlockAttnRes(nn.Module):
    """The two AttnRes reads of decoder layer `layer_idx` and its block boundary rule.

    `read_attn(stream)` before the mixer, `read_ffn(stream)` before the FFN (each -> h [T, D]; the caller
    adds each sublayer output with `stream.add`), `end_layer(stream)` seals the block when
    (layer_idx + 1) % block_size == 0.
    """

    def __init__(self, hidden_size: int, layer_idx: int, block_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1 layer, got {block_size}")
        self.layer_idx, self.block_size = layer_idx, block_size
        self.attn_read = AttnResRead(hidden_size, eps)
        self.ffn_read = AttnResRead(hidden_size, eps)

    def read_attn(self, stream: AttnResStream, norm: nn.Module | None = None) -> torch.Tensor:
        """h [T, D] of the mixer read; norm(h) when `norm` is given (fused on the no-autograd CPU path)."""
        return self.attn_read.read(stream, norm)

    def read_ffn(self, stream: AttnResStream, norm: nn.Module | None = None) -> torch.Tensor:
        """h [T, D] of the FFN read; norm(h) when `norm` is given."""
        return self.ffn_read.read(stream, norm)

    def end_layer(self, stream: AttnResStream) -> None:
        if (self.layer_idx + 1) % self.block_size == 0:
            stream.seal()

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, block_size={self.block_size}"


def attn_res_reference(query: torch.Tensor, norm_weight: torch.Tensor, sources: list[torch.Tensor],
                       eps: float) -> torch.Tensor:
    """Naive AttnRes read for the oracle tests: explicit fp32 RMSNorm, dot products and softmax."""
    V = torch.stack([v.double() for v in sources])  # [S, ..., D]
    K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    logits = (K * query.double()).sum(-1)  # [S, ...]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0)


def full_attn_res_reference(
    embedding: torch.Tensor,
    layers: list[tuple[AttnResRead, Callable, AttnResRead, Callable]],
    final_read: AttnResRead,
    eps: float,
) -> torch.Tensor:
    """Full AttnRes (no blocks) at layer granularity, written the slow obvious way.

    layers: per layer (attn_read, mixer_fn, ffn_read, ffn_fn), where mixer_fn/ffn_fn map the read h [T, D]
    to the sublayer output (their pre-norm included). Every layer's output a_l + f_l is its own source;
    the FFN read of layer l also sees a_l. Returns the final read over [v_0, v_1, ..., v_L].
    """
    outputs = [embedding]  # v_0, then v_j = a_j + f_j
    for attn_read, mixer_fn, ffn_read, ffn_fn in layers:
        h = attn_res_reference(attn_read.query, attn_read.norm_weight, outputs, eps).to(embedding.dtype)
        a = mixer_fn(h)
        h = attn_res_reference(ffn_read.query, ffn_read.norm_weight, [*outputs, a], eps).to(embedding.dtype)
        f = ffn_fn(h)
        outputs.append(a + f)
    return attn_res_reference(final_read.query, final_read.norm_weight, outputs, eps).to(embedding.dtype)
