"""The value model of PPO (advantage = gae): a head on the policy trunk, or a separate critic.

    head     V_t = w^T h_t + b     h = the policy's final hidden state [L, D] (the value loss trains it too)
    critic   V_t = w^T g_t + b     g = the final hidden state of a separate OdysseyModel trunk

V_t is read at scored position t (the input whose next token was generated): the value of the state
before the policy generated that token. The head starts at zero (w = 0, b = 0), so the first advantages are
the discounted returns. A critic starts as a copy of the policy's initial trunk (`learner.critic_preset:
null`) or as a fresh model of another preset, initialised with `learner.seed`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM, OdysseyModel


class ValueHead(nn.Module):
    """Linear D -> 1, zero-initialised: h [M, D] -> V [M] fp32."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h).squeeze(-1).float()


class Critic(nn.Module):
    """A separate trunk with a value head: (input_ids [L], cu_seqlens [N+1], positions [M], images) -> V [M].
    images: the micro-batch's `model.vision.ImagePatches` (the trunk must have the policy's patch size)."""

    def __init__(self, trunk: OdysseyModel) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = ValueHead(trunk.config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, positions: torch.Tensor, images=None
    ) -> torch.Tensor:
        h, _, _, _ = self.trunk(input_ids, cu_seqlens, None, None, False, images)
        return self.head(h[positions])

    def moe_layers(self) -> list[nn.Module]:
        return [layer.mlp for layer in self.trunk.layers if layer.is_moe]


def build_value_model(
    kind: str, policy: OdysseyForCausalLM, critic_preset: str | None, seed: int
) -> ValueHead | Critic:
    """`learner.value_model` = "head" | "critic" (see the module docstring)."""
    if kind == "head":
        return ValueHead(policy.config.hidden_size)
    if kind != "critic":
        raise ValueError(f"value_model must be 'head' or 'critic', got {kind!r}")
    if critic_preset is None:
        return Critic(copy.deepcopy(policy.model))
    cfg = OdysseyConfig.from_preset(critic_preset)
    if cfg.vocab_size < policy.config.vocab_size:
        raise ValueError(
            f"learner.critic_preset {critic_preset!r} has vocab_size {cfg.vocab_size} < the policy's "
            f"{policy.config.vocab_size}; the critic reads the same token ids. Choose a larger preset"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        trunk = OdysseyModel(cfg)
    return Critic(trunk)


__all__ = ["ValueHead", "Critic", "build_value_model"]
