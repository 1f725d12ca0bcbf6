"""LoRA (`learner.lora`): low-rank adapters on the policy's projection weights; only the adapters train.

    apply_lora(policy, cfg.learner.lora)   # adapters on the target weights; every other parameter frozen
    merged_state_dict(policy)              # the engines' weights: W + (alpha / rank) B A, the base names
    adapter_state_dict(policy)             # lora_A / lora_B (+ Odyssey's router biases): a checkpoint's
    load_adapter_state_dict(policy, sd)    # a saved adapter back into the policy, in place
    iter_merged_buckets(policy, bucket_bytes)  # merged weights of an FSDP-sharded HF policy, bucket by bucket

Two policy kinds, one config section (rank, alpha, target_modules, dropout) and one set of functions:

- Hugging Face policies (model.hf_path): peft's own LoRA layers (`peft.inject_adapter_in_model` on the
  policy's `model` trunk): each target `nn.Linear` becomes base(x) + (alpha / rank) B(A(dropout(x))), A
  initialised like peft (Kaiming), B at zero, so the first forward equals the base model's. A target name
  matches a module whose name is the name or ends in "." + name (peft's rule: `q_proj` takes every layer's
  q_proj, `layers.0.self_attn.q_proj` one). Only the trunk takes adapters: the learner's chunked LM head
  reads `lm_head.weight` as a matrix, so an adapter on lm_head (or on the tied embedding) would be bypassed;
  the config check refuses it.
- Odyssey's own model (OdysseyForCausalLM): its KDA layers read q/k/v weights directly (concatenated, and in
  the fused CPU kernels), so a wrapper layer would be bypassed; the adapter sits on the weight instead
  (rl/learner/lora_odyssey.py, `torch.nn.utils.parametrize`): every reader of a target weight sees
  W + (alpha / rank) B A. Targets are the decoder's Linear layers and LatentMoE's stacked expert weights
  (per-expert A, B); dropout must be 0 (a weight never sees the adapter's input), and the learner runs it
  unsharded (data parallel at most: no FSDP, expert or context parallelism; rl/config/checks.py).

Weight sync is merged: the rollout engines (TorchEngine, VllmEngine) receive full weights W + (alpha/rank) B A
under the base model's parameter names, so they need no LoRA support; the price is a full-size broadcast per
step, as in full fine-tuning.

Under FSDP (learner.sharding=fsdp, rl/learner/fsdp.py; HF policies) the LoRA layers sit inside the
decoder-layer units, so a unit holds frozen base weights and trainable adapters side by side; FSDP2 shards
both, all-gathers both for the forward, and reduce-scatters gradients only for the parameters that require
them (the adapters), and the optimizer holds only the adapters' shards. The functions here take DTensor
parameters as they are: the adapter state dict is gathered whole on every rank (collective; adapters are
small), a saved adapter loads into each rank's shard, and `iter_merged_buckets` streams the merged weights as
rl/learner/shard_export.py streams full ones (one bucket gathered at a time, each merged weight from its
gathered W, A and B with peft's formula), equal to `merged_state_dict` of the unsharded policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

ADAPTER = "default"  # peft's adapter name; one adapter per policy


def apply_lora(policy: nn.Module, lora, seed: int = 0) -> nn.Module:
    """Wrap the target Linear layers of `policy` (an `model.hf_policy.HFPolicy`) with peft LoRA layers of
    `lora` (rl.config LoraSection: rank, alpha, target_modules, dropout) and freeze every other parameter;
    on an OdysseyForCausalLM, parametrize its target weights instead (rl/learner/lora_odyssey.py).
    The adapters' initial weights are drawn with `seed` inside a forked RNG (the same in every process, and
    the global RNG untouched). In place; returns `policy`."""
    from model.hf_policy import HFPolicy
    from model.modeling import OdysseyForCausalLM

    if isinstance(policy, OdysseyForCausalLM):  # adapters on the weights themselves (lora_odyssey.py)
        from rl.learner.lora_odyssey import apply_odyssey_lora

        return apply_odyssey_lora(policy, lora, seed)
    from peft import inject_adapter_in_model

    if not isinstance(policy, HFPolicy):
        raise ValueError(
            f"learner.lora applies to Hugging Face policies (model.hf_path) and Odyssey's model "
            f"(OdysseyForCausalLM), not {type(policy).__name__}. Remove learner.lora to fine-tune fully")
    config = peft_lora_config(lora)
    policy.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, policy.model, adapter_name=ADAPTER)
    for name, p in policy.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return policy


def peft_lora_config(lora, task_type: str | None = None):
    """peft.LoraConfig of `learner.lora` (rank, alpha, target_modules, dropout; no bias adapters): the one our
    HF policies take, and what a peer given the same section gets (TRL's `peft_config`, with
    task_type="CAUSAL_LM")."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                      lora_dropout=lora.dropout, bias="none", task_type=task_type)


