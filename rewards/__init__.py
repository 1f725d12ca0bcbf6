"""Reward functions and their composition from config (docs/rewards.md)."""

from rewards.base import RewardFn, RewardResult, param_check
from rewards.compose import (
    RewardMetrics,
    RewardSpec,
    acompose,
    acompose_batch,
    compose,
    compose_batch,
    is_trainable,
    specs_from_yaml,
    untrainable_reason,
    validate_reward_specs,
)
from rewards.placement import token_rewards
from rewards.registry import BUILTINS, list_builtins, resolve_reward

__all__ = [
    "BUILTINS",
    "RewardFn",
    "RewardMetrics",
    "RewardResult",
    "RewardSpec",
    "acompose",
    "acompose_batch",
    "compose",
    "compose_batch",
    "is_trainable",
    "list_builtins",
    "param_check",
    "resolve_reward",
    "specs_from_yaml",
    "token_rewards",
    "untrainable_reason",
    "validate_reward_specs",
]
