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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.modeling import OdysseyForCausalLM
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

    def __init__(self, policy: OdysseyForCausalLM, value: ValueHead | Critic | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.value = value

    def forward(
        self, mb: MicroBatch, replay: bool = False, return_routed: bool = False, values: bool = False
    ) -> ForwardOut:
        """One packed micro-batch -> ForwardOut. replay: feed mb.replay as replay_experts (R3)."""
        if replay and mb.replay is None:
            raise ValueError("routing replay needs the micro-batch's recorded experts (mb.replay)")
        policy = self.policy
        dev = policy.lm_head.weight.device
        ids, cu = mb.input_ids.to(dev), mb.cu_seqlens.to(dev)
        rep = mb.replay.to(dev) if replay else None  # shape and range checked per trajectory (batch.py)
        h, _, routed, aux = policy.model(ids, cu, None, rep, return_routed)
        pos = mb.scored_pos.to(dev)
        hs = h[pos]
        logp, entropy = head_logprobs(hs, mb.targets.to(dev), policy.lm_head.weight)
        v = None
        if values:
            if isinstance(self.value, ValueHead):
                v = self.value(hs)
            elif isinstance(self.value, Critic):
                v = self.value(ids, cu, pos)
            else:
                raise ValueError("values requested but the learner has no value model (advantage != gae)")
        return ForwardOut(logp=logp, entropy=entropy, values=v, routed=routed, aux=aux)


__all__ = ["ForwardOut", "TrainModule", "head_logprobs", "HEAD_CHUNK_ELEMENTS"]
