r"""Context parallelism: one packed token stream cut into R contiguous shards, one per rank; each rank runs
only its shard through `OdysseyModel`, layer by layer, and exchanges what crosses the shard boundaries.

    shards = plan_shards(seq_lens, R)                                    # the same plan on every rank
    h, shard, routed = context_parallel_forward(model, input_ids, cu_seqlens, replay, group)   # h: [c, D]

Every rank holds the whole micro-batch (token ids are small) and runs tokens [b_r, b_{r+1}), b_r = r L // R.
A sequence that crosses a boundary continues on the next rank, as it continues into the next window under
sequence chunking (model/sequence_chunks.py), except that the shards run at the same time, so no state can
be handed on serially. Per layer:

    KDA   conv:  every rank all-gathers the last W-1 short-conv inputs of its last piece [W-1, 3HK]; a
                 continuing first piece reads its conv state from the ranks before it (walking back while
                 the sequence continues through them), zeros before the sequence's start.
          state: recurrence (1) of docs/kda.md is affine in the state (model/kda_compose.py). Every rank
                 summarises its last piece from S = 0, (M_r, S_local_r) = shard_summary(k, v, g, beta)
                 [H, K, K], [H, K, V], all-gathers the summaries and composes them (exclusive scan):
                     S_end(j) = M_j S_end(j-1) + S_local_j   if shard j holds only the continuing sequence
                              = S_local_j                    if the sequence starts on shard j,
                     S_in(r)  = S_end(r-1);
                 then runs its pieces, the first from S_in(r). Ranks wait for [K, K + V] summaries, never
                 for each other's recurrence.
    MLA   every rank all-gathers the compressed latents c [L_r, R] of its shard; a continuing first piece
          attends over its sequence's latents on the earlier ranks, then its own (causal offset = their
          count), in blocks of `PREFIX_BLOCK` latent rows, each decompressed to K, V on the fly and merged
          by the online softmax; the backward recomputes one block at a time (model/mla.py
          `blocked_latent_attention`, oracle the naive form: tests/test_mla_blocked_prefix.py). So no rank
          ever holds the whole prefix's K, V [P, H, dk + dv] (at k3 and 1M tokens ~35 GB per MLA layer).
    AttnRes, norms, FFN / MoE (replayed experts sliced to the shard), the LM head: per token, nothing to
          exchange.

Gradients. The exchanges are all-gathers (`_GatherSum`) whose backward all-reduces (sums) the gradients
that every rank computed for each gathered piece and keeps its own. Each rank's parameter gradient is then
its shard's share; summed over ranks (the learner's DDP all-reduce) it equals the single-rank gradient. A
rank's graph depends on its shard (a first shard reads no conv tail, a last one hands on no state), so the
order in which autograd would reach the gathers differs between ranks, and a collective run out of order
deadlocks or mixes up buffers. `Exchange` chains them: each gather's input is tied to the previous gather's
output by a zero-weighted term, and the hidden states to the last one, so every rank runs every gather's
backward, last to first. `gather_shards` collects per-token results (log-probs, entropy, values) of all
shards on every rank, so the loss is computed whole and identically on every rank; its backward hands each
rank the gradient of its own shard only (no sum: every rank already holds the whole loss).

Collectives run on `group`, a process group of the R ranks of one trajectory (the learner makes one per
context-parallel group, apart from the DDP group, so the two never interleave). Exactness against one rank,
values and gradients, R3 on: tests/test_context_parallel.py. Limits: no sequence chunking inside the shard
(the exchange at layer l needs every rank's whole shard at layer l, so the forward is layer-major), no MoE
auxiliary loss (a statistic of the whole batch); docs/long_context.md.

Activation checkpointing (`checkpoint_layers`, learner.activation_checkpointing): each layer's shard step runs
under a non-reentrant `torch.utils.checkpoint` (`_checkpointed_layer_step`), a pure function of the AttnRes
sources [c, D] and the exchange chain's end (`Exchange.dep`, 0-d), so a rank holds every layer's input for
its shard and, in the backward, one layer's activations at a time. The recomputation re-runs the layer's
gathers (and, sharded, its FSDP all-gathers and MoE all_to_alls) with the same inputs, at the same point of
the backward on every rank: the layer's FFN, the same ops on every rank, is the first to need a saved
tensor, and the mixer's output tie keeps every gather's backward after it. Tested against the unchecked
forward and one rank: tests/test_context_parallel_checkpointing.py.

Under the sharded learner (rl/learner/fsdp.py: learner.sharding = fsdp, ep, fsdp+ep) two more kinds of
collective run over all W ranks, across the context-parallel groups: FSDP2's parameter all-gathers (forward,
and again in the backward when a unit's output gradient arrives) and gradient reduce-scatters (when its input
gradient is complete), and the experts' all_to_alls (three per MoE forward, two per backward). Every rank
runs every layer once per micro-batch forward, so their counts match. Each mixer's shard computation is one
forward method of its FSDP unit (`_mix`: `register_fsdp_forward_method`, as sequence chunking does), so the
unit's parameters are gathered around it and its backward is hooked like its forward's. And each mixer's
output is tied to its layer's last gather (`Exchange.tie`), so a layer's backward runs, on every rank, in one
dependency-forced order: FFN unit (all-gather, the MoE all_to_alls, reduce-scatter), then the mixer unit's
all-gather, its CP gathers last to first, its reduce-scatter, then the layer below. Without the tie a rank
whose shard never reads the gathered state (a first shard) could reach the last gather's backward (a CP
all-reduce) before the unit's all-gather, and another rank after it: a cross-group deadlock. (torch's CPU
autograd engine runs ready nodes in reverse creation order, which keeps them in order anyway; measured:
ep x CP2 without the tie also ran. The tie makes the order a dependency, not a scheduling accident.)
Tested against one unsharded rank: tests/test_sharded_context_parallel.py.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

from model.attn_res import AttnResStream
from model.kda import kda_sequence
from model.kda_compose import shard_summary
from model.mla import PREFIX_BLOCK  # tests rebind it here (a few hundred rows: several blocks)
from model.sequence_chunks import Window, plan_cuts


# ------------------------------------------------------------------------------------------------ plan
def shard_bounds(total: int, ranks: int) -> list[int]:
    """[b_0 = 0, ..., b_R = total], b_r = r * total // R: R contiguous shards of near-equal size."""
    if ranks < 1:
        raise ValueError(f"context parallelism needs >= 1 rank, got {ranks}")
    return [r * total // ranks for r in range(ranks + 1)]


def plan_shards(seq_lens: Sequence[int], ranks: int) -> list[Window]:
    """The R shards of sequences of seq_lens (packed in order) as `Window`s (start, end, pieces, carry in /
    out). Raises ValueError when a shard would be empty (fewer tokens than ranks)."""
    total = sum(int(n) for n in seq_lens)
    if total < ranks:
        raise ValueError(f"context parallelism over {ranks} ranks needs >= {ranks} tokens, got {total}")
    return plan_cuts(seq_lens, shard_bounds(total, ranks))


def sequence_start(seq_lens: Sequence[int], position: int) -> int:
    """Packed position where the sequence holding token `position` starts."""
    pos = 0
    for n in seq_lens:
        if pos <= position < pos + int(n):
            return pos
        pos += int(n)
    raise ValueError(f"position {position} is outside the packed stream of {pos} tokens")


# ----------------------------------------------------------------------------------------- collectives
class _GatherSum(torch.autograd.Function):
    """All-gather of equal-shape tensors -> [R, ...]; backward: the all-reduced (summed) gradient of this
    rank's piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _GatherOwn(torch.autograd.Function):
    """All-gather of equal-shape tensors -> [R, ...]; backward: this rank's slice of the gradient as it is
    (every rank holds the same downstream computation, so nothing to sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if x.shape[0] < rows else x


def gather_shards(x: torch.Tensor, counts: Sequence[int], group) -> list[torch.Tensor]:
    """Per-token results of every shard on every rank: x [counts[rank], ...] -> [x_0, ..., x_{R-1}] (padded
    to max(counts) for the collective). Backward (`_GatherOwn`): this rank's slice of the gradient, for a
    computation downstream that is the same on every rank (the loss)."""
    g = _GatherOwn.apply(_pad_rows(x, max(counts)), group)
    return [g[r, :n] for r, n in enumerate(counts)]


def _tie(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    """x + 0 * dep (dep: a 0-d tensor): makes x depend on `dep` for autograd, without changing its value."""
    return x + 0.0 * dep.to(x.dtype)


class Exchange:
    """The all-gathers (`_GatherSum`) of one context-parallel forward, chained: each gather's input is tied
    to the previous gather's output, and the forward's result to the last one. So every rank runs every
    gather's backward (all-reduce), and in the same order, the reverse of the forward's, whatever else its
    shard's graph looks like (module docstring). The chain's end is `dep`, the sum of the last gather's
    output (0-d): what the next tie depends on, and what a checkpointed layer takes in and hands on
    (`context_parallel_forward`, checkpoint_layers) without holding the gathered tensor itself."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        self.dep: torch.Tensor | None = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather x (same shape on every rank) -> [R, *x.shape]."""
        if self.dep is not None:
            x = _tie(x, self.dep)
        g = _GatherSum.apply(x, self.group)
        self.dep = g.sum()
        return g

    def gather_rows(self, x: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
        """All-gather row blocks x [counts[rank], ...] -> [x_0, ..., x_{R-1}]."""
        g = self.gather(_pad_rows(x, max(counts)))
        return [g[r, :n] for r, n in enumerate(counts)]

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """x, depending on the last gather (the end of the chain)."""
        return x if self.dep is None else _tie(x, self.dep)


# ------------------------------------------------------------------------------------------ the mixers
def _kda_mix(mixer, x: torch.Tensor, cu: torch.Tensor, shards: list[Window], ex: Exchange) -> torch.Tensor:
    """KDAttention on this rank's shard (module docstring, KDA): normed x [c, D] -> [c, D]."""
    rank = ex.rank
    me = shards[rank]
    W, C = mixer.conv_size, 3 * mixer.num_heads * mixer.head_dim
    mixed = mixer.project_qkv(x)  # [c, 3HK], the short conv's input
    last = me.lens[-1]
    tail = mixed[mixed.shape[0] - min(last, W - 1):]
    tails = ex.gather(_pad_rows(tail, W - 1) if W > 1 else mixed.new_zeros(0, C))  # [R, W-1, C]
    conv_state = None
    if me.carry_in and W > 1:  # the last W-1 inputs before this shard, of the continuing sequence
        rows, j = [], rank - 1
        while j >= 0 and sum(r.shape[0] for r in rows) < W - 1:
            n = min(shards[j].lens[-1], W - 1)
            rows.insert(0, tails[j, :n])
            if not (shards[j].carry_in and len(shards[j].lens) == 1):
                break
            j -= 1
        prev = torch.cat(rows)[-(W - 1):]
        conv_state = _pad_rows(prev.flip(0), W - 1).flip(0).t()[None]  # [1, C, W-1], zeros first
        if len(me.lens) > 1:
            conv_state = torch.cat([conv_state, conv_state.new_zeros(len(me.lens) - 1, C, W - 1)])
    q, k, v, g, beta, _, fused = mixer.features(x, mixed, cu, conv_state)
    n0 = x.shape[0] - last  # the last piece: rows [n0, c)
    if me.carry_out:
        M, S_local = (t[0] for t in shard_summary(k[None, n0:], v[None, n0:], g[None, n0:], beta[None, n0:],
                                                  kda_sequence))
    else:  # nothing continues on the next rank: a placeholder of the same shape for the collective
        H, K = mixer.num_heads, mixer.head_dim
        M, S_local = k.new_zeros(H, K, K, dtype=torch.float32), k.new_zeros(H, K, K, dtype=torch.float32)
    Ms = ex.gather(M)  # [R, H, K, K]
    Ss = ex.gather(S_local)  # [R, H, K, V]
    initial = None
    if me.carry_in:
        j = rank - 1  # shards j < rank that the sequence spans, nearest first
        while shards[j].carry_in and len(shards[j].lens) == 1:
            j -= 1
        S = Ss[j]
        for i in range(j + 1, rank):
            S = Ms[i] @ S + Ss[i]
        initial = torch.cat([S[None], S.new_zeros(len(me.lens) - 1, *S.shape)])
    o, _ = mixer.recurrence(q, k, v, g, beta, cu, initial)
    return ex.tie(mixer.output(x, o, fused))  # on every rank after all of this layer's gathers (docstring)


def _mla_mix(mixer, x: torch.Tensor, shards: list[Window], seq_lens: list[int], ex: Exchange) -> torch.Tensor:
    """GatedMLA on this rank's shard (module docstring, MLA): normed x [c, D] -> [c, D]."""
    rank = ex.rank
    me = shards[rank]
    T = x.shape[0]
    q, c = mixer.project_q(x), mixer.compress_kv(x)
    latents = ex.gather_rows(c, [s.end - s.start for s in shards])
    own = latents[rank]  # == c, through the gather
    if not me.carry_in:
        o = mixer.attend_fresh(q, own, list(me.lens), False)
    else:
        first = sequence_start(seq_lens, me.start)  # the continuing sequence's first token
        earlier = [latents[j][max(first - s.start, 0):] for j, s in enumerate(shards[:rank]) if s.end > first]
        n0 = me.lens[0]
        keys = torch.cat([*earlier, own[:n0]])
        o = mixer.attend_blocked(q[:n0], keys, keys.shape[0] - n0, PREFIX_BLOCK)
        if len(me.lens) > 1:
            o = torch.cat([o, mixer.attend_fresh(q[n0:], own[n0:], list(me.lens[1:]), False)])
    return ex.tie(mixer.gated_output(x, o.reshape(T, -1)))


#: the name `_mix` gives `_kda_mix` / `_mla_mix` on an FSDP-sharded mixer, registered with
#: `register_fsdp_forward_method` so that it all-gathers the unit's parameters around the shard's mix and
#: hooks its backward (parameter all-gather, gradient reduce-scatter) like the mixer's own forward
_CP_MIX = "_context_parallel_mix"


def _mix(mixer, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn(mixer, x, *args) (`_kda_mix` / `_mla_mix`): directly, or on an FSDP unit (the sharded learner,
    rl/learner/fsdp.py) as a forward method of the unit, whose parameters are gathered only around one."""
    if not isinstance(mixer, FSDPModule):
        return fn(mixer, x, *args)
    if _CP_MIX not in mixer.__dict__:
        mixer.__dict__[_CP_MIX] = types.MethodType(fn, mixer)
        register_fsdp_forward_method(mixer, _CP_MIX)
    return getattr(mixer, _CP_MIX)(x, *args)


# ------------------------------------------------------------------------------------------- the layer
def _layer_step(layer, stream: AttnResStream, rep: torch.Tensor | None, cu: torch.Tensor,
                shards: list[Window], seq_lens: list[int], ex: Exchange) -> torch.Tensor | None:
    """Decoder layer `layer` on this rank's shard: advances `stream` and `ex`; returns topk [c, k] | None."""
    x = layer.attn_res.read_attn(stream, layer.attn_norm)
    if layer.layer_type == "kda":
        a = _mix(layer.mixer, _kda_mix, x, cu, shards, ex)
    else:
        a = _mix(layer.mixer, _mla_mix, x, shards, seq_lens, ex)
    stream.add(a)
    f, topk = layer.ffn_normed(layer.attn_res.read_ffn(stream, layer.ffn_norm), rep)
    stream.add(f)
    layer.attn_res.end_layer(stream)
    return topk


def _checkpointed_layer_step(layer, stream: AttnResStream, rep: torch.Tensor | None, cu: torch.Tensor,
                             shards: list[Window], seq_lens: list[int], ex: Exchange) -> torch.Tensor | None:
    """`_layer_step` under a non-reentrant activation checkpoint, as a pure function of the AttnRes sources
    (each [c, D]) and the exchange chain's end (`Exchange.dep`, 0-d): the rank keeps only those for the
    backward, and recomputes the layer, its exchanges included, when the backward first needs one of its
    saved tensors. The recomputed gathers run the same collectives on the same inputs, so they return what
    the forward's did. Every rank reaches that point at the same place of the layer's backward: its last
    sublayer, the FFN / MoE, is per-token and runs the same ops on every rank, and each mixer's output is
    tied to its last gather, so no gather's backward can run before the FFN's (module docstring). The
    recomputation runs to the layer's last saved tensor (the FFN's), past all of its gathers, on every
    rank."""

    def run(partial, rep, dep, *blocks):
        ex.dep = dep  # the chain as it stood before this layer (the recomputation starts from the same)
        s = AttnResStream(list(blocks), partial)
        topk = _layer_step(layer, s, rep, cu, shards, seq_lens, ex)
        return s.partial if s.partial is not None else s.blocks[-1], topk, ex.dep

    out, topk, ex.dep = checkpoint(run, stream.partial, rep, ex.dep, *stream.blocks, use_reentrant=False)
    stream.set_open(out, seal=(layer.layer_idx + 1) % layer.attn_res.block_size == 0)
    return topk


# ------------------------------------------------------------------------------------------- the model
def context_parallel_forward(
    model,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    replay_experts: torch.Tensor | None,
    group,
    return_routed: bool = False,
    images=None,
    checkpoint_layers: bool | None = None,
) -> tuple[torch.Tensor, Window, torch.Tensor | None]:
    """`OdysseyModel` (model = OdysseyForCausalLM.model) on this rank's shard of the packed micro-batch
    input_ids [L] (cu_seqlens int [N+1], replay_experts [L, n_moe, k] | None: the whole batch, the same on
    every rank of `group`). Collective: every rank of `group` calls it with the same batch. images: the
    batch's `model.vision.ImagePatches` (token_index into input_ids) or None; each rank embeds the patches of
    its shard. checkpoint_layers: run each layer under a non-reentrant activation checkpoint (default:
    model.gradient_checkpointing, i.e. learner.activation_checkpointing; `_checkpointed_layer_step`).

    Returns (hidden states of the shard [c, D], the shard (Window: tokens [start, end) of the batch),
    routed experts of the shard [c, n_moe, k] | None)."""
    cfg = model.config
    if getattr(cfg, "balancing", None) == "aux_loss" and cfg.n_routed_experts > 0:
        raise ValueError("context parallelism cannot compute the MoE auxiliary balancing loss (a statistic "
                         "of "
                         "the whole batch, not of one shard); use model balancing 'quantile' (the default)")
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_lens = [int(n) for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()]
    shards = plan_shards(seq_lens, R)
    me = shards[rank]
    ids = input_ids[me.start:me.end]
    cu = torch.tensor([0, *torch.tensor(me.lens).cumsum(0).tolist()], dtype=torch.int32, device=ids.device)
    ex = Exchange(group)
    mine = images.window(me.start, me.end) if images is not None else None
    stream = AttnResStream([model.embed(ids, mine)])
    if checkpoint_layers is None:
        checkpoint_layers = bool(getattr(model, "gradient_checkpointing", False))
    step = _checkpointed_layer_step if checkpoint_layers and torch.is_grad_enabled() else _layer_step
    routed, j = [], 0
    for layer in model.layers:
        rep = None
        if layer.is_moe and replay_experts is not None:
            rep = replay_experts[me.start:me.end, j]
        j += layer.is_moe
        topk = step(layer, stream, rep, cu, shards, seq_lens, ex)
        if layer.is_moe:
            routed.append(topk)
    h = ex.tie(model.final_read.read(stream, model.norm))
    return h, me, torch.stack(routed, dim=1) if routed and return_routed else None


__all__ = ["shard_bounds", "plan_shards", "sequence_start", "gather_shards", "Exchange",
           "context_parallel_forward"]
