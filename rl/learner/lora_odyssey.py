"""LoRA on Odyssey's own model (`learner.lora` with model.preset / init_from): adapted weights, not layers.

Odyssey's layers read their projection weights directly, not only through `nn.Linear.forward`: KDA
concatenates [W_q; W_k; W_v] into one matmul and hands q/k/v, the gates' and the output weights to fused CPU
kernels; MLA views W_uk / W_uv per head for its latent attention; LatentMoE runs its stacked expert weights
in batched matmuls and in a fused decode kernel. A wrapper layer (peft's) would be bypassed by all of those.
So the adapter sits on the weight itself (`torch.nn.utils.parametrize`): every read of a target weight,
whoever reads it, returns

    W' = W + s B A,   s = alpha / rank                                        (LoRA, Hu et al. 2021, eq. 3)
    Linear weight W [out, in]:               A [r, in],    B [out, r],    B A [out, in]
    stacked experts W [E, out, in]:          A [E, r, in], B [E, out, r], (B A)_e = B_e A_e per expert

A is drawn like peft's (Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)), per expert for
stacked weights), B starts at zero, so the first forward is the base model's. The frozen W lives at
`<module>.parametrizations.<name>.original`, the adapters at `<module>.parametrizations.<name>.0.lora_A` /
`.lora_B` (`is_adapter_key` in rl/learner/lora.py knows both spellings).

Targets (model/lora_targets.py): a name matches (peft's rule) a decoder Linear whose module name is the name
or ends in "." + name
(`q_proj`: every KDA and MLA q_proj; `mixer.o_proj`: both mixers' output projections), or a LatentMoE's
stacked expert weight (`w_gate_up` [E, 2I, L], `w_down_experts` [E, L, I]). The embedding, the LM head (the
learner reads lm_head.weight as a matrix in its chunked head), the router (its fp32 scores and routing
replay), convolutions, norms and the vision patch embedding take none: `target_names` lists what does.

Dropout: LoRA's dropout acts on the adapter's input x (B A dropout(x)); a weight-space adapter never sees x,
so learner.lora.dropout must be 0 on Odyssey's model (refused at config load and here).

Reads without autograd (decode, prefill, the learner's no-grad passes) get one cached W' per target,
recomputed in place when W, A or B changed (keyed on their storage and version counters), so the model's own
weight caches (model/fused_weights.py ConcatWeight, keyed the same way) see a changed version exactly when
the adapted weight changed (the price: one extra copy of each target weight, made at the first such read).
With autograd every read computes W' afresh (its gradient reaches A and B).

Tests: tests/test_lora_odyssey.py (the merged-weight oracle through the fused and autograd paths, gradients,
learner step, rollout parity, resume, data parallelism, sequence chunking, config errors).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from model.lora_targets import EXPERT_PARAMS, adapter_targets, matches_target, target_names, target_problems


class LowRankDelta(nn.Module):
    """The parametrization W -> W + scaling * B @ A of one weight (module docstring): W [out, in] or
    [E, out, in]; lora_A [(E,) r, in] Kaiming-uniform, lora_B [(E,) out, r] zero."""

    def __init__(self, weight: torch.Tensor, rank: int, scaling: float) -> None:
        super().__init__()
        *lead, out_f, in_f = weight.shape
        self.scaling = float(scaling)
        a = torch.empty(*lead, rank, in_f, dtype=weight.dtype, device=weight.device)
        for m in a.view(-1, rank, in_f):  # per expert: fan_in = in, as peft's nn.Linear lora_A
            nn.init.kaiming_uniform_(m, a=math.sqrt(5))
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_f, rank, dtype=weight.dtype, device=weight.device))
        self._key: tuple | None = None
        self._merged: torch.Tensor | None = None

    def delta(self) -> torch.Tensor:
        """scaling * B @ A: [(E,) out, in] (batched per expert for stacked weights)."""
        return torch.matmul(self.lora_B, self.lora_A) * self.scaling

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """W [(E,) out, in] -> W + scaling * B @ A, same shape: a fresh tensor when a gradient is needed, else
        the cached merged copy (module docstring)."""
        a, b = self.lora_A, self.lora_B
        if torch.is_grad_enabled() and (weight.requires_grad or a.requires_grad or b.requires_grad):
            return weight + self.delta()
        key = (weight.data_ptr(), weight._version, a.data_ptr(), a._version, b.data_ptr(), b._version)
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference
                merged = weight.detach() + self.delta().detach()
                m = self._merged
                layout = (merged.shape, merged.dtype, merged.device)
                if m is None or (m.shape, m.dtype, m.device) != layout:
                    self._merged = torch.empty_like(merged)
                self._merged.copy_(merged)  # in place: its version counter moves with every change
            self._key = key
        return self._merged


def apply_odyssey_lora(policy: nn.Module, lora, seed: int = 0) -> nn.Module:
    """Parametrize the target weights of `policy` (an OdysseyForCausalLM) with `LowRankDelta` of `lora`
    (rank, alpha, target_modules; dropout must be 0) and freeze every other parameter; the adapters drawn
    with `seed` in a forked RNG (the global RNG untouched). In place; returns `policy`."""
    if lora.dropout > 0:
        raise ValueError(
            f"learner.lora.dropout={lora.dropout}: Odyssey's model takes LoRA on its weights (W + s B A, "
            "read by its fused kernels), which never see the adapter's input, so there is nothing to drop "
            "out; set learner.lora.dropout=0")
    problems = target_problems(policy, list(lora.target_modules))
    if problems:
        raise ValueError("; ".join(problems))
    chosen = [(n, m, p) for n, m, p in adapter_targets(policy)
              if any(matches_target(n, t) for t in lora.target_modules)]
    policy.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _, m, p in chosen:
            delta = LowRankDelta(getattr(m, p).detach(), lora.rank, lora.alpha / lora.rank)
            parametrize.register_parametrization(m, p, delta)
    for m in policy.modules():
        if isinstance(m, LowRankDelta):
            m.requires_grad_(True)
    return policy


def has_odyssey_lora(policy: nn.Module) -> bool:
    """Whether `policy` carries LowRankDelta parametrizations (apply_odyssey_lora ran on it)."""
    return any(isinstance(m, LowRankDelta) for m in policy.modules())


@torch.no_grad()
def merged_odyssey_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict of `policy` as a plain model's: `<module>.parametrizations.<p>.original` becomes
    `<module>.<p>` = W + s B A (a new tensor), adapter entries dropped, everything else the policy's own."""
    modules = dict(policy.named_modules())
    out: dict[str, torch.Tensor] = {}
    for k, v in policy.state_dict().items():
        if ".parametrizations." in k and k.endswith((".lora_A", ".lora_B")):  # the adapters themselves
            continue
        if ".parametrizations." in k and k.endswith(".original"):
            owner, rest = k.split(".parametrizations.", 1)
            p = rest.removesuffix(".original")
            delta = modules[owner].parametrizations[p][0]
            k, v = f"{owner}.{p}", v + delta.delta().to(v.dtype)
        out[k] = v
    return out


__all__ = ["EXPERT_PARAMS", "LowRankDelta", "apply_odyssey_lora", "has_odyssey_lora",
           "merged_odyssey_state_dict", "target_names", "target_problems"]
