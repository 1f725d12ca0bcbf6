"""Done-when: `Learner.step` improves the TRL-matched objective on real rollouts.

Episodes are real: the TorchEngine samples from the policy (same initial weights as the learner, seed
`learner.seed`), the `arith` env runs them (tools in-process), `rewards.compose` scores them. Each group
plays one task (its members differ only in their sampling seeds). The rewards are the outcome plus the
share of ASCII letters in the generated text (`tests.learner_fixtures:ascii_share`), so that an untrained
policy already gets a reward signal that differs within groups.

The objective is TRL 1.16's own GRPO loss (`GRPOTrainer._compute_loss`, tests/trl_oracle.py; loss_type "dapo"
= our token_mean with ppo_clip) on the model's per-token log-probs computed trajectory by trajectory with
`OdysseyForCausalLM.token_logprobs` (routing replayed). Before the step it must equal the learner's own
reported loss; after one step, recomputed against the pre-step log-probs, it must be lower.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import envs
from model.tokenizer import load_tokenizer
from rewards.compose import compose
from rl.learner import Learner
from rl.policy import build_policy
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from rl.rollout.engine import TorchEngine
from rl.rollout.worker import WorkerSettings
from tests.learner_fixtures import small_config
from tests.trl_oracle import trl_loss

REWARDS = [{"name": "outcome", "weight": 1.0}, {"name": "tests.learner_fixtures:ascii_share", "weight": 1.0}]


class SameTask:
    """An env whose every episode plays the task of `task_seed` (a GRPO group: same prompt, own samples)."""

    def __init__(self, env, task_seed: int) -> None:
        self.env, self.task_seed = env, task_seed

    async def areset(self, seed=None, **kw):
        return await self.env.areset(seed=self.task_seed, **kw)

    def __getattr__(self, name):
        return getattr(self.env, name)


def rollouts(cfg, n_groups: int, group_size: int):
    codec = ChatCodec(load_tokenizer())
    engine = TorchEngine(build_policy(WorkerSettings.from_config(cfg)), detokenize=codec.decode)
    ep = EpisodeConfig(max_new_tokens=12, max_turns=2, max_episode_tokens=1024, temperature=1.0)

    async def play():
        jobs = []
        for g in range(n_groups):
            for i in range(group_size):
                env = envs.make("arith", difficulty=0, tools_in_prompt=False, use_sandbox=False)
                env = SameTask(env, task_seed=100 + g)
                jobs.append(run_episode(engine, env, codec, ep, seed=1000 * g + i, metadata={"group_id": g}))
        try:
            return await asyncio.gather(*jobs)
        finally:
            await engine.aclose()

    trajs = asyncio.run(play())
    for t in trajs:
        compose(t, REWARDS)
    return trajs


def per_token_logps(policy, samples):
    """log pi(y_t) of every scored token, one trajectory at a time (no packing), padded [B, T_max]."""
    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.input_ids)
            targets = ids.clone()
            targets[torch.from_numpy(s.scored)] = torch.from_numpy(s.targets)
            replay = torch.from_numpy(s.replay.astype(np.int64))
            lp = policy.token_logprobs(ids, targets, replay_experts=replay)
            rows.append(lp[torch.from_numpy(s.scored)].double())
    T = max(r.numel() for r in rows)
    out = torch.zeros(len(rows), T, dtype=torch.float64)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.numel()], mask[i, : r.numel()] = r, 1
    return out, mask


@pytest.mark.slow
def test_learner_step_improves_the_trl_objective_on_real_rollouts():
    cfg = small_config(lr=3e-4, tis_cap=None, micro_batch_tokens=2048)
    trajs = rollouts(cfg, n_groups=2, group_size=4)
    assert all(t.infra_error is None and t.n_generated > 0 for t in trajs)
    assert len({t.rewards["total"] for t in trajs}) > 2  # the reward differs within groups
    learner = Learner(cfg)
    samples = learner.prepare(trajs).samples
    assert len(samples) == 8
    adv = torch.tensor([float(s.advantages[0]) for s in samples], dtype=torch.float64)
    before, mask = per_token_logps(learner.policy, samples)
    objective_before = trl_loss("dapo", before, before, adv, mask, eps_low=0.2, eps_high=0.28)
    metrics = learner.step(trajs)
    after, _ = per_token_logps(learner.policy, samples)
    objective_after = trl_loss("dapo", after, before, adv, mask, eps_low=0.2, eps_high=0.28)
    # the learner's packed, replayed forward computed TRL's objective on these rollouts
    assert metrics["loss"] == pytest.approx(float(objective_before), rel=1e-5, abs=1e-7)
    # the rollout engine and the learner agree on the sampled tokens' log-probs (same weights, R3)
    assert metrics["learner/offpolicy_kl"] < 1e-5 and metrics["learner/offpolicy_ratio_max"] < 1.01
    assert float(objective_after) < float(objective_before) - 1e-3, (float(objective_after),
                                                                      float(objective_before))
