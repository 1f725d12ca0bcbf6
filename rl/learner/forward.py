"""The learner's forward on one packed micro-batch: log-probs, entropy and values of the scored tokens.

    h = trunk(input_ids [L], cu_seqlens, replay_experts)           [L, D]   (one forward, packed, no padding)
    for each chunk of scored positions p (c rows):                          (under checkpointing with grad)
        z = W_lm h[p]                                              [c, V]   fp32
        logp = z[target] - logsumexp(z);  H = logsumexp(z) - sum softmax(z) z
    V = value_head(h[p]) | critic(input_ids, cu_seqlens)[p]        [M]

Only the M scored positions reach the LM head, and at most one [c, V] block of logits exists at a time, in
the forward and in the backward (c = HEAD_CHUNK_ELEMENTS / V rows), so [L, V] never materialises.

`TrainModule` is the nn.Module DistributedDataParallel wraps: the policy plus its value model, one
`forward(micro_batch)` per micro-batch.

Sequence chunking (`sequence_chunk_tokens` > 0, learner.sequence_chunk_tokens): a micro-batch longer than
that runs through `model.sequence_chunks.chunked_forward`, in windows of that many tokens carrying the KDA
state and MLA latents, with the LM head (and value head) inside each window's checkpoint; same outputs and
gradients, memory bounded (docs/long_context.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.modeling import OdysseyForCausalLM
from model.sequence_chunks import chunked_forward
from rl.learner.packing import MicroBatch
from rl.learner.value import Critic, ValueHead

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
    """The trained parameters: `policy` (OdysseyForCausalLM) and `value` (ValueHead | Critic | None)."""

    def __init__(self, policy: OdysseyForCausalLM, value: ValueHead | Critic | None = None,
                 sequence_chunk_tokens: int = 0) -> None:
        super().__init__()
        self.policy = policy
        self.value = value
        self.sequence_chunk_tokens = sequence_chunk_tokens
        if sequence_chunk_tokens and isinstance(value, Critic):
            raise ValueError("learner.sequence_chunk_tokens does not chunk a separate critic's trunk; use "
                             "learner.value_model=head with sequence chunking, or sequence_chunk_tokens=0")
        mc = policy.config
        if sequence_chunk_tokens and mc.balancing == "aux_loss" and mc.n_routed_experts:
            raise ValueError("learner.sequence_chunk_tokens cannot compute the MoE auxiliary balancing loss "
                             "(a statistic of the whole micro-batch, not of one window); use model balancing "
                             "'quantile' (the default) or sequence_chunk_tokens=0")

    def chunks(self, mb: MicroBatch) -> int:
        """Windows the forward of `mb` runs in: 1 unless sequence chunking applies."""
        C = self.sequence_chunk_tokens
        return -(-mb.n_tokens // C) if C and mb.n_tokens > C else 1

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
        if self.chunks(mb) > 1:
            return self._chunked(ids, cu, rep, pos, mb.targets.to(dev), return_routed, values)
        h, _, routed, aux = policy.model(ids, cu, None, rep, return_routed)
        hs = h[pos]
        logp, entropy = head_logprobs(hs, mb.targets.to(dev), policy.lm_head.weight)
        v = None
        if values:
            v = self.value(hs) if isinstance(self.value, ValueHead) else self.value(ids, cu, pos)
        return ForwardOut(logp=logp, entropy=entropy, values=v, routed=routed, aux=aux)

    def _chunked(self, ids: torch.Tensor, cu: torch.Tensor, rep: torch.Tensor | None, pos: torch.Tensor,
                 targets: torch.Tensor, return_routed: bool, values: bool) -> ForwardOut:
        """`forward` in windows of sequence_chunk_tokens (model/sequence_chunks.py): each window's scored
        positions go through the LM head (and value head) inside the window."""
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

        outs, routed, _ = chunked_forward(policy.model, ids, cu, rep, self.sequence_chunk_tokens, head)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        logp, entropy = (torch.cat([o[k] for o in outs])[inverse] for k in (0, 1))
        v = torch.cat([o[2] for o in outs])[inverse] if values else None
        return ForwardOut(logp=logp, entropy=entropy, values=v, routed=routed if return_routed else None,
                          aux=None)


__all__ = ["ForwardOut", "TrainModule", "head_logprobs", "HEAD_CHUNK_ELEMENTS"]
