"""One policy factory (rl/policy.py): the learner's fp32 master weights, a rollout worker's policy and the
warm-up's model are the same weights, built by the same function."""

from __future__ import annotations

import torch

from rl.learner.learner import master_policy
from rl.policy import PolicySpec, build_policy
from rl.rollout.worker import WorkerSettings
from rl.warmup import build_model
from tests.learner_fixtures import small_config


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k].float(), sb[k].float(), rtol=0, atol=0, msg=k)


def test_learner_worker_and_warmup_build_the_same_policy():
    cfg = small_config(seed=3)
    worker = build_policy(WorkerSettings.from_config(cfg))
    learner = master_policy(cfg)
    warm = build_model(cfg)
    assert not worker.training and learner.training and warm.training
    assert next(learner.parameters()).dtype == torch.float32
    _same_weights(worker, learner)
    _same_weights(worker, warm)


def test_the_spec_is_the_workers_policy_fields():
    cfg = small_config(seed=5)
    spec, settings = PolicySpec.from_config(cfg), WorkerSettings.from_config(cfg)
    assert spec == PolicySpec(settings.model_preset, settings.model_overrides, settings.checkpoint,
                              settings.dtype, settings.init_seed)
    other = build_policy(spec.replace(init_seed=6))
    assert not torch.equal(next(build_policy(spec).parameters()), next(other.parameters()))
