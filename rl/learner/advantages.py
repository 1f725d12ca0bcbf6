"""Advantages: one value per trajectory (group baselines) or one per generated token (GAE, turn credit).

Group baselines (GRPO, RLOO). For the n >= 2 valid members of a group with rewards r_1..r_n:

    grpo:  b_i = mean_j r_j
    rloo:  b_i = mean_{j != i} r_j = r_i - n / (n - 1) * (r_i - mean_j r_j)     (leave-one-out)
    A_i = (r_i - b_i) / (s + 1e-4)   s = std of the group's rewards    (scale = "group")
                                     s = std of every valid reward     (scale = "batch")
    A_i =  r_i - b_i                                                   (scale = "none": Dr.GRPO)

std is Bessel-corrected and eps = 1e-4 is added to it: TRL's conventions (GRPOTrainer), so scale="group"
with baseline="mean" is TRL's GRPO advantage.

RAFT (reward-ranked fine-tuning, Dong et al. 2023): of each group only the successful members with the
group's highest total reward are trained (`rl.learner.selection`), and the group's weight is split over them:

    raft:  A_i = 1 / k_g    k_g = number of kept members of i's group

so every solved task weighs 1 per step, however many times its best episode was sampled. Sharing the weight
per group, not per distinct completion, matters: with one weight per distinct completion a one-off success
that took a detour (a garbled expression that happened to give the right answer) weighed as much as the
three identical clean ones together, and training on those detours lowered success on the tiny demo
(docs/training.md, "Diagnosis so far").

GAE (PPO) runs over the generated tokens of one trajectory in order, t = 0..n-1; prompt and observation
tokens are the environment's transitions, so the recursion skips them:

    delta_t = r_t + gamma V_{t+1} - V_t          (V_n = 0: the episode ends after its last generated token)
    A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l},     value target R_t = A_t + V_t

Turn-level credit: with per-turn rewards tr_0..tr_{m-1} (`Trajectory.turn_rewards`: process and sub-goal
rewards on the assistant turn that earned them), turn i's returns-to-go are

    G_i = sum_{j >= i} gamma^{j - i} tr_j

and each token of turn i gets A_outcome + G_i, where A_outcome is the group advantage of the episode's
outcome-type reward (rewards["total"] - sum(turn_rewards)), shared by every turn.

Negative-advantage weight w (`learner.negative_advantage_weight`): every token advantage below zero is
scaled, A' = A if A >= 0 else w A. w = 1 is the published loss. w < 1 shrinks the push-down on sampled
tokens of below-baseline episodes; w = 0 trains on above-baseline episodes only (RAFT++ / filtered
REINFORCE, Xiong et al. 2025). Measured on the tiny demo (docs/training.md, "Diagnosis so far"): it does not
fix learning there; the update's coverage of tasks matters more than the sign of the advantages.

The discounted sums use `discounted_cumsum`, chunkwise: within a chunk of C positions one [C, C] matmul with
the decay matrix, across chunks a carry. `gae_reference` is the slow, obviously correct reverse loop.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch

STD_EPS = 1e-4  # added to the std before dividing (TRL's value)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    *,
    baseline: Literal["mean", "rloo"] = "mean",
    scale: Literal["group", "batch", "none"] = "group",
) -> torch.Tensor:
    """One advantage per trajectory (formulas in the module docstring): rewards [N], group_ids (N hashable
    keys) -> float64 [N]. Every group needs >= 2 members (drop smaller groups first; `rl.learner.selection`
    does)."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if len(group_ids) != r.numel():
        raise ValueError(f"group_ids has {len(group_ids)} entries for {r.numel()} rewards; give one each")
    if baseline not in ("mean", "rloo"):
        raise ValueError(f"baseline must be 'mean' or 'rloo', got {baseline!r}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite; a trajectory without a valid reward must be excluded first")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    adv = torch.empty_like(r)
    for g, idx in members.items():
        if len(idx) < 2:
            raise ValueError(f"group {g!r} has {len(idx)} member; a baseline needs >= 2 (drop the group)")
        rg = r[idx]
        n = len(idx)
        centred = rg - rg.mean()
        a = centred * (n / (n - 1)) if baseline == "rloo" else centred
        if scale == "group":
            a = a / (rg.std() + STD_EPS)
        adv[idx] = a
    if scale == "batch":
        adv = adv / ((r.std() if r.numel() > 1 else r.new_zeros(())) + STD_EPS)
    return adv


