"""Optimisation: AdamW over fp32 master weights, a warm-up + decay schedule, global grad-norm clipping.

    opt = build_optimizer(params, cfg.learner)                 # AdamW(lr, betas, weight_decay)
    sched = build_scheduler(opt, cfg.learner)                  # transformers.get_scheduler
    ...backward over every micro-batch...
    norm = clip_gradients(params, cfg.learner.grad_clip)       # global L2 norm before clipping
    opt.step(); sched.step()

The schedule counts optimizer steps: `learner.steps` policy steps x `ppo_epochs` x `num_minibatches`.
`learner.warmup_steps` of linear warm-up from 0 to `lr`, then `lr_schedule`: constant, linear decay to 0,
or cosine decay to 0 (transformers' constant_with_warmup / linear / cosine schedules).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def optimizer_steps_per_policy_step(lcfg) -> int:
    return lcfg.ppo_epochs * lcfg.num_minibatches


def build_optimizer(params: Iterable[torch.nn.Parameter], lcfg) -> torch.optim.AdamW:
    """AdamW with `learner.lr`, `learner.betas`, `learner.weight_decay`. DTensor parameters (expert-parallel
    experts) beside whole ones (DDP replicas) go in a param group of their own: AdamW's foreach kernels (the
    CUDA default) take one kind per list."""
    params = list(params)
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded and len(sharded) < len(params):
        params = [{"params": [p for p in params if not isinstance(p, DTensor)]}, {"params": sharded}]
    return torch.optim.AdamW(
        params, lr=lcfg.lr, betas=tuple(lcfg.betas), weight_decay=lcfg.weight_decay
    )


def build_scheduler(opt: torch.optim.Optimizer, lcfg) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up + `learner.lr_schedule` over `learner.steps x ppo_epochs x num_minibatches` optimizer steps."""
    total = lcfg.steps * optimizer_steps_per_policy_step(lcfg)
    return get_scheduler(
        SCHEDULES[lcfg.lr_schedule], opt, num_warmup_steps=lcfg.warmup_steps, num_training_steps=total
    )


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most max_norm; returns the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    sharded = [p for p in grads if isinstance(p.grad, DTensor)]
    if sharded and len(sharded) < len(grads):  # expert-parallel experts beside DDP replicas: no shared kernel
        return _clip_mixed([sharded, [p for p in grads if not isinstance(p.grad, DTensor)]], max_norm)
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    if isinstance(norm, DTensor):  # FSDP-sharded gradients (rl/learner/fsdp.py): the norm is a DTensor
        norm = norm.full_tensor()
    return float(norm)


def _clip_mixed(kinds: list[list[torch.nn.Parameter]], max_norm: float) -> float:
    """clip_grad_norm_ over DTensor and whole gradients together: the global norm from each kind's norm, then
    every gradient times min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does."""
    norms = []
    for kind in kinds:
        n = torch.nn.utils.get_total_norm([p.grad for p in kind])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    norm = float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))
    coef = min(1.0, max_norm / (norm + 1e-6))
    for kind in kinds:
        torch._foreach_mul_([p.grad for p in kind], coef)
    return norm


__all__ = [
    "SCHEDULES",
    "build_optimizer",
    "build_scheduler",
    "clip_gradients",
    "optimizer_steps_per_policy_step",
]
