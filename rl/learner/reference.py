"""A reference learner step: single rank, one episode per forward (no packing), written top to bottom.

The oracle `Learner.step` is tested against (tests/test_learner_reference.py), as `kda_reference.py` is for
KDA and `gae_reference` for GAE. It covers the default recipe and nothing else (other settings raise):
group advantages (grpo | rloo, any `scale_rewards`), PPO-clip on one epoch of one minibatch (so pi_old = pi
and every ratio is 1), `token_mean` aggregation, truncated IS against the rollout (`tis_cap`), the
negative-advantage weight, routing replay, gradient clipping and one AdamW step.

    policy = build_policy(PolicySpec.from_config(cfg).replace(dtype="float32"), train=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
    metrics = reference_step(policy, opt, trajectories, cfg.learner)    # {"loss", "grad_norm", ...}

Per kept episode i with reward r_i in group g of n members (rewards["total"]):

    A_i = (r_i - mean_g r) / (std_g r + 1e-4)               grpo, scale "group" (rloo: r_i - mean_{j!=i} r_j)
    w_t = min(exp(log pi_old(y_t) - log mu(y_t)), tis_cap)    mu = the rollout's log-prob
    L   = (1 / N) sum_i sum_{t in i} w_t * -(r_t A_i)          r_t = pi / pi_old = 1 in value, grad of log pi
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rl.trajectory import Trajectory

STD_EPS = 1e-4


def _check_supported(lc: Any) -> None:
    unsupported = {
        "advantage": lc.advantage not in ("grpo", "rloo"),
        "policy_loss": lc.policy_loss != "ppo_clip",
        "loss_agg": lc.loss_agg != "token_mean",
        "ppo_epochs": lc.ppo_epochs != 1,
        "num_minibatches": lc.num_minibatches != 1,
        "kl_coef": lc.kl_coef != 0,
        "entropy_coef": lc.entropy_coef != 0,
        "mis_band": lc.mis_band is not None,
        "turn_credit": lc.turn_credit,
        "overlong_filter": lc.overlong_filter,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"reference_step covers the default recipe only; learner.{', learner.'.join(bad)} "
                         "differ from it: test those settings against their own oracles")


def _kept_groups(trajs: Sequence[Trajectory]) -> dict[Any, list[int]]:
    """Group key -> indices of scored episodes, for groups of >= 2 whose rewards are not all equal."""
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(trajs):
        if t.infra_error or t.reward_error or "total" not in t.rewards or not t.loss_mask[1:].any():
            continue
        key = t.metadata.get("group_id", t.metadata.get("task_id"))
        groups.setdefault(key, []).append(i)
    return {g: idx for g, idx in groups.items()
            if len(idx) >= 2 and len({trajs[i].rewards["total"] for i in idx}) > 1}


def _advantages(trajs: Sequence[Trajectory], groups: dict[Any, list[int]], lc: Any) -> dict[int, float]:
    """Episode index -> its advantage (module docstring), float64 arithmetic."""
    every = np.array([trajs[i].rewards["total"] for idx in groups.values() for i in idx], dtype=np.float64)
    out = {}
    for idx in groups.values():
        r = np.array([trajs[i].rewards["total"] for i in idx], dtype=np.float64)
        n = len(r)
        a = r - r.mean()
        if lc.advantage == "rloo":
            a = a * n / (n - 1)
        if lc.scale_rewards == "group":
            a = a / (r.std(ddof=1) + STD_EPS)
        out.update(zip(idx, a.tolist()))
    if lc.scale_rewards == "batch":
        s = every.std(ddof=1) if every.size > 1 else 0.0
        out = {i: a / (s + STD_EPS) for i, a in out.items()}
    return out


def reference_step(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, trajs: Sequence[Trajectory], lc: Any
) -> dict[str, float]:
    """One policy step on `trajs` (module docstring): lc is the run's LearnerSection. Returns {"loss",
    "grad_norm", "trained_trajectories", "tokens_scored"}; no update (loss 0) when no group is kept."""
    _check_supported(lc)
    groups = _kept_groups(trajs)
    adv = _advantages(trajs, groups, lc)
    kept = sorted(adv)
    n_tokens = sum(int(trajs[i].loss_mask[1:].sum()) for i in kept)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i in kept:
        t = trajs[i]
        ids = torch.from_numpy(t.tokens.astype(np.int64))
        inputs = ids[:-1]  # position p predicts token p + 1
        scored = torch.from_numpy(np.flatnonzero(t.loss_mask[1:]).astype(np.int64))
        targets = inputs.clone()
        targets[scored] = ids[scored + 1]
        replay = None
        if lc.routing_replay and t.routed_experts is not None:
            replay = torch.from_numpy(t.routed_experts[:-1].astype(np.int64))
        logp = policy.token_logprobs(inputs, targets, replay_experts=replay)[scored].double()
        old = logp.detach()
        rollout = torch.from_numpy(t.rollout_logprobs[scored.numpy() + 1].astype(np.float64))
        w = (old - rollout).exp()
        if lc.tis_cap is not None:
            w = w.clamp(max=lc.tis_cap)
        A = torch.full_like(logp, adv[i])
        if lc.negative_advantage_weight != 1.0:
            A = torch.where(A < 0, A * lc.negative_advantage_weight, A)
        ratio = (logp - old).exp()
        clipped = ratio.clamp(1.0 - lc.clip_eps_low, 1.0 + lc.clip_eps_high)
        per_token = -torch.min(ratio * A, clipped * A)
        loss = (w * per_token).sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    params = [p for p in policy.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)) if params else 0.0
    if params:
        optimizer.step()
    return {"loss": total, "grad_norm": norm, "trained_trajectories": float(len(kept)),
            "tokens_scored": float(n_tokens)}


__all__ = ["reference_step"]