def raft_advantages(group_ids: Sequence[Hashable]) -> torch.Tensor:
    """A_i = 1 / k_g over the kept members (module docstring): the group of each member [N] -> float64 [N]."""
    counts: dict[Hashable, int] = {}
    for g in group_ids:
        counts[g] = counts.get(g, 0) + 1
    return torch.tensor([1.0 / counts[g] for g in group_ids], dtype=torch.float64)


def weight_negative(adv: torch.Tensor, weight: float) -> torch.Tensor:
    """A' = A where A >= 0, weight * A where A < 0 (module docstring); adv any shape."""
    return adv if weight == 1.0 else torch.where(adv < 0, adv * weight, adv)


def discounted_cumsum(x: torch.Tensor, discount: float, chunk: int = 64) -> torch.Tensor:
    """y_t = sum_{l >= 0} discount^l x_{t+l} over x [n] (float64 out), chunkwise.

    Within chunk b (positions C b .. C b + C - 1): y_local = x_chunk @ M^T with M[j, l] = discount^(l - j)
    for l >= j, else 0. Across chunks, from the last to the first: y_j = y_local_j + discount^(C - j) y_0
    of the next chunk."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    x = x.to(torch.float64).reshape(-1)
    n = x.numel()
    if n == 0:
        return x.clone()
    C = min(chunk, n)
    pad = (-n) % C
    X = torch.cat([x, x.new_zeros(pad)]).view(-1, C)  # [B, C]
    j = torch.arange(C, dtype=torch.float64)
    gap = j[None, :] - j[:, None]  # [C, C]: l - j
    M = torch.where(gap >= 0, torch.tensor(discount, dtype=torch.float64).pow(gap.clamp(min=0)), 0.0)
    local = X @ M.t()  # [B, C]
    tail = torch.tensor(discount, dtype=torch.float64).pow(C - j)  # discount^(C - j)
    out = torch.empty_like(local)
    carry = x.new_zeros(())
    for b in range(local.shape[0] - 1, -1, -1):
        out[b] = local[b] + tail * carry
        carry = out[b, 0]
    return out.reshape(-1)[:n]


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one trajectory's generated tokens: rewards [n], values [n] (V_t before token t) ->
    (advantages [n], value targets [n]), float64. V after the last token is 0."""
    r = rewards.to(torch.float64).reshape(-1)
    v = values.detach().to(torch.float64).reshape(-1)
    if r.shape != v.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and values {tuple(v.shape)} must have the same length")
    v_next = torch.cat([v[1:], v.new_zeros(1)]) if v.numel() else v
    delta = r + gamma * v_next - v
    adv = discounted_cumsum(delta, gamma * lam)
    return adv, adv + v


def gae_reference(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """The slow oracle for `gae`: the textbook reverse loop in Python floats."""
    n = len(rewards)
    adv, last = [0.0] * n, 0.0
    for t in range(n - 1, -1, -1):
        v_next = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * v_next - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def turn_returns(turn_rewards: Sequence[float] | torch.Tensor, gamma: float) -> torch.Tensor:
    """G_i = sum_{j >= i} gamma^(j - i) tr_j over one trajectory's assistant turns: [m] -> float64 [m]."""
    tr = torch.as_tensor(turn_rewards, dtype=torch.float64).reshape(-1)
    if not torch.isfinite(tr).all():
        raise ValueError("turn_rewards must be finite")
    return discounted_cumsum(tr, gamma)


__all__ = ["group_advantages", "discounted_cumsum", "gae", "gae_reference", "turn_returns", "STD_EPS"]
