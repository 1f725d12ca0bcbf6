"""`Learner`: one policy update from a batch of scored trajectories (GRPO / PPO family).

    learner = Learner(cfg)                      # policy from cfg.model (init_from or preset + learner.seed)
    metrics = learner.step(trajectories)        # {"loss", "grad_norm", "tokens", "learner/...", "moe/..."}
    engine.update_weights(learner.state_dict(), version)
    learner.save(dir); learner.load(dir)

One `step`, top to bottom:

1. prepare (rl/learner/batch.py): validate, select (masking: errors, small and all-equal groups, overlong
   filter), group advantages (grpo / rloo, with turn credit), per-token rewards (gae);
2. plan (rl/learner/sharding.py): minibatches, and each rank's share by token count;
3. first pass, without gradients, when needed: pi_old log-probs (when the policy moves within the step:
   ppo_epochs x num_minibatches > 1, or gae), reference log-probs (kl_coef > 0), old values and then GAE
   (gae), routing agreement (R3 off). With a single optimizer step and no value model pi_old is the policy
   itself, so log pi_old = log pi.detach() in the same forward (TRL does the same);
4. for each epoch, for each minibatch: pack its samples into micro-batches (first-fit decreasing, at most
   micro_batch_tokens each; a longer trajectory alone, in sequence chunks of learner.sequence_chunk_tokens
   when set, rl/learner/forward.py), forward (routing replay, bf16 autocast), loss (rl/learner/losses.py)
   with the off-policy weights (rl/learner/off_policy.py), backward (gradients accumulate); then clip the
   global grad norm, AdamW step, lr schedule step, and the MoE balancer's bias update from the routed-token
   histogram of exactly this optimizer step (summed over ranks).

MoE statistics: only the forward with gradients records (model.moe.statistics_recording is off for the
first pass, the reference model and the backward, where activation checkpointing recomputes).

Data parallelism: constructed inside an initialised torch.distributed process group (rl/learner/group.py),
the learner wraps its trainable module in DistributedDataParallel; each rank runs `update` on its own share,
every rank runs exactly one gradient-synchronising backward per optimizer step (no_sync for the others; an
idle rank runs a zero-weighted one-token forward), and the metrics are summed over ranks. With
learner.sharding=fsdp the trainable module is sharded with FSDP2 instead (rl/learner/fsdp.py): every rank
runs the same number of micro-batches per minibatch (padded with zero-weighted ones), each backward
reduce-scatters, and checkpoints and weight sync gather the whole state dict at rank 0 (collective: every
rank calls them).
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from model.hf_policy import HFPolicy
from model.moe import statistics_recording
from rl.learner.advantages import weight_negative
from rl.learner.allocator import fix_mmap_threshold
from rl.learner.batch import ModelFacts, PreparedBatch, Sample, prepare_batch
from rl.learner.estimators import estimator
from rl.learner.forward import TrainModule
from rl.learner.lora import adapter_state_dict, apply_lora, load_adapter_state_dict, merged_state_dict
from rl.learner.losses import aggregation_weights, objective, value_loss
from rl.learner.off_policy import correction_weights
from rl.learner.optim import build_optimizer, build_scheduler, clip_gradients
from rl.learner.packing import MicroBatch, collate, pack
from rl.learner.prefix_sharing import pack_shared, share_prefixes
from rl.learner.routing import expert_layout, policy_replay_agreement, routing_agreement
from rl.learner.sharding import RankPlan, plan_step
from rl.learner.value import Critic, build_value_model
from rl.policy import PolicySpec, build_policy
from rl.trajectory import Trajectory

STATE_FILE = "learner_state.pt"
POLICY_DIR = "policy"
ADAPTER_FILE = "lora_adapter.safetensors"  # learner.lora: the adapter weights (the base: the config's model)


@dataclass
class StepStats:
    """Metric sums of one policy step on one rank, summed over ranks at the end (`all_reduce`).

    sums: loss and its parts, token counts, off-policy sums; ratio_max: max of the IS ratio; agree [n_moe]:
    tokens whose learner top-k set equals the rollout's, per MoE layer, out of agree_tokens."""

    n_moe: int
    sums: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "loss",
                "policy_loss",
                "kl",
                "entropy",
                "clipped",
                "value_loss",
                "scored",
                "tokens",
                "is_tokens",
                "ratio_sum",
                "kl_sum",
                "masked",
                "truncated",
                "micro_batches",
                "sequence_chunks",
                "advantage_sum",
                "shared_tokens",
            ),
            0.0,
        )
    )
    ratio_max: float = 0.0
    agree: torch.Tensor = None
    agree_tokens: float = 0.0

    def __post_init__(self) -> None:
        self.agree = torch.zeros(self.n_moe, dtype=torch.float64)

    def keep_shard_counts_only(self, replay: bool) -> None:
        """On a context-parallel rank other than the group's first: zero what every rank of the group holds
        in full (the loss, its parts and token counts are computed on the gathered micro-batch), keeping the
        R3 agreement counts, which each rank's routers made on its own shard (replay on)."""
        self.sums = dict.fromkeys(self.sums, 0.0)
        if not replay:
            self.agree.zero_()
            self.agree_tokens = 0.0

    def all_reduce(self, device: torch.device) -> None:
        """Sum (ratio_max: max) over the ranks of the default process group, in place."""
        keys = sorted(self.sums)
        t = torch.tensor(
            [self.sums[k] for k in keys] + self.agree.tolist() + [self.agree_tokens],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(t)
        vals = t.cpu().tolist()
        self.sums = dict(zip(keys, vals[: len(keys)]))
        self.agree = torch.tensor(vals[len(keys) : len(keys) + self.n_moe], dtype=torch.float64)
        self.agree_tokens = vals[-1]
        mx = torch.tensor([self.ratio_max], dtype=torch.float64, device=device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        self.ratio_max = float(mx)


def master_policy(cfg) -> torch.nn.Module:
    """The policy in fp32 train mode (fp32 master weights whatever model.dtype says), by the one factory
    `rl.policy.build_policy`: `model.init_from` when set, else the preset initialised with `learner.seed`
    (the same weights a rollout worker builds)."""
    return build_policy(PolicySpec.from_config(cfg).replace(dtype="float32"), train=True)


def _is_hf_moe(policy: torch.nn.Module) -> bool:
    """An HF causal LM (model.hf_policy.HFPolicy) with routed experts in its config."""
    c = policy.config
    experts = (getattr(c, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return isinstance(policy, HFPolicy) and any(experts)


class Learner:
    """Policy optimisation for one rank (module docstring). cfg: rl.config.RunConfig; tokenizer: the one
    whose fingerprint the trajectories must carry (default: the policy's, model.tokenizer.policy_tokenizer:
    an HF checkpoint's own when it ships one, else the shipped tokenizer, model/assets/tokenizer)."""

    def __init__(self, cfg, tokenizer: Any = None) -> None:
        from model.tokenizer import policy_tokenizer, tokenizer_fingerprint

        self.cfg = cfg
        lc = self.lc = cfg.learner
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.world_size != lc.num_ranks:
            raise ValueError(
                f"learner.num_ranks is {lc.num_ranks} but this process runs {self.world_size} rank(s): use "
                "rl.learner.group.LearnerGroup(cfg) for data parallelism (it starts num_ranks actors), or "
                f"set learner.num_ranks={self.world_size}"
            )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.policy = master_policy(cfg)
        if lc.lora is not None:  # adapters only train; the base weights are frozen (rl/learner/lora.py)
            apply_lora(self.policy, lc.lora, seed=lc.seed)
        self.policy = self.policy.to(self.device)
        if lc.activation_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.estimator = estimator(lc.advantage)
        value = None
        if self.estimator.needs_values:
            value = build_value_model(lc.value_model, self.policy, lc.critic_preset, lc.seed).to(self.device)
            if lc.activation_checkpointing and isinstance(value, Critic):
                value.trunk.gradient_checkpointing_enable()
        self.cp_group, self.cp_rank = self._context_parallel_group(lc.context_parallel)
        self.module = TrainModule(self.policy, value, lc.sequence_chunk_tokens, self.cp_group).train()
        if lc.sequence_chunk_tokens:  # long sequences: freed window activations go back to the OS
            fix_mmap_threshold()
        self.reference = None
        if lc.kl_coef > 0:
            ref = master_policy(cfg).to(self.device).eval()
            ref.requires_grad_(False)
            self.reference = TrainModule(ref, sequence_chunk_tokens=lc.sequence_chunk_tokens,
                                         context_parallel_group=self.cp_group)
        self.ddp = self.module
        # any sharded layout (fsdp, ep, fsdp+ep; rl/learner/fsdp.py): collective state gathers, equal
        # micro-batch counts on every rank
        self.fsdp = self.distributed and lc.sharding != "none"
        if self.fsdp:  # parameters, gradients and AdamW state sharded over the ranks (rl/learner/fsdp.py)
            from rl.learner.fsdp import shard_learner_module

            self.ddp = shard_learner_module(self.module, self.device, lc.sharding, lc.fsdp_param_dtype,
                                            lc.fsdp_reduce_dtype)
            self.module.sync_windows = True  # as many sequence-chunk windows per forward on every rank
        elif self.distributed:
            with warnings.catch_warnings():  # torch deprecates broadcast_buffers; its replacement is not
                # equivalent yet (it syncs at init), so keep it and keep every run's log free of the warning
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
                # the patch embedding takes part only in micro-batches with images: on a text-only batch
                # (or rank) it gets no gradient, which the reducer must expect
                vision = getattr(getattr(self.policy, "model", None), "vision", None) is not None
                self.ddp = DistributedDataParallel(self.module, broadcast_buffers=False,
                                                   find_unused_parameters=vision)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, lc)
        self.scheduler = build_scheduler(self.optimizer, lc)
        tok = tokenizer if tokenizer is not None else policy_tokenizer(cfg.model.checkpoint)
        mc = self.policy.config
        n_moe = len(self.policy.moe_layer_indices)  # HF MoE: model/hf_routing.py (0: router unknown)
        n_experts, top_k = expert_layout(self.policy)
        self.facts = ModelFacts(
            vocab_size=mc.vocab_size,
            n_moe_layers=n_moe,
            n_experts=n_experts,
            top_k=top_k,
            tokenizer=tokenizer_fingerprint(tok),
            vision_patch_size=int(getattr(mc, "vision_patch_size", 0) or 0),  # 0: HF models read text only
        )
        self.autocast_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
        self.replay = lc.routing_replay and self.facts.n_moe_layers > 0  # R3 (a dense model has no routing)
        if lc.routing_replay and _is_hf_moe(self.policy) and not n_moe:
            name = type(self.policy.hf).__name__
            warnings.warn(f"learner.routing_replay does not apply to {name} (an HF MoE "
                          "whose router model/hf_routing.py does not know): its rollout routing is not "
                          "recorded, so the learner routes freely and reports no moe/ or routing metrics "
                          "(docs/hf.md)",
                          stacklevel=2)
        # a group's common prompt once per micro-batch: attention that reads every earlier token (HF packed
        # SDPA) only, and no separate critic trunk reading the same layout
        self.share = (lc.share_prefixes and isinstance(self.policy, HFPolicy) and self.policy.packed_attention
                      and not isinstance(value, Critic))
        self.policy_steps = 0  # completed step() / update() calls
        self.optimizer_steps = 0
        # what the current step has summed (step() starts a fresh one; a bare accumulate() adds to this)
        self._stats = StepStats(len(self.policy.moe_layer_indices))

    def _context_parallel_group(self, R: int) -> tuple[Any, int]:
        """(this rank's context-parallel process group | None, its rank in it). Ranks r // R share a group
        (every rank creates every group, as torch.distributed requires)."""
        if R == 1:
            return None, 0
        # num_ranks is a multiple of R (config check) and equals world_size (checked above)
        groups = [dist.new_group(list(range(g * R, (g + 1) * R))) for g in range(self.world_size // R)]
        return groups[self.rank // R], self.rank % R

    # ------------------------------------------------------------------------------------------ public API
    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One policy step on a batch of scored trajectories -> metrics (at least loss, grad_norm, tokens).
        Single rank; a LearnerGroup calls `prepare` on the driver and `update` on every rank instead."""
        batch = self.prepare(trajectories)
        plan = plan_step(batch.samples, self.lc.num_minibatches, 1, self.lc.seed + self.policy_steps,
                         batch.extra_tokens, batch.extra_episodes)[0]
        return self.update(batch.samples, plan, batch.metrics)

    def prepare(self, trajectories: Sequence[Trajectory]) -> PreparedBatch:
        """Validation, selection and group advantages (rl/learner/batch.py)."""
        return prepare_batch(trajectories, self.facts, self.lc)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights for the rollout engines (weight sync): CPU copies, floating parameters in
        model.dtype (the router biases stay fp32, as the model keeps them). With learner.lora the adapters
        are merged into their base weights, under the base model's names (rl/learner/lora.py)."""
        if self.lc.lora is not None and self.fsdp:  # gathered at rank 0 and merged there (collective)
            return {k: v for b in self.weight_buckets(1 << 62) for k, v in b.items()}
        weights = merged_state_dict(self.policy) if self.lc.lora is not None else self._policy_state()
        return {k: v.detach().to("cpu", dtype=self._engine_dtype(k, v), copy=True)
                for k, v in weights.items()}

    def _engine_dtype(self, name: str, t: torch.Tensor) -> torch.dtype | None:
        """The dtype the engines get `name` in: model.dtype for floating weights; None (the tensor's own) for
        the rest and the router biases, which the model keeps fp32."""
        if not t.is_floating_point() or name.endswith("e_score_correction_bias"):
            return None
        return torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """`state_dict()` in buckets of at most `bucket_bytes` (rl/learner/shard_export.py): under FSDP each
        bucket is gathered alone, so no rank holds more than one bucket of the whole model. Collective under
        FSDP: every rank runs the generator to the end; rank 0 gets the tensors, the others {}."""
        from rl.learner.shard_export import iter_weight_buckets

        if self.lc.lora is not None:  # merged adapters (rl/learner/lora.py)
            if self.fsdp:
                from rl.learner.lora import iter_merged_buckets

                yield from iter_merged_buckets(self.policy, bucket_bytes, cast=self._engine_dtype)
            else:  # one rank's dict, one bucket
                yield self.state_dict()
            return
        yield from iter_weight_buckets(self.policy, bucket_bytes, cast=self._engine_dtype)

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's whole state dict: gathered at rank 0 under FSDP (collective; {} on the others)."""
        if not self.fsdp:
            return self.policy.state_dict()
        from rl.learner.fsdp import full_state_dict

        return full_state_dict(self.policy)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the trainable parameters, their gradients and the AdamW state (its shards
        under FSDP)."""
        from rl.learner.fsdp import local_bytes

        return local_bytes(self.module, self.optimizer)

    def save(self, path: str | Path) -> Path:
        """Write the policy (save_pretrained: rollouts can start from it, model.init_from=<path>/policy), the
        value model, optimizer, scheduler, counters and RNG states to `path`. The balancer's state is the
        router biases, which are model buffers. With learner.lora only the adapter weights are written
        (ADAPTER_FILE): the frozen base is the config's model."""
        path = Path(path)
        value, optimizer = self.module.value, self.optimizer.state_dict
        if self.fsdp:  # gather everything at rank 0 (every rank takes part); only rank 0 writes
            from rl.learner.fsdp import full_optimizer_state_dict, full_state_dict

            lora = self.lc.lora is not None  # the adapters alone, gathered whole (rl/learner/lora.py)
            policy_sd = adapter_state_dict(self.policy) if lora else full_state_dict(self.policy)
            value_sd = full_state_dict(value) if value is not None else None
            optim_sd = full_optimizer_state_dict(self.module, self.optimizer)
            if self.rank != 0:
                return path
            path.mkdir(parents=True, exist_ok=True)
            if lora:
                from safetensors.torch import save_file

                save_file(policy_sd, str(path / ADAPTER_FILE))
            else:
                self.policy.save_pretrained(path / POLICY_DIR, state_dict=policy_sd)
        else:
            path.mkdir(parents=True, exist_ok=True)
            if self.lc.lora is not None:
                from safetensors.torch import save_file

                save_file(adapter_state_dict(self.policy), str(path / ADAPTER_FILE))
            else:
                self.policy.save_pretrained(path / POLICY_DIR)
            value_sd = value.state_dict() if value is not None else None
            optim_sd = optimizer()
        state = {
            "value": value_sd,
            "optimizer": optim_sd,
            "sharding": "fsdp" if self.fsdp else "none",  # the optimizer state's layout
            "scheduler": self.scheduler.state_dict(),
            "policy_steps": self.policy_steps,
            "optimizer_steps": self.optimizer_steps,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            "learner_config": self.lc.model_dump(mode="json"),
            "expert_load": [moe.load_tracker.state_dict() for moe in self.policy.moe_layers()],
        }
        torch.save(state, path / STATE_FILE)
        return path

    def load(self, path: str | Path) -> None:
        """Restore everything `save` wrote (the learner must be built from the same config)."""
        path = Path(path)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{path} holds no learner checkpoint ({STATE_FILE}); was it written by Learner.save?"
            )
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        layout = "fsdp" if self.fsdp else "none"
        saved_layout = state.get("sharding", "none")
        if saved_layout != layout:
            raise ValueError(f"{path} was saved by a learner with learner.sharding={saved_layout!r} (its "
                             f"optimizer state is laid out for it) but this one has {layout!r}; resume with "
                             f"learner.sharding={saved_layout}, or start from its policy alone "
                             f"(model.init_from={path / POLICY_DIR})")
        if self.fsdp:  # every rank reads the whole checkpoint and keeps its shard
            from rl.learner.fsdp import load_full_optimizer_state_dict, load_full_state_dict

            if self.lc.lora is not None:  # each rank keeps its shard of the saved adapters
                self._load_adapter(path, state)
            else:
                saved = type(self.policy).from_pretrained(str(path / POLICY_DIR), dtype=torch.float32)
                load_full_state_dict(self.policy, saved.state_dict())
            if state["value"] is not None:
                load_full_state_dict(self.module.value, state["value"])
            load_full_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        else:
            if self.lc.lora is not None:
                self._load_adapter(path, state)
            else:
                saved = type(self.policy).from_pretrained(str(path / POLICY_DIR), dtype=torch.float32)
                self.policy.load_state_dict(saved.state_dict())  # in place: the optimizer keeps its params
            if state["value"] is not None:
                self.module.value.load_state_dict(state["value"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_steps, self.optimizer_steps = state["policy_steps"], state["optimizer_steps"]
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        for moe, tracker in zip(self.policy.moe_layers(), state.get("expert_load", [])):  # absent: older
            moe.load_tracker.load_state_dict(tracker)

    def _load_adapter(self, path: Path, state: dict[str, Any]) -> None:
        """Load `path`'s ADAPTER_FILE into the policy's LoRA layers in place (each rank its shard under FSDP),
        refusing a checkpoint written with another learner.lora."""
        from safetensors.torch import load_file

        saved_lora = state.get("learner_config", {}).get("lora")
        if not (path / ADAPTER_FILE).is_file() or saved_lora != self.lc.lora.model_dump(mode="json"):
            raise ValueError(
                f"{path} holds no LoRA adapter of this learner.lora ({self.lc.lora.model_dump()}; "
                f"the checkpoint's: {saved_lora}): resume with the learner.lora it was written with")
        load_adapter_state_dict(self.policy, load_file(str(path / ADAPTER_FILE)))

    # ------------------------------------------------------------------------------------------ the update
    def update(
        self, samples: Sequence[Sample], plan: RankPlan, metrics: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Run this rank's share of a policy step: `samples` (its own), `plan` (its RankPlan). Collective
        under torch.distributed: every rank calls it once per step. Returns global metrics."""
        t0 = time.perf_counter()
        lc = self.lc
        by_index = {s.index: s for s in samples}
        n_moe = len(self.policy.moe_layer_indices)
        stats = self._stats = StepStats(n_moe)
        fused_old = lc.ppo_epochs * lc.num_minibatches == 1 and not self.estimator.needs_values
        measure_routing = not self.replay and n_moe > 0
        if not fused_old or lc.kl_coef > 0:
            self._first_pass(
                samples,
                old=not fused_old,
                ref=lc.kl_coef > 0,
                values=self.estimator.needs_values,
                routing=measure_routing and not fused_old,
            )
        if self.estimator.needs_values:
            for s in samples:
                rewards, values = torch.from_numpy(s.rewards), torch.from_numpy(s.old_values)
                adv, ret = self.estimator.compute(rewards, values, lc)
                s.advantages, s.returns = adv.numpy(), ret.numpy()
                stats.sums["advantage_sum"] += float(adv.sum())
        losses, norms = [], []
        # Odyssey's LatentMoE layers (their balancing bias); an HF MoE has no Odyssey bias
        moe_layers = [] if isinstance(self.policy, HFPolicy) else self.policy.moe_layers()
        replayed = [0.0]  # R3: tokens whose free routing was compared with the replayed experts
        with policy_replay_agreement(self.policy, self.replay, stats.agree, replayed):
            for epoch in range(lc.ppo_epochs):
                for m, ids in enumerate(plan.minibatches):
                    loss, norm = self._optimizer_step(
                        [by_index[i] for i in ids],
                        plan.n_tokens[m],
                        plan.n_episodes[m],
                        fused_old,
                        first_epoch=epoch == 0,
                        routing=measure_routing and fused_old,
                    )
                    losses.append(loss)
                    norms.append(norm)
        stats.agree_tokens += replayed[0]
        self.policy_steps += 1
        stats.sums["tokens"] = float(sum(s.n_tokens for s in samples))
        if self.cp_rank:  # every rank of a context-parallel group computed the same loss and counts
            stats.keep_shard_counts_only(replay=self.replay)
        if self.distributed:
            stats.all_reduce(self.device if dist.get_backend() == "nccl" else torch.device("cpu"))
        sums = stats.sums
        out = dict(metrics or {})
        n_opt = max(1, len(losses))
        scored = max(sums["scored"], 1.0)
        is_tokens = max(sums["is_tokens"], 1.0)
        out.update(
            {
                "loss": sums["loss"] / n_opt,
                "grad_norm": float(np.mean(norms)) if norms else 0.0,
                "tokens": sums["tokens"],
                "learner/tokens_scored": sums["scored"],
                "learner/optimizer_steps": float(len(losses)),
                "learner/micro_batches": sums["micro_batches"],
                "learner/sequence_chunks": sums["sequence_chunks"],
                # tokens a shared prefix spared the forward (counted once per epoch; prefix_sharing.py)
                "learner/shared_prefix_tokens": sums["shared_tokens"],
                "learner/lr": float(self.scheduler.get_last_lr()[0]),
                "learner/policy_loss": sums["policy_loss"] / n_opt,
                "learner/kl": sums["kl"] / scored,
                "learner/entropy": sums["entropy"] / scored,
                "learner/clip_frac": sums["clipped"] / scored,
                "learner/offpolicy_kl": sums["kl_sum"] / is_tokens,
                "learner/offpolicy_ratio_mean": sums["ratio_sum"] / is_tokens,
                "learner/offpolicy_ratio_max": stats.ratio_max,
                "learner/offpolicy_masked_frac": sums["masked"] / is_tokens,
                "learner/offpolicy_truncated_frac": sums["truncated"] / is_tokens,
                "learner/step_s": time.perf_counter() - t0,
            }
        )
        if self.estimator.needs_values:
            out["learner/value_loss"] = sums["value_loss"] / n_opt
            out["learner/advantage_mean"] = sums["advantage_sum"] / scored
        if stats.agree_tokens > 0:  # R3 off: learner vs rollout; R3 on: free routing vs the replayed experts
            frac = (stats.agree / stats.agree_tokens).tolist()
            for l, f in zip(self.policy.moe_layer_indices, frac):
                out[f"learner/routing_agreement/layer{l}"] = f
            out["learner/routing_agreement"] = float(np.mean(frac))
            if self.replay:
                out["learner/replay_changed"] = 1.0 - out["learner/routing_agreement"]
        for l, moe in zip(self.policy.moe_layer_indices, moe_layers):  # the balancer's bias b after the step
            out[f"moe/layer{l}/bias_range"] = float(moe.bias.max() - moe.bias.min())
        if moe_layers:
            out["moe/bias_range_max"] = max(float(moe.bias.max() - moe.bias.min()) for moe in moe_layers)
        out["learner/tokens_per_s"] = out["tokens"] * lc.ppo_epochs / max(out["learner/step_s"], 1e-9)
        out.update(
            {k: float(v) for k, v in self.policy.expert_load_metrics().items() if isinstance(v, (int, float))}
        )
        return out

    # ------------------------------------------------------------------------------------------ internals
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _bins(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Micro-batches of `samples` (indices): first-fit decreasing, a sharing group kept together."""
        if self.share:
            return pack_shared(samples, self.lc.micro_batch_tokens)
        return pack([s.n_tokens for s in samples], self.lc.micro_batch_tokens)

    def _collate(self, samples: Sequence[Sample], fields: Sequence[str], routing: bool) -> MicroBatch:
        with_replay = (self.replay or routing) and all(s.replay is not None for s in samples)
        mb = collate(samples, fields, with_replay=with_replay, patch_size=self.facts.vision_patch_size)
        return share_prefixes(mb, samples) if self.share else mb

    @torch.no_grad()
    def _first_pass(
        self, samples: Sequence[Sample], old: bool, ref: bool, values: bool, routing: bool
    ) -> None:
        """Fill old_logp / ref_logp / old_values of `samples` and count routing agreement (no gradients,
        no MoE statistics)."""
        bins = self._bins(samples)
        if self.fsdp and (old or values or routing):  # every rank runs as many sharded forwards
            for _ in range(self._most_micro_batches(len(bins)) - len(bins)):
                self._idle_forward()
        modules = [self.module] + ([self.reference] if self.reference is not None else [])
        with contextlib.ExitStack() as stack:
            for m in modules:
                stack.enter_context(statistics_recording(m, False))
            for b in bins:
                group = [samples[i] for i in b]
                mb = self._collate(group, (), routing)
                sizes = mb.seq_tokens.tolist()
                if old or values or routing:
                    with self._autocast():
                        out = self.module(
                            mb,
                            replay=self.replay,
                            values=values,
                            return_routed=routing and mb.replay is not None,
                        )
                    for s, lp in zip(group, out.logp.double().split(sizes)):
                        s.old_logp = lp.cpu().numpy()
                    if values:
                        for s, v in zip(group, out.values.double().split(sizes)):
                            s.old_values = v.cpu().numpy()
                    if out.routed is not None:
                        self._count_agreement(out.routed, mb.replay)
                if ref:
                    with self._autocast():
                        rout = self.reference(mb, replay=self.replay)
                    for s, lp in zip(group, rout.logp.double().split(sizes)):
                        s.ref_logp = lp.cpu().numpy()

    def _count_agreement(self, routed: torch.Tensor, recorded: torch.Tensor) -> None:
        self._stats.agree += routing_agreement(routed, recorded).double().cpu()
        self._stats.agree_tokens += float(routed.shape[0])

    def _optimizer_step(
        self,
        samples: list[Sample],
        n_tokens: float,
        n_episodes: float,
        fused_old: bool,
        first_epoch: bool,
        routing: bool,
    ) -> tuple[float, float]:
        """One optimizer step on this rank's share of a minibatch: accumulate, clip, AdamW, schedule, MoE
        bias update. Returns (this rank's part of the minibatch loss, grad norm before clipping)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(samples, n_tokens, n_episodes, fused_old, first_epoch, routing)
        norm = clip_gradients(self.params, self.lc.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        self.policy.update_router_biases()
        if isinstance(self.module.value, Critic):
            for moe in self.module.value.moe_layers():
                moe.update_bias()
        self._stats.sums["loss"] += loss
        return loss, norm

    def accumulate(
        self,
        samples: Sequence[Sample],
        n_tokens: float,
        n_episodes: float,
        fused_old: bool = True,
        first_epoch: bool = True,
        routing: bool = False,
    ) -> float:
        """Forward and backward every packed micro-batch of `samples` (gradients add up in .grad; under DDP
        they are averaged over ranks at the last micro-batch). n_tokens / n_episodes: the minibatch's, over
        all ranks. Returns this rank's part of the minibatch loss."""
        bins = self._bins(samples)
        if self.fsdp:  # every rank runs as many sharded forwards and backwards (rl/learner/fsdp.py)
            for _ in range(self._most_micro_batches(len(bins)) - len(bins)):
                self._idle_backward()
        elif not bins and self.distributed:
            self._idle_backward()
        total = 0.0
        for j, b in enumerate(bins):
            mb = self._collate([samples[i] for i in b], self.token_fields(fused_old), routing)
            self._stats.sums["shared_tokens"] += float(sum(samples[i].n_tokens for i in b) - mb.n_tokens)
            total += self.backward_micro_batch(
                mb,
                n_tokens,
                n_episodes,
                sync=j == len(bins) - 1,
                fused_old=fused_old,
                first_epoch=first_epoch,
                routing=routing,
            )
        return total

    def token_fields(self, fused_old: bool = True) -> list[str]:
        """The per-scored-token sample fields the loss reads (MicroBatch.data)."""
        fields = ["rollout_logp", "advantages"]
        fields += [] if fused_old else ["old_logp"]
        fields += ["ref_logp"] if self.reference is not None else []
        fields += ["old_values", "returns"] if self.estimator.needs_values else []
        return fields

    def backward_micro_batch(
        self,
        mb: MicroBatch,
        n_tokens: float,
        n_episodes: float,
        *,
        sync: bool = True,
        fused_old: bool = True,
        first_epoch: bool = True,
        routing: bool = False,
    ) -> float:
        """Forward, loss and backward of one micro-batch (with `token_fields` in mb.data): the unit every
        update is made of, and the seam where a trajectory split into sequence chunks will be processed.
        sync: under DDP, whether this backward averages the gradients over ranks (the last micro-batch
        of a minibatch). Returns this micro-batch's part of the minibatch loss."""
        # FSDP reduce-scatters every backward; under sharding=ep DDP all-reduces every one too (each rank runs
        # as many, its zero-weighted padding passes included)
        no_sync = self.distributed and not sync and not self.fsdp
        with self.ddp.no_sync() if no_sync else contextlib.nullcontext():
            loss = self._micro_batch_loss(mb, n_tokens, n_episodes, fused_old, first_epoch, routing)
            with statistics_recording(self.module, False):  # checkpoint recomputation must not record
                (loss * self.world_size).backward()
        return float(loss.detach())

    def _most_micro_batches(self, n: int) -> int:
        """The most micro-batches any rank has (this one has n): the max over the process group."""
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([n], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    @torch.no_grad()
    def _idle_forward(self) -> None:
        """A no-gradient one-token forward (no MoE statistics): an FSDP rank's share of the all-gathers of a
        first-pass micro-batch it does not have."""
        with statistics_recording(self.module, False), self._autocast():
            self.ddp(self._idle_micro_batch(), values=self.module.value is not None)

    @staticmethod
    def _idle_micro_batch() -> MicroBatch:
        """One token (id 0), scored, no data: what an idle rank runs to join the collectives."""
        z = torch.zeros(1, dtype=torch.int64)
        return MicroBatch(
            input_ids=z,
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            replay=None,
            scored_pos=z,
            targets=z,
            seq=z,
            seq_tokens=torch.ones(1, dtype=torch.int64),
            data={},
        )

    def _idle_backward(self) -> None:
        """A rank without samples in a minibatch still joins the gradient all-reduce: a one-token forward
        whose loss is multiplied by 0 (no MoE statistics), so its contribution is exactly zero."""
        mb = self._idle_micro_batch()
        with statistics_recording(self.module, False):
            with self._autocast():
                out = self.ddp(mb, values=self.module.value is not None)
            loss = out.logp.sum() * 0.0
            if out.values is not None:
                loss = loss + out.values.sum() * 0.0
            loss.backward()

    def _micro_batch_loss(
        self,
        mb: MicroBatch,
        n_tokens: float,
        n_episodes: float,
        fused_old: bool,
        first_epoch: bool,
        routing: bool,
    ) -> torch.Tensor:
        """The loss of one packed micro-batch (rl/learner/losses.py), scaled so that the sum over the
        minibatch's micro-batches and ranks is the minibatch loss. Accumulates metric sums."""
        lc = self.lc
        stats = self._stats
        sums = stats.sums
        data = {k: v.to(self.device) for k, v in mb.data.items()}
        seq, seq_tokens = mb.seq.to(self.device), mb.seq_tokens.to(self.device)
        with self._autocast():
            out = self.ddp(
                mb,
                replay=self.replay,
                values=self.estimator.needs_values,
                return_routed=routing and mb.replay is not None,
            )
        if out.routed is not None:
            self._count_agreement(out.routed, mb.replay)
        logp = out.logp.double()
        old = logp.detach() if fused_old else data["old_logp"]
        is_w, off = correction_weights(
            old, data["rollout_logp"], seq, seq_tokens.numel(), lc.tis_cap, lc.mis_band, lc.mis_level
        )
        c = aggregation_weights(
            lc.loss_agg, seq, seq_tokens, n_episodes, n_tokens, self.cfg.rollout.max_tokens
        ).to(self.device)
        entropy = out.entropy.double()
        loss, parts = objective(
            logp,
            old,
            weight_negative(data["advantages"], lc.negative_advantage_weight),
            seq,
            seq_tokens,
            c,
            n_tokens,
            policy=lc.policy_loss,
            clip_eps_low=lc.clip_eps_low,
            clip_eps_high=lc.clip_eps_high,
            is_weights=is_w,
            ref_logp=data.get("ref_logp"),
            kl_coef=lc.kl_coef,
            kl_estimator=lc.kl_estimator,
            entropy=entropy,
            entropy_coef=lc.entropy_coef,
        )
        vl = None
        if self.estimator.needs_values:
            vl = value_loss(out.values.double(), data["old_values"], data["returns"], lc.value_clip)
            loss = loss + lc.value_coef * vl.sum() / n_tokens
        if out.aux is not None:
            loss = loss + out.aux.double() * (mb.n_scored / n_tokens)
        kl, clipped = parts["kl"], parts["clipped"]
        sums["policy_loss"] += float(parts["policy"])
        if vl is not None:
            sums["value_loss"] += float(vl.detach().sum() / n_tokens)
        if first_epoch:
            sums["micro_batches"] += 1
            sums["sequence_chunks"] += self.module.chunks(mb)
            sums["scored"] += mb.n_scored
            sums["entropy"] += float(entropy.detach().sum())
            sums["clipped"] += float(clipped.sum())
            if kl is not None:
                sums["kl"] += float(kl.detach().sum())
            for k in ("ratio_sum", "kl_sum", "masked", "truncated"):
                sums[k] += float(off[k])
            sums["is_tokens"] += float(off["tokens"])
            stats.ratio_max = max(stats.ratio_max, float(off["ratio_max"]))
        return loss


__all__ = ["Learner", "StepStats", "master_policy", "STATE_FILE", "POLICY_DIR", "ADAPTER_FILE"]