def is_adapter_key(name: str) -> bool:
    """A parameter (or state_dict key) of a LoRA adapter (lora_A / lora_B): peft's `<m>.lora_A.default.weight`
    or Odyssey's `<m>.parametrizations.<p>.0.lora_A`."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def has_lora(policy: nn.Module) -> bool:
    """Whether `policy` carries LoRA layers (apply_lora ran on it)."""
    from peft.tuners.lora import LoraLayer

    from rl.learner.lora_odyssey import LowRankDelta

    return any(isinstance(m, (LoraLayer, LowRankDelta)) for m in policy.modules())


def _saved_keys(policy: nn.Module) -> list[str]:
    """The state-dict keys a LoRA checkpoint stores: the adapters, and on Odyssey's model the router
    balancing biases (`e_score_correction_bias` buffers, which the balancer moves every step while the base
    weights stay frozen: without them a resumed run would route differently)."""
    from rl.learner.lora_odyssey import has_odyssey_lora

    odyssey = has_odyssey_lora(policy)
    return [k for k in policy.state_dict()
            if is_adapter_key(k) or (odyssey and k.endswith(".e_score_correction_bias"))]


def adapter_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights (detached whole CPU copies), under the policy's own key names; on Odyssey's model
    also its router balancing biases (`_saved_keys`). Under FSDP each sharded adapter is all-gathered, so
    this is collective: every rank calls it and every rank gets all."""
    state, out = policy.state_dict(), {}
    for k in _saved_keys(policy):
        v = state[k]
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
    return out


