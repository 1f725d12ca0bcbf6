"""How one policy step's samples are split: into minibatches (optimizer steps) and across data-parallel ranks.

    plans = plan_step(samples, num_minibatches=2, world_size=2, seed=7)
    plans[rank].minibatches[m]      # Sample.index values that rank trains on in minibatch m

Minibatches: a seeded permutation of the samples cut into `num_minibatches` contiguous parts of near-equal
size; every epoch (`learner.ppo_epochs`) visits the same minibatches in the same order. Ranks: within each
minibatch, samples go to ranks by token count (longest first, each to the rank with the fewest tokens so
far), so ranks do similar work. Each plan also carries the minibatch's global scored-token and episode
counts: the loss normalisers (rl/learner/losses.py), identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def split_by_tokens(lengths: Sequence[int], n_parts: int) -> list[list[int]]:
    """Greedy longest-first split of item indices into n_parts with balanced token sums (ties: lowest part,
    lowest index). Parts may be empty when there are fewer items than parts."""
    if n_parts < 1:
        raise ValueError(f"n_parts must be >= 1, got {n_parts}")
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    load = [0] * n_parts
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        p = min(range(n_parts), key=lambda r: (load[r], r))
        parts[p].append(i)
        load[p] += int(lengths[i])
    return [sorted(p) for p in parts]


@dataclass
class RankPlan:
    """One rank's share of a policy step. minibatches[m]: Sample.index values of this rank in minibatch m
    (possibly empty); n_tokens[m] / n_episodes[m]: the loss normalisers of minibatch m, its scored tokens /
    episodes over all ranks plus its share of the step's extra ones (`plan_step`)."""

    minibatches: list[list[int]]
    n_tokens: list[float]
    n_episodes: list[float]

    def sample_indices(self) -> list[int]:
        return sorted({i for mb in self.minibatches for i in mb})


def plan_step(
    samples: Sequence,
    num_minibatches: int,
    world_size: int,
    seed: int,
    extra_tokens: int = 0,
    extra_episodes: int = 0,
) -> list[RankPlan]:
    """Split samples (objects with .index, .n_tokens, .n_scored) into minibatches and ranks (module
    docstring). Returns one RankPlan per rank. Minibatches left empty (fewer samples than minibatches) are
    dropped. extra_tokens / extra_episodes (PreparedBatch's: untrained episodes the normalisers count) are
    shared out in proportion: minibatch m's N_m = T_m (1 + extra_tokens / T), E_m = S_m (1 + extra_episodes
    / S), with T_m / S_m its scored tokens / samples and T / S the step's; one minibatch: N = T + extra."""
    order = np.random.default_rng(seed).permutation(len(samples))
    parts = [p for p in np.array_split(order, max(1, num_minibatches)) if p.size]
    total_tokens = sum(s.n_scored for s in samples)
    token_scale = 1.0 + extra_tokens / total_tokens if total_tokens else 1.0
    episode_scale = 1.0 + extra_episodes / len(samples) if samples else 1.0
    plans = [RankPlan([], [], []) for _ in range(world_size)]
    for part in parts:
        mb = [samples[i] for i in part]
        split = split_by_tokens([s.n_tokens for s in mb], world_size)
        for r, idx in enumerate(split):
            plans[r].minibatches.append(sorted(mb[i].index for i in idx))
            plans[r].n_tokens.append(sum(s.n_scored for s in mb) * token_scale)
            plans[r].n_episodes.append(len(mb) * episode_scale)
    return plans


__all__ = ["split_by_tokens", "RankPlan", "plan_step"]
