"""Shared pieces of the learner tests: a small policy config and scored trajectories for it."""

from __future__ import annotations

import numpy as np

from rl.config import RunConfig
from rl.trajectory import Trajectory, TurnSpan

# A 4-layer [kda, kda, kda, mla] policy with 3 MoE layers of 8 experts (top-2): seconds per step on CPU.
SMALL = dict(
    num_hidden_layers=4, hidden_size=64, kda_num_heads=2, kda_head_dim=32, mla_num_heads=2, mla_head_dim=32,
    intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_latent_dim=32,
    moe_intermediate_size=32, shared_expert_intermediate_size=64,
)
N_MOE, N_EXPERTS, TOP_K = 3, 8, 2


def small_config(**learner) -> RunConfig:
    learner.setdefault("group_size", 4)
    return RunConfig.model_validate({"model": {"overrides": dict(SMALL)}, "learner": learner})


def fingerprint() -> str:
    from model.tokenizer import load_tokenizer, tokenizer_fingerprint

    return tokenizer_fingerprint(load_tokenizer())


def scored_traj(rng: np.random.Generator, layout: list[tuple[str, int]], reward: float, group: object,
                routed: bool = True, logp_noise: float = 0.3, **fields) -> Trajectory:
    """A scored trajectory for the SMALL policy: turns per `layout` [(role, n)], assistant tokens generated,
    random rollout log-probs, random distinct routed experts (the rollout's recorded routing)."""
    T = sum(n for _, n in layout)
    tokens = rng.integers(16, 4096, T).astype(np.int32)
    mask = np.zeros(T, np.uint8)
    turns, pos = [], 0
    for role, n in layout:
        turns.append(TurnSpan(role, pos, pos + n))
        if role == "assistant":
            mask[pos:pos + n] = 1
        pos += n
    lp = np.full(T, np.nan, np.float32)
    lp[mask == 1] = -8.3 + rng.normal(0, logp_noise, int(mask.sum()))
    re = None
    if routed:
        re = np.stack([rng.permutation(N_EXPERTS)[:TOP_K] for _ in range(T * N_MOE)]).reshape(T, N_MOE, TOP_K)
        re = re.astype(np.uint16)
    n_asst = sum(1 for r, _ in layout if r == "assistant")
    meta = {"group_id": group, "tokenizer": fingerprint()}
    meta.update(fields.pop("metadata", {}))
    return Trajectory(tokens=tokens, loss_mask=mask, rollout_logprobs=lp, routed_experts=re, turns=turns,
                      rewards={"total": float(reward)}, turn_rewards=[0.0] * n_asst, metadata=meta,
                      terminated=True, **fields)


def ragged_batch(seed: int = 0, n_groups: int = 2, group_size: int = 4, routed: bool = True,
                 lengths: list[int] | None = None) -> list[Trajectory]:
    """Groups of single-turn episodes with ragged lengths (the first has 1 model input: T = 2)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for i in range(group_size):
            j = g * group_size + i
            n = lengths[j] if lengths is not None else int(rng.integers(2, 70))
            n_prompt = 1 if n == 2 else int(rng.integers(1, n))
            out.append(scored_traj(rng, [("prompt", n_prompt), ("assistant", n - n_prompt)],
                                   float(i % 3), f"g{g}", routed=routed))
    return out


def ascii_share(traj: Trajectory) -> float:
    """A reward with signal for an untrained policy: the share of ASCII letters in the text it generated."""
    from model.tokenizer import load_tokenizer

    text = load_tokenizer().decode(traj.tokens[traj.loss_mask == 1].tolist(), skip_special_tokens=True)
    return sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text))
