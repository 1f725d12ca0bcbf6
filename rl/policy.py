"""The one policy factory: the learner, the rollout workers and the SFT warm-up build their model here.

    spec = PolicySpec.from_config(cfg)                     # model.* and learner.seed of a RunConfig
    model = build_policy(spec)                             # eval mode, in spec.dtype (a rollout engine's)
    model = build_policy(spec.replace(dtype="float32"), train=True)   # fp32 master weights (learner, warm-up)

The model comes from `checkpoint` (an Odyssey checkpoint with `overrides` applied to its config, or any
Hugging Face causal LM checkpoint, wrapped in `model.hf_policy.HFPolicy`), or is a fresh `preset` whose
weights are drawn with `init_seed` inside a forked RNG, so every process that builds it holds the same
weights. `rl.rollout.worker.WorkerSettings` carries the same five fields and may be passed as the spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol


class PolicyFields(Protocol):
    """What `build_policy` reads: a `PolicySpec`, or anything with the same attributes (WorkerSettings)."""

    model_preset: str
    model_overrides: dict
    checkpoint: str | None
    dtype: str
    init_seed: int


@dataclass(frozen=True)
class PolicySpec:
    """Which policy to build. model_preset / model_overrides: `OdysseyConfig.from_preset(preset, **overrides)`
    (the overrides also apply on top of an Odyssey checkpoint's config); checkpoint: a directory (Odyssey's
    or an HF causal LM's) or None for a fresh preset; dtype: "float32" | "bfloat16"; init_seed: the seed of a
    fresh preset's weights."""

    model_preset: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    checkpoint: str | None = None
    dtype: str = "float32"
    init_seed: int = 0

    @classmethod
    def from_config(cls, cfg: Any) -> PolicySpec:
        """From an `rl.config.RunConfig`: model.preset / overrides / dtype, the checkpoint (model.hf_path,
        else model.init_from) and learner.seed as the init seed."""
        return cls(
            model_preset=cfg.model.preset,
            model_overrides=dict(cfg.model.overrides),
            checkpoint=cfg.model.hf_path or cfg.model.init_from,
            dtype=cfg.model.dtype,
            init_seed=cfg.learner.seed,
        )

    def replace(self, **changes: Any) -> PolicySpec:
        """A copy with `changes` applied (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


def build_policy(spec: PolicyFields, *, train: bool = False) -> Any:
    """The policy described by `spec` (module docstring), in `spec.dtype`. train=False: eval mode (rollout
    engines); train=True: fp32 and train mode (the learner's and the warm-up's master weights; pass a spec
    with dtype "float32" so an HF checkpoint is read in fp32 too)."""
    import torch

    from model.config import OdysseyConfig
    from model.hf_policy import HFPolicy, is_odyssey_checkpoint
    from model.modeling import OdysseyForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    if spec.checkpoint and not is_odyssey_checkpoint(spec.checkpoint):
        if spec.model_overrides:
            raise ValueError("model.overrides apply to Odyssey models only; edit the HF checkpoint's "
                             "config.json instead, or remove model.overrides")
        model = HFPolicy.from_pretrained(spec.checkpoint, dtype=dtype).to(dtype).eval()
    elif spec.checkpoint:  # model.overrides apply on top of the checkpoint's config (e.g. balancing=none)
        model = OdysseyForCausalLM.from_pretrained(spec.checkpoint, dtype=dtype, **spec.model_overrides)
        model = model.to(dtype).eval()
    else:
        cfg = OdysseyConfig.from_preset(spec.model_preset, **spec.model_overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.init_seed)
            model = OdysseyForCausalLM(cfg)
        model = model.to(dtype).eval()
    return model.float().train() if train else model


__all__ = ["PolicyFields", "PolicySpec", "build_policy"]
