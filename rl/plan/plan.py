"""`odyssey plan`: how many GPUs an RL run of a model needs, and how long a step takes.

    p = make_plan(config, Workload(context=1 << 20, episodes=64, group_size=8, chunk=4096),
                  Cluster(gpu_memory_gb=141, peak_tflops=989, link_gb_s=50, mfu=0.4), ranks=None, ep=None)

Learner (per rank, rl/plan/state.py and rl/plan/activations.py):

    total(W) = params(W) + grads(W) + optimizer(W)     (exact FSDP2 shards of the meta model, 16 B/param / W)
             + gather                                  (two all-gathered units + one unsharded gradient)
             + activations                             (the layouts the learner runs, below)
    minimum W: the smallest multiple of ep (ep | n_routed_experts) and cp with total(W) <= usable GPU
    memory, usable = gpu_memory * (1 - reserve), over cp = 1, 2, 4, ... (`CP_DEGREES`, or the given one).
    ep defaults to W itself (every rank an expert-parallel rank, the experts never all-gathered) when that
    divides the experts, else the largest divisor of the experts <= W.

    activations, only layouts the config accepts (rl/config/checks.py):
      cp = 1   window_bytes: one trajectory in windows of `chunk` tokens, every layer checkpointed
               (learner.sequence_chunk_tokens + learner.activation_checkpointing);
      cp > 1   context_parallel_bytes: the largest rank of a cp group holding one trajectory cut into cp
               shards, each run unchunked, layer-major, every layer checkpointed (learner.context_parallel +
               learner.activation_checkpointing: the rank holds every layer's input [L / cp, D] and
               recomputes one layer at a time, its exchanges included; sequence chunking inside a shard is
               refused).
    When no layout fits, the plan refuses and names what it would need (`no_fit_message`), with the longest
    trajectory that today's layouts fit.

Rollout (vLLM on GPUs; per engine of G GPUs):

    attention TP t = the largest divisor of the KDA and MLA head counts <= min(G, 8) (one node);
    experts EP over all G GPUs (G | n_routed_experts); the rest of the weights sharded over t, replicated
    over the G / t data-parallel attention groups;
    weights / GPU = 2 B * (non-expert / t + experts / G)
    cache / sequence (model/cache.py cache_bytes, bf16 latents, fp32 KDA state): the MLA latent of every
    token (n_mla * context * R * 2 B, replicated on the t ranks of a group: MLA heads share the latent),
    the KDA state split over t;
    minimum G: the smallest G (a divisor of the experts) whose GPUs hold the weights and one full-context
    sequence; engines for a step: the GPUs that hold `episodes` full-context sequences at once.

Step time at `mfu` of `peak_tflops` per GPU (compute only, communication reported on its own):

    learner FLOPs = 6 * active params * tokens + attention,   tokens = episodes * context
    attention (per token, forward; x3 with the backward): MLA 2 * 2 * Hm * hd * context / 2 (causal QK^T
    and PV) per MLA layer; KDA 2 * 2 * H * K * K (state update and readout) + 2 * 2 * H * K * chunk / 2
    (intra-chunk) per KDA layer;
    learner time = FLOPs / (W * peak * mfu); rollout prefill FLOPs = 2 * active * tokens + forward attention.
    communication per learner step and rank (link_gb_s, one direction): each window (cp = 1) all-gathers every
    unit three times (forward, recomputed forward, backward: 2 B / param, what this rank receives), each
    checkpointed shard (cp > 1) three times too, and reduces-scatters its gradient once (4 B / param),
    plus the MoE all-to-all (tokens x k latent rows, out and back, per forward pass and backward) under EP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from model.cache import cache_bytes
from model.config import OdysseyConfig
from model.count import count_parameters
from rl.plan.activations import ACT_BYTES, context_parallel_bytes, window_bytes
from rl.plan.state import Shapes, meta_policy, model_shapes, rank_state

GB = 1e9
CP_DEGREES = [2 ** i for i in range(17)]  # context-parallel degrees the search tries (1 .. 65536)
LIMIT = 1 << 16  # the largest learner the search tries


@dataclass
class Workload:
    """What one RL step trains on: `episodes` trajectories of `context` tokens (GRPO groups of
    `group_size`), run by the learner in windows of `chunk` tokens; `capacity`: MoE expert-load imbalance."""

    context: int = 1 << 20
    episodes: int = 64
    group_size: int = 8
    chunk: int = 4096
    capacity: float = 1.0

    def __post_init__(self) -> None:
        for name in ("context", "episodes", "group_size", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.episodes % self.group_size:
            raise ValueError(f"episodes ({self.episodes}) must be a multiple of group_size "
                             f"({self.group_size}): a step trains on whole GRPO groups")
        if self.capacity < 1:
            raise ValueError(f"capacity (most-loaded expert / mean) must be >= 1, got {self.capacity}")


@dataclass
class Cluster:
    """GPUs: memory (GB, 1e9 B), dense bf16 peak (TFLOP/s), inter-node link per GPU (GB/s), the MFU the step
    time assumes, and the share of memory left to the runtime (CUDA context, NCCL buffers, fragmentation)."""

    gpu_memory_gb: float = 141.0
    peak_tflops: float = 989.0
    link_gb_s: float = 50.0
    mfu: float = 0.4
    reserve: float = 0.1
    gpus: int | None = None  # the cluster's GPU count, if given: the plan says whether it fits

    @property
    def usable(self) -> float:
        return self.gpu_memory_gb * GB * (1 - self.reserve)


GPUS = {"h200": Cluster(141.0, 989.0), "h100": Cluster(80.0, 989.0)}


@dataclass
class Plan:
    """Everything `odyssey plan` prints (to_dict for --json)."""

    model: dict[str, Any]
    workload: dict[str, Any]
    cluster: dict[str, Any]
    learner: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)
    step: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_ep(config: OdysseyConfig, ranks: int) -> int:
    """The largest divisor of both the routed experts and `ranks` (1 without experts)."""
    n = config.n_routed_experts
    return max(d for d in _divisors(ranks) if n and n % d == 0) if n else 1


def learner_rank(config: OdysseyConfig, w: Workload, ranks: int, ep: int | None, model: Shapes,
                 param_bytes: int = 2, cp: int = 1) -> dict[str, Any]:
    """One rank of a W-rank learner: state (exact shards), transient gather, activations; bytes. cp:
    context parallelism (learner.context_parallel): cp = 1 runs each trajectory in windows of w.chunk with
    every layer checkpointed (`window_bytes`); cp > 1 cuts it into cp contiguous shards, one per rank, each
    run unchunked with every layer checkpointed (`context_parallel_bytes`, its largest rank): the layouts
    the learner runs (module docstring)."""
    if cp < 1 or ranks % cp:
        raise ValueError(f"context parallelism cp={cp} must be >= 1 and divide the learner ranks ({ranks})")
    if cp > w.context:
        raise ValueError(f"context parallelism cp={cp} cuts a {w.context}-token trajectory into empty shards")
    ep = default_ep(config, ranks) if ep is None else ep
    key = ("state", ranks, ep, param_bytes)  # memoised on the Shapes (the searches revisit layouts)
    if key not in model.memo:
        model.memo[key] = rank_state(config, ranks, ep, param_bytes=param_bytes, shapes=model)
    s = model.memo[key]
    key = ("activations", w.context, w.chunk, w.capacity, cp)
    if key not in model.memo:
        model.memo[key] = (window_bytes(config, w.context, w.chunk, w.capacity) if cp == 1
                           else context_parallel_bytes(config, w.context, cp, w.capacity, checkpointed=True))
    act = model.memo[key]
    total = s.at_rest + s.gather + act.total
    return {"ranks": ranks, "ep": ep, "cp": cp, "params": s.params, "grads": s.grads,
            "optimizer": s.optimizer,
            "gather": s.gather, "activations": act.total, "activation_parts": act.to_dict(), "total": total,
            "largest_unit_params": s.largest_unit,
            "layout": "windows" if cp == 1 else "checkpointed context-parallel shards"}


def min_learner_ranks(config: OdysseyConfig, w: Workload, cluster: Cluster, model: Shapes,
                      ep: int | None = None, cp: int | None = None, limit: int = LIMIT
                      ) -> dict[str, Any] | None:
    """The smallest W (module docstring) whose largest rank fits `cluster.usable`, over context-parallel
    degrees `CP_DEGREES` up to `limit` and the trajectory length (or the given one); None if none fits up to
    `limit` ranks."""
    best = None
    for c in [cp] if cp else [d for d in CP_DEGREES if d <= min(limit, w.context)]:
        r = _min_ranks(config, w, cluster, model, ep, c, limit)
        if r is not None and (best is None or r["ranks"] < best["ranks"]):
            best = r
    return best


def _min_ranks(config: OdysseyConfig, w: Workload, cluster: Cluster, model: Shapes, ep: int | None, cp: int,
               limit: int) -> dict[str, Any] | None:
    usable = cluster.usable
    if learner_rank(config, w, cp, ep if ep is not None and cp % ep == 0 else 1, model, cp=cp
                    )["activations"] > usable:
        return None  # the activations of this layout do not shrink with W
    W = cp
    best = None
    while W <= limit:  # total(W) falls as 1/W: double, then scan the last interval
        if ep is None or W % ep == 0:
            r = learner_rank(config, w, W, ep, model, cp=cp)
            if r["total"] <= usable:
                best = r
                break
        W *= 2
    if best is None:
        return None
    step = math.lcm(ep or 1, cp)
    # the first fitting W in (W/2, W], or below it a multiple of the expert count (ep = every expert its own
    # rank can fit where a power of two, sharing experts, does not)
    whole = math.lcm(step, config.n_routed_experts or 1)
    cands = sorted(set(range(max(W // 2, step), W, step)) | set(range(whole, W, whole)))
    for cand in cands:
        r = learner_rank(config, w, cand, ep, model, cp=cp)
        if r["total"] <= usable:
            return r
    return best


def attention_tp(config: OdysseyConfig, gpus: int) -> int:
    """The largest divisor of both head counts that is <= min(gpus, 8) (tensor parallelism inside a node)."""
    heads = math.gcd(config.kda_num_heads, config.mla_num_heads)
    return max(d for d in _divisors(heads) if d <= min(gpus, 8))


def rollout_engine(config: OdysseyConfig, w: Workload, cluster: Cluster, gpus: int, model: Shapes
                   ) -> dict[str, Any]:
    """Per-GPU bytes of a vLLM engine on `gpus` GPUs (module docstring) and the full-context sequences it
    holds at once."""
    t = attention_tp(config, gpus)
    expert = sum(rows * rest for e, rows, rest in model.params if e)
    other = sum(rows * rest for e, rows, rest in model.params if not e)
    weights = 2 * (other / t + expert / gpus)
    c = cache_bytes(config, w.context, latent_bytes=2, conv_bytes=2, state_bytes=4)
    per_seq = c["mla"] + c["kda"] / t  # on one GPU of a TP group holding the sequence
    free = cluster.usable - weights
    per_group = max(0, math.floor(free / per_seq)) if per_seq else 0
    return {"gpus": gpus, "tp": t, "ep": gpus, "weights": round(weights),
            "cache_per_sequence": round(per_seq),
            "mla_cache_per_sequence": c["mla"], "kda_state_per_sequence": c["kda"],
            "sequences": per_group * (gpus // t), "fits": per_group >= 1}


def min_rollout(config: OdysseyConfig, w: Workload, cluster: Cluster, model: Shapes) -> dict[str, Any] | None:
    """The smallest engine holding the weights and one full-context sequence, and the GPUs for a step's
    episodes held at once (engines of that size)."""
    n = config.n_routed_experts or 1
    for g in _divisors(n) + [n * k for k in (2, 4, 8)]:
        e = rollout_engine(config, w, cluster, g, model)
        if e["fits"]:
            engines = math.ceil(w.episodes / e["sequences"])
            return {**e, "engines_for_step": engines, "gpus_for_step": engines * g}
    return None


def attention_flops_per_token(config: OdysseyConfig, context: int) -> float:
    """Forward attention FLOPs per token (module docstring), averaged over a causal sequence of `context`."""
    c = config
    mla = len(c.mla_layer_indices) * 4 * c.mla_num_heads * c.mla_head_dim * context / 2
    H, K = c.kda_num_heads, c.kda_head_dim
    kda = len(c.kda_layer_indices) * (4 * H * K * K + 4 * H * K * c.kda_chunk_size / 2)
    return mla + kda


def step_time(config: OdysseyConfig, w: Workload, cluster: Cluster, learner: dict[str, Any],
              active: int, total_params: int, expert_params: int) -> dict[str, Any]:
    """FLOPs and seconds of one step (module docstring)."""
    tokens = w.episodes * w.context
    attn = attention_flops_per_token(config, w.context) * tokens
    train = 6 * active * tokens + 3 * attn
    prefill = 2 * active * tokens + attn
    W, ep = learner["ranks"], learner["ep"]
    rate = cluster.peak_tflops * 1e12 * cluster.mfu
    cp = learner.get("cp", 1)
    shard = math.ceil(w.context / cp)
    # cp = 1: windows of `chunk`; cp > 1: one shard; each layer recomputed in the backward (3 passes)
    windows = math.ceil(w.episodes * cp / W) * (math.ceil(shard / min(w.chunk, shard)) if cp == 1 else 1)
    passes = 3
    # what one rank receives per window: non-experts gathered over W, its experts over W / ep
    gathered = (total_params - expert_params) * (W - 1) / W + (expert_params / ep) * (W // ep - 1) / (W // ep)
    fsdp_bytes = windows * (passes * 2 * gathered + 4 * gathered)
    moe_layers = len(config.moe_layer_indices)
    a2a_rows = math.ceil(w.episodes * cp / W) * shard * config.num_experts_per_tok * moe_layers
    a2a_bytes = passes * 2 * a2a_rows * config.moe_latent_dim * ACT_BYTES * (ep - 1) / ep if ep > 1 else 0
    link = cluster.link_gb_s * GB
    return {"tokens": tokens, "train_flops": train, "rollout_prefill_flops": prefill,
            "learner_s": train / (W * rate), "fsdp_bytes_per_rank": fsdp_bytes,
            "all_to_all_bytes_per_rank": a2a_bytes, "communication_s": (fsdp_bytes + a2a_bytes) / link,
            "windows_per_rank": windows}


def make_plan(config: OdysseyConfig, w: Workload, cluster: Cluster, ranks: int | None = None,
              ep: int | None = None, cp: int | None = None, name: str = "") -> Plan:
    """The learner and rollout plan of `config` for workload `w` on `cluster` (module docstring). ranks:
    plan this learner size (else the minimum); ep: expert-parallel degree (else `default_ep`)."""
    model = model_shapes(meta_policy(config))
    pc = count_parameters(config)
    expert = pc.breakdown["routed_experts"].total
    plan = Plan(model={"name": name, "total_params": pc.total, "active_params": pc.active,
                       "routed_expert_params": expert},
                workload=asdict(w), cluster={**asdict(cluster), "usable_bytes": cluster.usable})
    if ep is not None and config.n_routed_experts and config.n_routed_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {config.n_routed_experts} routed experts; "
                         f"choose one of {[d for d in _divisors(config.n_routed_experts) if d <= 4096]}")
    if ranks is not None:
        learner = learner_rank(config, w, ranks, ep, model, cp=cp or 1)
        learner["fits"] = learner["total"] <= cluster.usable
    else:
        learner = min_learner_ranks(config, w, cluster, model, ep, cp)
        if learner is None:
            raise ValueError(no_fit_message(config, w, cluster, model, ep, cp))
        learner["fits"] = True
    plan.learner = learner
    plan.rollout = min_rollout(config, w, cluster, model) or {"fits": False}
    plan.step = step_time(config, w, cluster, learner, pc.active, pc.total, expert)
    if cluster.gpus is not None:
        need = learner["ranks"] + plan.rollout.get("gpus", 0)
        fits = "hold" if need <= cluster.gpus else "do NOT hold"
        plan.notes.append(f"the cluster's {cluster.gpus} GPUs {fits} the minimum learner ({learner['ranks']})"
                          " + one rollout engine "
                          f"({plan.rollout.get('gpus', '-')})")
    return plan


def _floor(config: OdysseyConfig, w: Workload, model: Shapes, ep: int | None, cp: int) -> dict[str, Any]:
    """The learner rank at `LIMIT` ranks and context parallelism cp (ep: the given one, else every expert its
    own rank where that divides LIMIT)."""
    n = config.n_routed_experts
    return learner_rank(config, w, LIMIT, ep if ep is not None else (n if n and LIMIT % n == 0 else None),
                        model, cp=cp)


def longest_context(config: OdysseyConfig, w: Workload, cluster: Cluster, model: Shapes,
                    ep: int | None = None, cp: int | None = None) -> dict[str, Any] | None:
    """The longest trajectory (a multiple of 1024 tokens, shorter than w.context) that some layout fits
    (`min_learner_ranks`), {"context", "learner"}; None if not even 1024 tokens fit."""
    lo, hi, best = 0, (w.context - 1) // 1024, None  # in units of 1024 tokens; lo fits (or is 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        r = min_learner_ranks(config, replace(w, context=mid * 1024), cluster, model, ep, cp)
        if r is not None:
            lo, best = mid, r
        else:
            hi = mid - 1
    return None if best is None else {"context": lo * 1024, "learner": best}


def no_fit_message(config: OdysseyConfig, w: Workload, cluster: Cluster, model: Shapes, ep: int | None = None,
                   cp: int | None = None) -> str:
    """Why no layout the learner runs fits (module docstring): a rank at `LIMIT` ranks without and with
    context parallelism, what is not built, and the longest trajectory that fits today."""
    usable = cluster.usable / GB

    def part(r: dict[str, Any]) -> str:
        state = (r["params"] + r["grads"] + r["optimizer"]) / GB
        return (f"{r['total'] / GB:,.1f} GB (state {state:.1f}, gather {r['gather'] / GB:.1f}, activations "
                f"{r['activations'] / GB:,.1f})")

    cps = [cp] if cp else [d for d in CP_DEGREES if d <= min(LIMIT, w.context)]
    rows = {c: _floor(config, w, model, ep, c) for c in cps}
    lines = [f"no learner layout up to {LIMIT} ranks fits this GPU's {usable:.1f} usable GB with "
             f"{w.context:,}-token trajectories."]
    if 1 in rows:
        lines.append(f"Without context parallelism (windows of {w.chunk}, every layer checkpointed) a rank "
                     f"at {LIMIT} ranks needs {part(rows[1])}.")
    multi = {c: r for c, r in rows.items() if c > 1}
    if multi:
        c, r = min(multi.items(), key=lambda kv: kv[1]["total"])
        a = r["activation_parts"]
        lines.append(
            f"With context parallelism (best cp {c}, every layer checkpointed) it needs {part(r)}: the "
            f"layer inputs of the shard ({a['stream'] / GB:,.1f} GB), the largest layer recomputed "
            f"({(a['layers'] + a['summary'] + a['mla'] + a['kda_exchange'] + a['conv']) / GB:,.1f} GB, of "
            f"which {a['mla'] / GB:,.1f} GB are one MLA layer's latents of the earlier shards) and one MLA "
            f"layer's blocked attention backward ({a['backward'] / GB:,.1f} GB): the last "
            "rank attends over (cp-1)/cp of the trajectory, whatever cp.")
    s = next(iter(rows.values()))
    floor = (s["params"] + s["grads"] + s["optimizer"] + s["gather"]) / GB
    lines.append(f"The model state and all-gather alone take {floor:.1f} GB of it"
                 + (" (FSDP2 shards dim 0: a rank never holds less than one whole expert per MoE layer)."
                    if config.n_routed_experts else "."))
    lines.append("Not built: zig-zag shards that spread the prefix over the ranks (the MLA prefix is already "
                 "attended in blocks, model/mla.py blocked_latent_attention).")
    best = longest_context(config, w, cluster, model, ep, cp)
    if best is None:
        lines.append("No trajectory of 1,024 tokens or more fits either.")
    else:
        b = best["learner"]
        lines.append(f"The longest trajectory today's layouts fit: {best['context']:,} tokens ({b['ranks']} "
                     f"ranks, ep {b['ep']}, cp {b['cp']}, {b['layout']}); plan it with --context "
                     f"{best['context']}.")
    return " ".join(lines)


__all__ = ["CP_DEGREES", "GPUS", "LIMIT", "Cluster", "Plan", "Workload", "longest_context",
           "no_fit_message", "attention_flops_per_token", "attention_tp", "default_ep",
           "learner_rank", "make_plan", "min_learner_ranks", "min_rollout", "rollout_engine", "step_time"]
