"""Policy losses and rollout engines are looked up in registries (rl/learner/losses.py POLICY_LOSSES,
rl/rollout/engines.py ENGINES): a built-in name, or a user's `pkg.module:fn` with the same signature; any
other name is a config problem naming the choices."""

from __future__ import annotations

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.learner.losses import POLICY_LOSSES, policy_loss, policy_loss_fn
from rl.rollout.engines import ENGINES, engine_factory, torch_engine

TINY = "configs/tiny.yaml"


def reinforce(logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high):
    """A user's policy loss: plain REINFORCE, -A log pi, never clipped."""
    return -advantages * logp, torch.zeros_like(logp, dtype=torch.bool)


def test_builtin_names_and_a_users_policy_loss():
    assert list(POLICY_LOSSES) == ["ppo_clip", "gspo", "cispo"]
    assert list(ENGINES) == ["torch", "vllm"] and engine_factory("torch") is torch_engine
    assert policy_loss_fn("tests.test_registries:reinforce") is reinforce
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([1.0, -0.5], dtype=torch.float64)
    seq, seq_tokens = torch.tensor([0, 0]), torch.tensor([2])
    loss, clipped = policy_loss("tests.test_registries:reinforce", logp, logp.detach(), A, seq, seq_tokens,
                                0.2, 0.28)
    assert loss.tolist() == [1.0, -1.0] and not clipped.any()


@pytest.mark.parametrize(("key", "what"), [("learner.policy_loss", "policy loss"),
                                           ("rollout.engine", "rollout engine")])
def test_unknown_names_are_config_problems(key, what):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{key}=bogus"])
    (msg,) = info.value.problems
    assert msg.startswith(f"{key}: unknown {what} 'bogus': choose from ")
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{key}=tests.test_registries:nothing_here"])
    (msg,) = info.value.problems
    assert msg.startswith(f"{key}: {what} 'tests.test_registries:nothing_here'")
