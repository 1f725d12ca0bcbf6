r"""Sequence-chunked forward: a packed token stream of any length through `OdysseyModel` in windows of C
tokens, carrying the decode state across window boundaries, as one autograd graph with bounded memory.

    windows = plan_windows(seq_lens, C)        # [start, end) of C tokens each; the pieces of sequences inside
    outs, routed = chunked_forward(model, ids, cu_seqlens, replay, C, head)   # head(h_w [c, D], w) per window

A window cuts the packed stream [L] into at most C tokens, whatever the sequence boundaries; inside it, the
pieces are packed as usual (cu_seqlens of the window). Only the sequence that crosses a window boundary
carries state into the next window (its first piece there), exactly as a decode cache row does:

    KDA:  S_w  = final recurrent state of the piece     [1, H, K, V] fp32  -> initial state of window w+1
          conv = its last conv_size-1 inputs (q|k|v)     [1, 3HK, W-1]      -> conv state of window w+1
    MLA:  c_w  = the piece's compressed latents          [c, R]
          queries of the continuing piece attend over [c_0; ...; c_w] with causal offset P = sum of earlier
          pieces (naive form: K, V decompressed from the latents), the fresh pieces over their own latents;
    AttnRes, FFN/MoE, the LM head: per token, nothing to carry.

All of it is the unchunked computation re-associated along time, so the outputs AND the gradients equal the
unchunked forward's (tests/test_sequence_chunks.py: rel <= 1e-5 in fp32 at 4K and 8K tokens, C dividing
L and not).

Autograd and memory. The windows form one graph: gradients flow back through the carried KDA states and
every earlier latent. With gradients on, each window runs under a (non-reentrant) activation checkpoint that
saves only its inputs: the window's token ids and replayed experts, the carried KDA states and conv tails,
and references to the earlier windows' latents (no copy); `head` runs inside the window, so only its small
per-token results leave it (never [L, D] hidden states or [L, V] logits). With `checkpoint_layers`, each
decoder layer is a checkpoint inside the window's recomputation as well, so the backward of one window holds
one layer's activations of C tokens (plus K, V decompressed from the prefix latents of that layer). What
grows with L, then, is the MLA latents, n_mla * L * R floats (and as much for their gradients in the
backward), and one KDA state set per window boundary, n_kda * (H K V + 3HK(W-1)) floats per window.
Cost: the window forward runs twice (three times with `checkpoint_layers`) and the backward once.

MoE balancing by auxiliary loss is a statistic of the whole batch that a window cannot see; chunking refuses
it (the default, bias balancing by quantile, only records routed-token histograms, which add up over
windows).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

from model.attn_res import AttnResStream
from model.kda import KDALayerState
from model.moe import statistics_recording


@dataclass(frozen=True)
class Window:
    """Tokens [start, end) of the packed stream. lens: its pieces (parts of sequences, in order, none empty);
    carry_in: the first piece continues a sequence of the previous window; carry_out: the last piece
    continues into the next window."""

    start: int
    end: int
    lens: tuple[int, ...]
    carry_in: bool
    carry_out: bool


def plan_cuts(seq_lens: Sequence[int], cuts: Sequence[int]) -> list[Window]:
    """Cut sequences of seq_lens (packed in order) at the increasing positions cuts = [0, ..., L] into the
    windows [cuts[i], cuts[i+1]) (none empty). Shared by sequence chunking and context parallelism
    (model/context_parallel.py)."""
    bounds, pos = [], 0
    for n in seq_lens:
        if n > 0:
            bounds.append((pos, pos + int(n)))
        pos += int(n)
    windows, i = [], 0
    for s, e in zip(cuts[:-1], cuts[1:]):
        while bounds[i][1] <= s:
            i += 1
        lens, j = [], i
        while j < len(bounds) and bounds[j][0] < e:
            lens.append(min(e, bounds[j][1]) - max(s, bounds[j][0]))
            j += 1
        windows.append(Window(s, e, tuple(lens), bounds[i][0] < s, bounds[j - 1][1] > e))
    return windows


def plan_windows(seq_lens: Sequence[int], chunk_tokens: int) -> list[Window]:
    """Cut sequences of seq_lens (packed in order) into windows of chunk_tokens tokens (the last shorter)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    total = sum(int(n) for n in seq_lens)
    return plan_cuts(seq_lens, [*range(0, total, chunk_tokens), total]) if total else []


