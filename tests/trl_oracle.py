"""TRL 1.16's GRPO loss as an oracle: `GRPOTrainer._compute_loss` driven on given tensors.

The trainer object is created without its constructor; `trl_loss` sets exactly the attributes the method
reads and stubs its per-token log-prob helper so that it returns the log-probs given here. Everything is in
TRL's padded layout: [B, T] completions with a completion mask (and optionally a tool mask for multi-turn
completions whose observation tokens are not generated).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch


class _OneProcess:
    """The slice of accelerate's Accelerator that `_compute_loss` touches, for a single process."""

    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_loss(loss_type, logp, old, adv, completion_mask, *, eps_low, eps_high, level="token", beta=0.0,
             ref=None, entropy=None, entropy_coef=0.0, is_ratio=None, max_completion_length=64,
             tool_mask=None):
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    t.loss_type, t.epsilon_low, t.epsilon_high = loss_type, eps_low, eps_high
    t.importance_sampling_level, t.beta = level, beta
    t.top_entropy_quantile, t.off_policy_mask_threshold = 1.0, None
    t.use_vllm = t.vllm_importance_sampling_correction = is_ratio is not None
    t.aux_loss_enabled = False
    t.entropy_coef, t.use_adaptive_entropy = entropy_coef, False
    t._entropy_bonus_enabled = entropy_coef != 0.0
    t.current_gradient_accumulation_steps = 1
    t.max_completion_length = max_completion_length
    t.accelerator = _OneProcess()
    t.args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    t.model = SimpleNamespace(training=True)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    ent = entropy if entropy is not None else torch.zeros_like(logp)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    B, T = logp.shape
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return t._compute_loss(None, inputs)
