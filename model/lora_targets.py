"""Which weights of Odyssey's model take a LoRA adapter (`learner.lora.target_modules`).

The decoder's Linear weights (KDA's and MLA's projections, the dense MLP's, LatentMoE's latent projections),
named by their module, and LatentMoE's stacked expert weights `w_gate_up` [E, 2I, L] / `w_down_experts`
[E, L, I], named `<module>.<param>`. Not the embedding, the LM head (the learner reads lm_head.weight as a
matrix), the router, convolutions or norms. A target name matches a weight whose name is the target or ends
in "." + target (peft's rule). Works on the meta device, so `load_config` checks names without weights
(rl/config/checks.py); rl/learner/lora_odyssey.py adapts what these name.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from model.moe import LatentMoE

EXPERT_PARAMS = ("w_gate_up", "w_down_experts")  # LatentMoE's stacked expert weights [E, out, in]
NO_ADAPTER = ("lm_head", "embed_tokens")  # read as matrices by the learner's head / the embedding lookup


def adapter_targets(policy: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, owner module, parameter name) of every weight that may take an adapter: the decoder's Linear
    weights (name = the module's) and LatentMoE's stacked expert weights (name = `<module>.<param>`)."""
    for name, m in policy.named_modules():
        if ".layers." not in f".{name}.":
            continue
        if isinstance(m, nn.Linear):
            yield name, m, "weight"
        elif isinstance(m, LatentMoE):
            for p in EXPERT_PARAMS:
                yield f"{name}.{p}", m, p


def matches_target(name: str, target: str) -> bool:
    """peft's rule: `target` names the weight `name` or is a suffix of it after a dot."""
    return name == target or name.endswith("." + target)


def target_names(policy: nn.Module) -> list[str]:
    """The short names (last component) a learner.lora.target_modules entry may use on `policy`, sorted."""
    return sorted({n.rsplit(".", 1)[-1] for n, _, _ in adapter_targets(policy)})


def target_problems(policy: nn.Module, target_modules: list[str]) -> list[str]:
    """One message per target that names no adaptable weight of `policy` (works on the meta device)."""
    names = [n for n, _, _ in adapter_targets(policy)]
    out = []
    for t in target_modules:
        if not any(matches_target(n, t) for n in names):
            why = (" (the LM head and the embedding take no adapter: the learner reads lm_head.weight as a "
                   "matrix)" if t.rsplit(".", 1)[-1] in NO_ADAPTER else "")
            out.append(f"learner.lora.target_modules: {t!r} names no adaptable weight of Odyssey's model"
                       f"{why}; its decoder Linear layers and stacked expert weights are "
                       f"{', '.join(target_names(policy))}. Use those names")
    return out


__all__ = ["EXPERT_PARAMS", "NO_ADAPTER", "adapter_targets", "matches_target", "target_names",
           "target_problems"]
