"""Advantage estimators come from one registry (rl/learner/estimators.py): built-ins by name, a user's
`Estimator` by `pkg.module:attr`; the driver, the config checks and the learner read its traits."""

from __future__ import annotations

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.learner.batch import ModelFacts, prepare_batch
from rl.learner.estimators import BUILTIN, Estimator, estimator
from tests.learner_fixtures import N_MOE, fingerprint, ragged_batch, small_config

TINY = "configs/tiny.yaml"


def _median_baseline(rewards, groups, lcfg):
    """A = r - median of the group's rewards (a user's estimator for the tests)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    out = torch.empty_like(r)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        out[idx] = r[idx] - r[idx].median()
    return out


MEDIAN = Estimator("median", _median_baseline, min_group_size=3)
NOT_AN_ESTIMATOR = object()


def test_builtin_traits():
    assert sorted(BUILTIN) == ["gae", "grpo", "raft", "rloo"]
    assert [n for n, e in BUILTIN.items() if e.grouped] == ["grpo", "rloo", "raft"]
    assert [n for n, e in BUILTIN.items() if e.needs_values] == ["gae"]
    assert estimator("raft").successes_only and not estimator("raft").turn_credit
    assert estimator("grpo").min_group_size == 2 and estimator("raft").min_group_size == 1


def test_an_estimator_is_one_kind():
    with pytest.raises(ValueError, match="exactly one of grouped=True"):
        Estimator("both", _median_baseline, grouped=True, needs_values=True)


def test_a_users_estimator_computes_the_batch_advantages():
    cfg = small_config()
    cfg.learner.advantage = "tests.test_learner_estimators:MEDIAN"
    trajs = ragged_batch(seed=2)
    facts = ModelFacts(vocab_size=1 << 17, n_moe_layers=N_MOE, n_experts=8, top_k=2, tokenizer=fingerprint())
    batch = prepare_batch(trajs, facts, cfg.learner)
    for s in batch.samples:  # every token of an episode carries its episode's advantage
        group = [t.rewards["total"] for t in trajs if t.metadata["group_id"] == s.group]
        want = trajs[s.index].rewards["total"] - float(torch.tensor(group, dtype=torch.float64).median())
        assert s.advantages.tolist() == [want] * s.n_scored


def test_config_names_unknown_and_wrong_estimators():
    (msg,) = [p for p in _problems(["learner.advantage=grpo2"]) if p.startswith("learner.advantage")]
    assert msg.startswith("learner.advantage: unknown advantage estimator 'grpo2': choose from grpo, rloo, "
                          "raft, gae")
    (msg,) = _problems(["learner.advantage=tests.test_learner_estimators:NOT_AN_ESTIMATOR"])
    assert "is a object; it must be an rl.learner.estimators.Estimator" in msg
    (msg,) = _problems(["learner.advantage=tests.test_learner_estimators:MEDIAN", "learner.group_size=2",
                        "rollout.episodes=4"])
    assert msg.startswith("learner.group_size (2) must be >= 3 for median")
    ok = load_config(TINY, ["learner.advantage=tests.test_learner_estimators:MEDIAN", "learner.group_size=4",
                            "rollout.episodes=8"])
    assert estimator(ok.learner.advantage) is MEDIAN


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    return info.value.problems