def load_adapter_state_dict(policy: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter weights (and an Odyssey policy's router biases) into `policy` in place (the
    optimizer keeps its parameters). The keys must be exactly `adapter_state_dict`'s: a checkpoint of another
    rank or target set is refused."""
    own = set(_saved_keys(policy))
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's LoRA adapter does not match this learner's (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): resume with the learner.lora (rank, target_modules) it was written with")
    own_tensors = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
    with torch.no_grad():
        for k, v in state.items():
            p = own_tensors[k]
            if isinstance(p, DTensor):  # FSDP: every rank holds the whole saved tensor and keeps its shard
                v = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
            p.copy_(v)


@torch.no_grad()
def merged_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's state_dict with every LoRA layer merged: `<m>.weight` = base W + (alpha / rank) B A,
    `<m>.bias` = the base bias, no adapter keys. The names are those of the policy without adapters, which
    the rollout engines load. Tensors are the policy's own except the merged weights (new tensors). An
    Odyssey policy's merged weights are its parametrized ones (rl/learner/lora_odyssey.py)."""
    from peft.tuners.lora import LoraLayer

    from rl.learner.lora_odyssey import has_odyssey_lora, merged_odyssey_state_dict

    if has_odyssey_lora(policy):
        return merged_odyssey_state_dict(policy)

    layers = {name: m for name, m in policy.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    for k, v in policy.state_dict().items():
        if is_adapter_key(k):
            continue
        if ".base_layer." in k:
            owner, rest = k.split(".base_layer.", 1)
            k = f"{owner}.{rest}"
            if rest == "weight":
                v = v + layers[owner].get_delta_weight(ADAPTER).to(v.dtype)
        out[k] = v
    return out


def _merged_entries(policy: nn.Module) -> list[tuple[str, str, tuple[str, str, float] | None]]:
    """[(engine name, state-dict key, (lora_A key, lora_B key, scaling) | None)] in state-dict order: every
    non-adapter entry under the base model's name, with the adapter a LoRA layer's base weight merges."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in policy.named_modules() if isinstance(m, LoraLayer)}
    out = []
    for k in policy.state_dict():
        if is_adapter_key(k):
            continue
        name, merge = k, None
        if ".base_layer." in k:
            owner, rest = k.split(".base_layer.", 1)
            name = f"{owner}.{rest}"
            if rest == "weight":
                a, b = (f"{owner}.lora_{x}.{ADAPTER}.weight" for x in "AB")
                merge = (a, b, float(layers[owner].scaling[ADAPTER]))
        out.append((name, k, merge))
    return out


def iter_merged_buckets(policy: nn.Module, bucket_bytes: int,
                        cast: Callable[[str, torch.Tensor], torch.dtype | None] | None = None,
                        dst: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """`merged_state_dict(policy)` as buckets {engine name: whole CPU tensor} of at most `bucket_bytes`, for
    a policy whose parameters may be FSDP DTensors (module docstring; rl/learner/shard_export.py's plan and
    gather). A merged weight [out, in] is W + s (B A) with A = lora_A [r, in], B = lora_B [out, r] and
    s = alpha / rank, computed in W's dtype on the gathered fp32 tensors as peft's `get_delta_weight` does,
    then cast. Collective under FSDP: every rank runs the generator to the end; rank `dst` gets the tensors
    (and computes the merges), the others {}. cast(name, tensor) -> dtype or None, as iter_weight_buckets."""
    import torch.distributed as dist

    from rl.learner.lora_odyssey import has_odyssey_lora
    from rl.learner.shard_export import gather_full, plan_buckets

    if has_odyssey_lora(policy):
        raise ValueError("iter_merged_buckets serves FSDP-sharded HF policies with peft adapters; an Odyssey "
                         "policy with LoRA trains unsharded (learner.sharding=none): use merged_state_dict")

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    state = policy.state_dict()  # the live (sharded) tensors; nothing gathered yet
    entries = {name: (k, merge) for name, k, merge in _merged_entries(policy)}

    def out_dtype(name: str) -> torch.dtype:
        t = state[entries[name][0]]
        dtype = cast(name, t) if cast is not None else None
        return t.dtype if dtype is None else dtype

    sizes = [(name, state[k].numel() * out_dtype(name).itemsize) for name, (k, _) in entries.items()]
    for names in plan_buckets(sizes, bucket_bytes):
        bucket: dict[str, torch.Tensor] = {}
        for name in names:
            k, merge = entries[name]
            if merge is None:
                full = gather_full(state[k], out_dtype(name))
            else:  # gather in the stored dtype, merge, then cast (as merged_state_dict + the caller's cast)
                w = gather_full(state[k], state[k].dtype)
                a, b = (gather_full(state[x], state[x].dtype) for x in merge[:2])
                full = (w + ((b @ a) * merge[2]).to(w.dtype)).to(out_dtype(name)) if rank == dst else None
                del w, a, b
            if rank == dst:
                bucket[name] = full
            del full
        yield bucket
        del bucket


__all__ = ["ADAPTER", "adapter_state_dict", "apply_lora", "has_lora", "is_adapter_key", "iter_merged_buckets",
           "load_adapter_state_dict", "merged_state_dict"]
