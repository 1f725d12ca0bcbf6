"""The learner's forward on one packed micro-batch: log-probs, entropy and values of the scored tokens.

    h = trunk(input_ids [L], cu_seqlens, replay_experts)           [L, D]   (one forward, packed, no padding)
    for each chunk of scored positions p (c rows):                          (under checkpointing with grad)
        z = W_lm h[p]                                              [c, V]   fp32
        logp = z[target] - logsumexp(z);  H = logsumexp(z) - sum softmax(z) z
    V = value_head(h[p]) | critic(input_ids, cu_seqlens)[p]        [M]      (an HF critic: the policy's
                                                                             packing, shared prefixes too)

Only the M scored positions reach the LM head, and at most one [c, V] block of logits exists at a time, in
the forward and in the backward (c = HEAD_CHUNK_ELEMENTS / V rows), so [L, V] never materialises.

`TrainModule` is the nn.Module DistributedDataParallel wraps: the policy plus its value model, one
`forward(micro_batch)` per micro-batch.

Sequence chunking (`sequence_chunk_tokens` > 0, learner.sequence_chunk_tokens): a micro-batch longer than
that runs through `model.sequence_chunks.chunked_forward`, in windows of that many tokens carrying the KDA
state and MLA latents, with the LM head (and value head) inside each window's checkpoint; same outputs and
gradients, memory bounded (docs/long_context.md). Under a sharded learner (`sync_windows`) every rank runs
as many windows per forward, the most any rank's micro-batch needs, padding with zero-weighted idle windows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.context_parallel import context_parallel_forward, gather_shards, shard_bounds
from model.hf_policy import HFPolicy
from model.modeling import OdysseyForCausalLM
from model.sequence_chunks import chunked_forward
from model.vision import ImagePatches
from rl.learner.packing import MicroBatch
from rl.learner.value import Critic, HFCritic, ValueHead

HEAD_CHUNK_ELEMENTS = 1 << 24  # logits per LM-head chunk (64 MiB in fp32)


@dataclass
class ForwardOut:
    """Per scored token [M]: logp (fp32), entropy (fp32), values (fp32 or None); routed int64
    [L, n_moe, k] (None unless asked); aux: the MoE aux balancing loss (None unless balancing='aux_loss')."""

    logp: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None
    routed: torch.Tensor | None
    aux: torch.Tensor | None


def _head_chunk(
    h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(W h)[target] and the entropy of softmax(W h), fp32: h [c, D], targets [c] -> [c], [c]."""
    z = F.linear(h, weight).float()
    lse = z.logsumexp(-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1)
    return logp, entropy


