"""The value model of PPO (advantage = gae): a head on the policy trunk, or a separate critic.

    head     V_t = w^T h_t + b     h = the policy's final hidden state [L, D] (the value loss trains it too)
    critic   V_t = w^T g_t + b     g = the final hidden state of a separate trunk (Odyssey's or an HF model's)

V_t is read at scored position t (the input whose next token was generated): the value of the state
before the policy generated that token. The head starts at zero (w = 0, b = 0), so the first advantages are
the discounted returns. A critic of an Odyssey policy starts as a copy of the policy's initial trunk
(`learner.critic_preset: null`) or as a fresh model of another preset, initialised with `learner.seed`.
A critic of an HF policy (model.hf_path: `HFCritic`) is always a copy of the policy's initial weights,
run through the policy's own packed forward (`HFPolicy.packed_hidden`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from model.config import OdysseyConfig
from model.hf_policy import HFPolicy
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

    def __init__(self, trunk: OdysseyModel | HFPolicy) -> None:
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


class HFCritic(Critic):
    """The separate critic of an HF policy: `trunk` is an HFPolicy holding a copy of the policy's initial
    weights (`hf_trunk_copy`), `head` a zero-initialised ValueHead. (input_ids [L], cu_seqlens [N+1],
    positions [M], images None, prefix_of int [N] | None) -> V [M] fp32,
    V = head(trunk.packed_hidden(input_ids, cu_seqlens, prefix_of)[positions]): the packed forward of the
    policy itself (per-sequence positions and attention, no padding), so a sequence's values do not depend
    on the sequences packed beside it; with shared prefixes (prefix_of, rl/learner/prefix_sharing.py) a
    continuing sequence attends to its prefix exactly as the policy's does. (The learner packs no shared
    prefixes with a critic today: GAE's samples have no groups, and learner.share_prefixes is off with any
    Critic, rl/learner/learner.py.)

    The trunk's `lm_head` is never read. Tied to the embedding (SmolLM2, Qwen3 small), it is the embedding
    the critic trains; untied, it is a frozen copy (requires_grad False: no gradient, no optimizer state, but
    its V x D weights in memory). An HF MoE critic routes freely: no routing replay (the recorded experts are
    the policy's) and no balancing bias (`moe_layers` is empty, as HFPolicy.update_router_biases has none to
    update)."""

    def __init__(self, trunk: HFPolicy) -> None:
        if not isinstance(trunk, HFPolicy):
            raise TypeError(f"HFCritic's trunk must be an HFPolicy, got {type(trunk).__name__}; an Odyssey "
                            "trunk makes a Critic")
        super().__init__(trunk)

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, positions: torch.Tensor, images=None,
        prefix_of: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if images is not None and images.n:
            raise ValueError("the critic of a Hugging Face policy (model.hf_path) reads text only; these "
                             "trajectories hold images: train them with an Odyssey preset (model.preset)")
        return self.head(self.trunk.packed_hidden(input_ids, cu_seqlens, prefix_of)[positions])

    def moe_layers(self) -> list[nn.Module]:
        return []


@torch.no_grad()
def hf_trunk_copy(policy: HFPolicy) -> HFPolicy:
    """A new HFPolicy of the policy's architecture and config holding a copy of its base weights, all
    trainable except an untied `lm_head` (frozen: see HFCritic). Built fresh from the config (weights
    uninitialised, then loaded), not deep-copied, so none of the policy's hooks (an MoE's router hooks,
    model/hf_routing.py) come along: the copy gets its own. With LoRA adapters on the policy
    (rl/learner/lora.py) the copy takes the base weights without them: the critic is fully fine-tuned (its
    memory is a full model's, whatever the policy's LoRA saves)."""
    from transformers.initialization import no_init_weights

    from rl.learner.lora import is_adapter_key

    state = {k.replace(".base_layer.", "."): v for k, v in policy.hf.state_dict().items()
             if not is_adapter_key(k)}
    p = next(policy.parameters())
    with no_init_weights():  # (which also skips post_init's tying: tie as from_pretrained does)
        hf = type(policy.hf)(copy.deepcopy(policy.config))
    hf.tie_weights()
    hf.to(device=p.device, dtype=p.dtype)
    hf.load_state_dict(state, strict=True)
    hf.train(policy.training)
    trunk = HFPolicy(hf)
    if trunk.lm_head.weight is not trunk.model.get_input_embeddings().weight:
        trunk.lm_head.requires_grad_(False)
    return trunk


def build_value_model(
    kind: str, policy: OdysseyForCausalLM | HFPolicy, critic_preset: str | None, seed: int
) -> ValueHead | Critic:
    """`learner.value_model` = "head" | "critic" (see the module docstring). An HF policy's critic is an
    HFCritic (a copy of its initial weights; critic_preset must be None)."""
    if kind == "head":
        return ValueHead(policy.config.hidden_size)
    if kind != "critic":
        raise ValueError(f"value_model must be 'head' or 'critic', got {kind!r}")
    if isinstance(policy, HFPolicy):
        if critic_preset is not None:
            raise ValueError(
                f"learner.critic_preset ({critic_preset!r}) builds an Odyssey-preset critic, which cannot "
                "read the token ids of a Hugging Face policy (model.hf_path); remove learner.critic_preset: "
                "the critic of an HF policy is a copy of the policy's initial weights")
        return HFCritic(hf_trunk_copy(policy))
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


__all__ = ["ValueHead", "Critic", "HFCritic", "build_value_model", "hf_trunk_copy"]