# ------------------------------------------------------------------------------------ one layer, one window
def _mix_with_carry(layer, x: torch.Tensor, cu: torch.Tensor, lens: tuple[int, ...],
                    carry: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The mixer sublayer of `layer` on the window's normed input x [c, D] with the carried state of its
    first piece (None: no carry). Returns (a [c, D], what the window's last piece hands on:
    KDA (S [1, H, K, V], conv [1, 3HK, W-1]); MLA (latents [n_last, R],))."""
    mixer = layer.mixer
    if layer.layer_type == "kda":
        state = None
        if carry is not None:
            S, conv = carry
            if len(lens) > 1:  # the other pieces start fresh
                S = torch.cat([S, S.new_zeros(len(lens) - 1, *S.shape[1:])])
                conv = torch.cat([conv, conv.new_zeros(len(lens) - 1, *conv.shape[1:])])
            state = KDALayerState(S, conv)
        a, new = mixer(x, cu, state)
        return a, (new.recurrent[-1:], new.conv[-1:])
    if isinstance(mixer, FSDPModule):  # the MLA unit's parameters are gathered only around a forward
        if _MLA_WINDOW not in mixer.__dict__:
            mixer.__dict__[_MLA_WINDOW] = types.MethodType(_mla_window, mixer)
            register_fsdp_forward_method(mixer, _MLA_WINDOW)
        a, c_last = getattr(mixer, _MLA_WINDOW)(x, cu, lens, *(carry or ()))
    else:
        a, c_last = _mla_window(mixer, x, cu, lens, *(carry or ()))
    return a, (c_last,)


#: the name `_mix_with_carry` gives `_mla_window` on an FSDP-sharded MLA mixer, registered with
#: `register_fsdp_forward_method` so that it all-gathers the unit's parameters (and hooks its gradient
#: reduce-scatter) like the mixer's own forward
_MLA_WINDOW = "_sequence_chunk_window"


def _mla_window(mixer, x: torch.Tensor, cu: torch.Tensor, lens: tuple[int, ...], *carry: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA mixer on one window: x [c, D] -> (a [c, D], the latents of the window's last piece [n_last, R]).
    carry: the continuing first piece's latents of its earlier windows (empty: no carry)."""
    T = x.shape[0]
    q, c = mixer.project_q(x), mixer.compress_kv(x)
    if not carry:
        o = mixer.attend_fresh(q, c, list(lens), False)
    else:  # the first piece attends over the latents of its earlier windows, then its own
        n0 = lens[0]
        keys = torch.cat([*carry, c[:n0]])
        o = mixer.attend_naive(q[:n0], keys, keys.shape[0] - n0)
        if len(lens) > 1:
            o = torch.cat([o, mixer.attend_fresh(q[n0:], c[n0:], list(lens[1:]), False)])
    return mixer.gated_output(x, o.reshape(T, -1)), c[T - lens[-1]:]


def _layer_step(layer, stream: AttnResStream, cu: torch.Tensor, lens: tuple[int, ...],
                carry: tuple[torch.Tensor, ...] | None, replay: torch.Tensor | None
                ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """`OdysseyDecoderLayer.forward` with a carried mixer state: advances `stream`; returns (the mixer's
    hand-on state, topk_idx [c, k] | None)."""
    x = layer.attn_res.read_attn(stream, layer.attn_norm)
    a, hand_on = _mix_with_carry(layer, x, cu, lens, carry)
    stream.add(a)
    f, topk = layer.ffn_normed(layer.attn_res.read_ffn(stream, layer.ffn_norm), replay)
    stream.add(f)
    layer.attn_res.end_layer(stream)
    return hand_on, topk


def _checkpointed_layer_step(layer, stream: AttnResStream, cu: torch.Tensor, lens: tuple[int, ...],
                             carry: tuple[torch.Tensor, ...] | None, replay: torch.Tensor | None
                             ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """`_layer_step` as a checkpoint: saves the AttnRes sources and the carry, recomputes in the backward."""
    n_carry = 0 if carry is None else len(carry)

    def run(partial, replay, *args):
        s = AttnResStream(list(args[n_carry:]), partial)
        hand_on, topk = _layer_step(layer, s, cu, lens, tuple(args[:n_carry]) if carry is not None else None,
                                    replay)
        out = s.partial if s.partial is not None else s.blocks[-1]
        return out, topk, *hand_on

    out, topk, *hand_on = checkpoint(run, stream.partial, replay, *(carry or ()), *stream.blocks,
                                     use_reentrant=False)
    stream.set_open(out, seal=(layer.layer_idx + 1) % layer.attn_res.block_size == 0)
    return tuple(hand_on), topk


def window_forward(model, ids: torch.Tensor, window: Window, replay: torch.Tensor | None,
                   carry: list[tuple[torch.Tensor, ...]] | None, checkpoint_layers: bool = False,
                   images=None,
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], torch.Tensor | None]:
    """The backbone (`OdysseyModel`) on one window: ids [c], replay [c, n_moe, k] | None, carry: per layer
    the state the previous window handed on (None when window.carry_in is False; MLA: all earlier latents
    of the continuing sequence). Returns (hidden [c, D], per layer the hand-on state of the window's last
    piece (KDA (S, conv), MLA (latents,)), topk [c, n_moe, k] | None). images: the window's
    `model.vision.ImagePatches` (token_index relative to the window) or None."""
    cu_list = [0]
    for n in window.lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=ids.device)
    stream = AttnResStream([model.embed(ids, images)])
    grad = torch.is_grad_enabled()
    hand_on, routed, j = [], [], 0
    for l, layer in enumerate(model.layers):
        rep = None
        if layer.is_moe and replay is not None:
            rep = replay[:, j]
        j += layer.is_moe
        layer_carry = carry[l] if window.carry_in else None
        step = _checkpointed_layer_step if checkpoint_layers and grad else _layer_step
        out, topk = step(layer, stream, cu, window.lens, layer_carry, rep)
        hand_on.append(out)
        if layer.is_moe:
            routed.append(topk)
    h = model.final_read.read(stream, model.norm)
    return h, hand_on, torch.stack(routed, dim=1) if routed else None


# ------------------------------------------------------------------------------------------- all windows
def chunked_forward(
    model,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    replay_experts: torch.Tensor | None,
    chunk_tokens: int,
    head: Callable[[torch.Tensor, Window], tuple[torch.Tensor, ...]],
    checkpoint_layers: bool | None = None,
    images=None,
    min_windows: int = 0,
) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor | None, list[Window]]:
    """`OdysseyModel` (model = OdysseyForCausalLM.model) over packed input_ids [L] (cu_seqlens int [N+1],
    replay_experts [L, n_moe, k] | None) in windows of chunk_tokens tokens, with `head(h_w, window)` applied
    to each window's hidden states [c, D] inside it (module docstring). checkpoint_layers: per-layer
    checkpoints inside each window (default: model.gradient_checkpointing). images:
    `model.vision.ImagePatches` over input_ids positions (each window gets the patches of its tokens) or None.
    min_windows: run `idle_window`s after the real windows until this many ran (the sharded learner: every
    rank runs as many windows, so each sharded unit's all-gathers and reduce-scatters match across ranks).

    Returns (head's outputs per window, then (zero,) per idle window: a 0-dim fp32 0 to add to the loss so
    its backward runs; routed experts [L, n_moe, k] int64 | None; the (real) windows)."""
    cfg = model.config
    if getattr(cfg, "balancing", None) == "aux_loss" and cfg.n_routed_experts > 0:
        raise ValueError("sequence chunking cannot compute the MoE auxiliary balancing loss (a statistic of "
                         "the whole batch, not of one window); use model balancing 'quantile' (the default)")
    if checkpoint_layers is None:
        checkpoint_layers = bool(model.gradient_checkpointing)
    L = input_ids.shape[0]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    windows = plan_windows(lens, chunk_tokens) if L else []
    params = [p for p in model.parameters() if p.requires_grad]
    grad = torch.is_grad_enabled() and bool(params)
    kinds = [layer.layer_type for layer in model.layers]
    n_kda_tensors = 2

    outs: list[tuple[torch.Tensor, ...]] = []
    routed: list[torch.Tensor] = []
    carry: list[tuple[torch.Tensor, ...]] | None = None  # per layer; MLA: all earlier latents
    for w in windows:
        ids_w = input_ids[w.start:w.end]
        rep_w = replay_experts[w.start:w.end] if replay_experts is not None else None
        sizes = [len(c) for c in carry] if w.carry_in else [0] * len(kinds)

        def run(ids_w, rep_w, *flat, w=w, sizes=sizes):
            layer_carry, k = None, 0
            if w.carry_in:
                layer_carry = []
                for n in sizes:
                    layer_carry.append(tuple(flat[k:k + n]))
                    k += n
            img_w = images.window(w.start, w.end) if images is not None else None
            h, hand_on, topk = window_forward(model, ids_w, w, rep_w, layer_carry, checkpoint_layers, img_w)
            res = head(h, w)
            return len(res), *res, topk, *[t for ho in hand_on for t in ho]

        flat = [t for c in carry for t in c] if w.carry_in else []
        if grad:
            n_res, *rest = checkpoint(run, ids_w, rep_w, *flat, use_reentrant=False)
        else:
            n_res, *rest = run(ids_w, rep_w, *flat)
        outs.append(tuple(rest[:n_res]))
        topk, hand_on = rest[n_res], rest[n_res + 1:]
        if topk is not None:
            routed.append(topk)
        if w.carry_out:  # the next window's first piece continues this window's last one
            new, k = [], 0
            for l, kind in enumerate(kinds):
                if kind == "kda":
                    new.append(tuple(hand_on[k:k + n_kda_tensors]))
                    k += n_kda_tensors
                else:
                    latents = hand_on[k]
                    k += 1
                    same = w.carry_in and len(w.lens) == 1  # the window held only the continuing sequence
                    new.append((*carry[l], latents) if same else (latents,))
            carry = new
        else:
            carry = None
    for _ in range(min_windows - len(windows)):
        outs.append((idle_window(model, input_ids, replay_experts, checkpoint_layers),))
    routed_t = torch.cat(routed) if routed else None
    return outs, routed_t, windows


def idle_window(model, input_ids: torch.Tensor, replay_experts: torch.Tensor | None,
                checkpoint_layers: bool = False) -> torch.Tensor:
    """A zero-weighted one-token window (the first token of input_ids [L], or token 0 when L = 0; its replayed
    experts, if any; no carry, no images), checkpointed as a real window is when gradients are on: returns
    0 * sum(h) (fp32, 0-dim), exactly 0, whose backward runs every layer's backward once. A rank with fewer
    windows than another runs these so every sharded unit forwards and backwards as often on every rank.
    Records no MoE statistics."""
    ids = input_ids[:1] if input_ids.numel() else input_ids.new_zeros(1)
    rep = replay_experts[:1] if replay_experts is not None and input_ids.numel() else None
    window = Window(0, 1, (1,), False, False)

    def run(ids, rep):
        h, _, _ = window_forward(model, ids, window, rep, None, checkpoint_layers)
        return h.float().sum() * 0.0

    grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    with statistics_recording(model, False):
        return checkpoint(run, ids, rep, use_reentrant=False) if grad else run(ids, rep)


__all__ = ["Window", "plan_cuts", "plan_windows", "window_forward", "chunked_forward", "idle_window"]