def head_logprobs(
    h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked `_head_chunk` over h [M, D] (module docstring) -> logp [M], entropy [M]."""
    rows = max(16, HEAD_CHUNK_ELEMENTS // weight.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    out = []
    for hc, tc in zip(h.split(rows), targets.split(rows)):
        out.append(
            checkpoint(_head_chunk, hc, tc, weight, use_reentrant=False)
            if grad
            else _head_chunk(hc, tc, weight)
        )
    if not out:
        z = h.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


class TrainModule(nn.Module):
    """The trained parameters: `policy` (OdysseyForCausalLM, or any HF causal LM as an HFPolicy) and `value`
    (ValueHead | Critic | None; an HF policy's critic is an HFCritic, rl/learner/value.py)."""

    def __init__(self, policy: OdysseyForCausalLM | HFPolicy, value: ValueHead | Critic | None = None,
                 sequence_chunk_tokens: int = 0, context_parallel_group=None) -> None:
        super().__init__()
        self.policy = policy
        self.value = value
        self.sequence_chunk_tokens = sequence_chunk_tokens
        self.context_parallel_group = context_parallel_group  # a torch.distributed group of > 1 ranks | None
        # the sharded learner sets it (rl/learner/fsdp.py): every forward then runs as many sequence windows
        # as the longest micro-batch of any rank (zero-weighted idle windows), a MAX all-reduce per forward
        self.sync_windows = False
        if context_parallel_group is not None and isinstance(value, Critic):
            raise ValueError("learner.context_parallel does not split a separate critic's trunk; use "
                             "learner.value_model=head, or context_parallel=1")
        if sequence_chunk_tokens and isinstance(value, Critic):
            raise ValueError("learner.sequence_chunk_tokens does not chunk a separate critic's trunk; use "
                             "learner.value_model=head with sequence chunking, or sequence_chunk_tokens=0")
        if isinstance(policy, HFPolicy) and (sequence_chunk_tokens or context_parallel_group is not None):
            raise ValueError("learner.sequence_chunk_tokens and learner.context_parallel need Odyssey's "
                             "model; with an HF model (model.hf_path) set sequence_chunk_tokens=0 and "
                             "context_parallel=1")
        if isinstance(value, Critic) and isinstance(policy, HFPolicy) != isinstance(value, HFCritic):
            raise ValueError(
                f"a {type(policy).__name__} policy cannot train with a {type(value).__name__}: an HF policy "
                "(model.hf_path) needs an HFCritic (a copy of it: no learner.critic_preset), an Odyssey "
                "policy a Critic of an Odyssey trunk; build it with rl.learner.value.build_value_model")
        mc = policy.config
        if sequence_chunk_tokens and mc.balancing == "aux_loss" and mc.n_routed_experts:
            raise ValueError("learner.sequence_chunk_tokens cannot compute the MoE auxiliary balancing loss "
                             "(a statistic of the whole micro-batch, not of one window); use model balancing "
                             "'quantile' (the default) or sequence_chunk_tokens=0")

    def chunks(self, mb: MicroBatch) -> int:
        """Windows the forward of `mb` runs in: 1 unless sequence chunking applies."""
        C = self.sequence_chunk_tokens
        return -(-mb.n_tokens // C) if C and mb.n_tokens > C else 1

    def _windows_to_run(self, mb: MicroBatch, device: torch.device) -> int:
        """`chunks(mb)`, or with `sync_windows` the most over the ranks (a collective: every rank's forward
        calls it once)."""
        n = self.chunks(mb)
        if not (self.sync_windows and self.sequence_chunk_tokens):
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def forward(
        self, mb: MicroBatch, replay: bool = False, return_routed: bool = False, values: bool = False
    ) -> ForwardOut:
        """One packed micro-batch -> ForwardOut. replay: feed mb.replay as replay_experts (R3)."""
        if replay and mb.replay is None:
            raise ValueError("routing replay needs the micro-batch's recorded experts (mb.replay)")
        if values and self.value is None:
            raise ValueError("values requested but the learner has no value model (advantage != gae)")
        policy = self.policy
        dev = policy.lm_head.weight.device
        ids, cu = mb.input_ids.to(dev), mb.cu_seqlens.to(dev)
        rep = mb.replay.to(dev) if replay else None  # shape and range checked per trajectory (batch.py)
        pos = mb.scored_pos.to(dev)
        if mb.images is not None and mb.images.n:
            critic_p = (self.value.trunk.config.vision_patch_size
                        if isinstance(self.value, Critic) and not isinstance(self.value, HFCritic) else None)
            policy_p = getattr(policy.config, "vision_patch_size", 0)
            if values and critic_p is not None and critic_p != policy_p:
                raise ValueError(f"the critic's patch size ({critic_p}) is not the policy's "
                                 f"({policy_p}), so it cannot read this micro-batch's "
                                 "images; use learner.critic_preset with the policy's vision settings, no "
                                 "critic_preset (a copy of the policy), or value_model=head")
        if mb.prefix_of is not None and not isinstance(policy, HFPolicy):
            raise ValueError("a micro-batch with shared prefixes (rl/learner/prefix_sharing.py) needs a "
                             "Hugging Face policy with the packed SDPA; Odyssey's model computes every "
                             "sequence whole: set learner.share_prefixes=false")
        if self.context_parallel_group is not None:
            return self._context_parallel(ids, cu, rep, pos, mb.targets.to(dev), return_routed, values,
                                          mb.images)
        n_windows = self._windows_to_run(mb, dev)
        if n_windows > 1:
            return self._chunked(ids, cu, rep, pos, mb.targets.to(dev), return_routed, values, mb.images,
                                 n_windows)
        return self._whole(ids, cu, rep, pos, mb.targets.to(dev), return_routed, values, mb.images,
                           mb.prefix_of)

    def _chunked(self, ids: torch.Tensor, cu: torch.Tensor, rep: torch.Tensor | None, pos: torch.Tensor,
                 targets: torch.Tensor, return_routed: bool, values: bool, images: ImagePatches | None = None,
                 min_windows: int = 0) -> ForwardOut:
        """`forward` in windows of sequence_chunk_tokens (model/sequence_chunks.py): each window's scored
        positions go through the LM head (and value head) inside the window. min_windows: pad with idle
        windows to this many (`sync_windows`); their exact zeros are added to logp so their backward runs."""
        policy = self.policy
        order = torch.argsort(pos, stable=True)
        spos = pos[order]
        bounds = torch.searchsorted(spos, torch.arange(0, ids.shape[0] + self.sequence_chunk_tokens,
                                                       self.sequence_chunk_tokens, device=pos.device))

        def head(h: torch.Tensor, w) -> tuple[torch.Tensor, ...]:
            i = w.start // self.sequence_chunk_tokens
            a, b = int(bounds[i]), int(bounds[i + 1])
            hs = h[spos[a:b] - w.start]
            logp, entropy = head_logprobs(hs, targets[order[a:b]], policy.lm_head.weight)
            return (logp, entropy, self.value(hs)) if values else (logp, entropy)

        outs, routed, windows = chunked_forward(policy.model, ids, cu, rep, self.sequence_chunk_tokens, head,
                                                images=images.to(ids.device) if images is not None else None,
                                                min_windows=min_windows)
        outs, idle = outs[:len(windows)], outs[len(windows):]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        logp, entropy = (torch.cat([o[k] for o in outs])[inverse] for k in (0, 1))
        if idle:
            logp = logp + torch.stack([o[0] for o in idle]).sum()
        v = torch.cat([o[2] for o in outs])[inverse] if values else None
        return ForwardOut(logp=logp, entropy=entropy, values=v, routed=routed if return_routed else None,
                          aux=None)

    def _context_parallel(self, ids: torch.Tensor, cu: torch.Tensor, rep: torch.Tensor | None,
                          pos: torch.Tensor, targets: torch.Tensor, return_routed: bool, values: bool,
                          images: ImagePatches | None = None) -> ForwardOut:
        """`forward` on this rank's shard of the micro-batch (model/context_parallel.py); the scored positions
        of the shard go through the LM head (and value head) here, and every shard's results are gathered, so
        every rank of the group returns the whole micro-batch's ForwardOut (the loss is then computed whole
        on every rank; the backward hands each rank its shard's gradient)."""
        group = self.context_parallel_group
        policy = self.policy
        R = dist.get_world_size(group)
        if ids.shape[0] < R:  # too short to split (the idle rank's one token): every rank runs it whole and
            out = self._whole(ids, cu, rep, pos, targets, return_routed, values, images)  # 1/R of the grad
            return ForwardOut(*(None if t is None else _ScaleGrad.apply(t, 1.0 / R) if t.is_floating_point()
                                else t for t in (getattr(out, f.name) for f in dataclasses.fields(out))))
        h, shard, routed = context_parallel_forward(policy.model, ids, cu, rep, group, return_routed,
                                                    images.to(ids.device) if images is not None else None)
        bounds = torch.tensor(shard_bounds(ids.shape[0], R), device=pos.device)
        owner = torch.bucketize(pos, bounds[1:], right=True)  # shard of each scored position
        mine = (owner == dist.get_rank(group)).nonzero().squeeze(-1)
        hs = h[pos[mine] - shard.start]
        logp, entropy = head_logprobs(hs, targets[mine], policy.lm_head.weight)
        cols = [logp, entropy] + ([self.value(hs).float()] if values else [])
        counts = torch.bincount(owner, minlength=R).tolist()
        gathered = torch.cat(gather_shards(torch.stack(cols, -1), counts, group))  # [M, 2|3], shard order
        order = torch.argsort(owner, stable=True)  # the scored positions in shard order
        full = torch.empty_like(gathered).index_copy(0, order, gathered)  # back to mb order, differentiably
        routed_all = None
        if return_routed and routed is not None:
            with torch.no_grad():
                routed_all = torch.cat(gather_shards(routed, [int(b - a) for a, b in
                                                              zip(bounds[:-1], bounds[1:])], group))
        cols = [c.clone() for c in full.unbind(-1)]  # not views: FSDP hooks the outputs' backward
        return ForwardOut(logp=cols[0], entropy=cols[1], values=cols[2] if values else None,
                          routed=routed_all, aux=None)

    def _whole(self, ids: torch.Tensor, cu: torch.Tensor, rep: torch.Tensor | None, pos: torch.Tensor,
               targets: torch.Tensor, return_routed: bool, values: bool, images: ImagePatches | None = None,
               prefix_of: torch.Tensor | None = None) -> ForwardOut:
        """`forward` in one pass over the whole micro-batch (with its images, if any; prefix_of: its shared
        prefixes, an HF policy only)."""
        if isinstance(self.policy, HFPolicy):  # packed; an HF MoE replays (model/hf_routing.py)
            if images is not None:
                raise ValueError("a Hugging Face policy (model.hf_path) reads text only; these trajectories "
                                 "hold images: train them with an Odyssey preset (model.preset)")
            h, routed = self.policy.packed_hidden_routed(ids, cu, prefix_of, rep, return_routed)
            aux = None
        else:
            h, _, routed, aux = self.policy.model(ids, cu, None, rep, return_routed, images)
        hs = h[pos]
        logp, entropy = head_logprobs(hs, targets, self.policy.lm_head.weight)
        v = None
        if values and isinstance(self.value, HFCritic):  # the policy's packed layout, shared prefixes too
            v = self.value(ids, cu, pos, images, prefix_of)
        elif values and isinstance(self.value, ValueHead):
            v = self.value(hs)
        elif values:
            if prefix_of is not None:  # unreachable from the learner: it shares no prefixes then
                raise ValueError("a micro-batch with shared prefixes (learner.share_prefixes) cannot feed "
                                 "an Odyssey critic, which computes every sequence whole; collate it without "
                                 "prefix_of (learner.share_prefixes=false)")
            v = self.value(ids, cu, pos, images)
        return ForwardOut(logp=logp, entropy=entropy, values=v, routed=routed, aux=aux)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


__all__ = ["ForwardOut", "TrainModule", "head_logprobs", "HEAD_CHUNK_ELEMENTS"]
