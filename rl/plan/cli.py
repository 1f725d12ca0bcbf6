"""`odyssey plan [--preset NAME | --config FILE [k=v ...]] [workload] [cluster] [--json]`.

    odyssey plan --preset k3 --context 1048576 --episodes 64 --group-size 8 --chunk 4096 --gpu h200
    odyssey plan --config configs/tiny.yaml --gpu h100 --gpus 16 --json

The model comes from a preset or from a run config's `model` section (preset + overrides; an HF checkpoint
is refused: the plan counts Odyssey's own layers); the config also supplies the group size and the sequence
chunk (learner.group_size, learner.sequence_chunk_tokens) unless given. --gpu picks memory and peak from a
known card (h200: 141 GB, h100: 80 GB; 989 dense bf16 TFLOP/s); --gpu-memory-gb / --peak-tflops override.
"""

from __future__ import annotations

import argparse
import json

from model.config import PRESETS, OdysseyConfig
from model.count import _human
from rl.plan.plan import GPUS, Cluster, Plan, Workload, make_plan


def _config(args: argparse.Namespace) -> tuple[OdysseyConfig, str, dict]:
    if args.config:
        from rl.config import load_config

        cfg = load_config(args.config, args.overrides)
        if cfg.model.hf_path:
            raise SystemExit(f"odyssey plan: {args.config} trains an HF checkpoint (model.hf_path); the plan "
                             "counts Odyssey's own layers: give --preset or a config with model.preset")
        learner = {"group_size": cfg.learner.group_size, "chunk": cfg.learner.sequence_chunk_tokens}
        return OdysseyConfig.from_preset(cfg.model.preset, **cfg.model.overrides), cfg.model.preset, learner
    return OdysseyConfig.from_preset(args.preset), args.preset, {}


def _gb(b: float) -> str:
    """Bytes in GB (1e9), MB below 1 GB."""
    return f"{b / 1e9:,.1f} GB" if b >= 1e9 else f"{b / 1e6:,.1f} MB"


#: what each activation part is (rl/plan/activations.py: window_bytes for cp 1, shard_bytes for cp > 1)
PART_HOW = {
    "layer": "one layer of a window, recomputed in the backward",
    "stream": "the checkpointed layer inputs (window or shard)",
    "carried": "MLA latents (+ grads) and KDA states carried across windows",
    "mla_prefix": "K, V of one MLA layer over the trajectory",
    "head": "LM head logits blocks (fp32)",
    "layers": "the largest layer of the shard, recomputed",
    "summary": "its KDA shard summary (fp32, K + V state columns)",
    "mla": "its MLA latents of the earlier shards (no K, V: blocked)",
    "kda_exchange": "its gathered fp32 summaries of the cp ranks",
    "conv": "its short-conv rows from the earlier shard",
    "backward": "one MLA layer's attention backward (transient)",
}


def _layout(plan: Plan) -> str:
    """How the learner runs a trajectory in this plan."""
    cp, w = plan.learner.get("cp", 1), plan.workload
    if cp == 1:
        return f"windows of {w['chunk']:,}"
    return f"context parallel {cp}: checkpointed shards of {w['context'] // cp:,}"


def render(plan: Plan) -> None:
    """Print the plan as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 100))
    m, w, c, lr, ro, st = plan.model, plan.workload, plan.cluster, plan.learner, plan.rollout, plan.step
    console.print(f"[bold]odyssey plan[/bold]: {m['name']} ({_human(m['total_params'])} total, "
                  f"{_human(m['active_params'])} active); {w['episodes']} episodes x "
                  f"{w['context']:,} tokens (groups of {w['group_size']}), {_layout(plan)}; "
                  f"GPU {c['gpu_memory_gb']:g} GB "
                  f"({_gb(c['usable_bytes'])} usable), {c['peak_tflops']:g} TFLOP/s at MFU {c['mfu']:g}")
    t = Table(title=f"learner: {lr['ranks']} ranks (FSDP over all, EP {lr['ep']}, context parallel "
              f"{lr['cp']}){'' if lr['fits'] else ' - DOES NOT FIT'}")
    t.add_column("per rank")
    t.add_column("bytes", justify="right")
    t.add_column("how", justify="left")
    rows = [("parameters (fp32 master)", lr["params"], "4 B x local FSDP shard"),
            ("gradients (fp32)", lr["grads"], "4 B x local shard"),
            ("AdamW state", lr["optimizer"], "8 B x local shard + 4 B step / tensor"),
            ("all-gather + grad buffers", lr["gather"],
             f"largest unit {_human(lr['largest_unit_params'])} params x (2 x 2 B + 4 B)")]
    rows += [(f"activations: {k}", v, PART_HOW.get(k, "")) for k, v in lr["activation_parts"].items()
             if k != "total"]
    for name, b, how in rows:
        t.add_row(name, _gb(b), how)
    t.add_row("TOTAL", _gb(lr["total"]), f"of {_gb(c['usable_bytes'])}", style="bold")
    console.print(t)
    t = Table(title="rollout (vLLM engines)")
    t.add_column("")
    t.add_column("value", justify="right")
    if ro.get("fits"):
        for name, v in (("GPUs per engine (minimum)", ro["gpus"]),
                        ("attention TP / expert EP", f"{ro['tp']} / {ro['ep']}"),
                        ("weights per GPU (bf16)", _gb(ro["weights"])),
                        ("MLA latent cache / sequence", _gb(ro["mla_cache_per_sequence"])),
                        ("KDA state / sequence", _gb(ro["kda_state_per_sequence"])),
                        ("full-context sequences per engine", ro["sequences"]),
                        ("GPUs to hold a step's episodes", ro["gpus_for_step"])):
            t.add_row(name, str(v))
    else:
        t.add_row("no engine up to 8 x experts GPUs holds the weights and one sequence", "")
    console.print(t)
    t = Table(title=f"step time at MFU {c['mfu']:g}")
    t.add_column("")
    t.add_column("value", justify="right")
    for name, v in (("tokens per step", f"{st['tokens']:,}"), ("learner FLOPs", f"{st['train_flops']:.3g}"),
                    ("learner compute", f"{st['learner_s']:,.0f} s"),
                    ("learner communication (no overlap)", f"{st['communication_s']:,.0f} s"),
                    ("rollout prefill FLOPs", f"{st['rollout_prefill_flops']:.3g}")):
        t.add_row(name, v)
    console.print(t)
    for n in plan.notes:
        console.print(n)


def cli_main(argv: list[str]) -> int:
    """`odyssey plan ...` (argv: what follows "odyssey plan")."""
    p = argparse.ArgumentParser(prog="odyssey plan", description="GPU count, per-rank memory and step time "
                                "of an RL run, computed from the model code (docs/scale.md)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="model preset")
    src.add_argument("--config", help="a run config YAML (its model section; k=v overrides follow)")
    p.add_argument("overrides", nargs="*", help="config overrides k=v (with --config)")
    p.add_argument("--context", type=int, default=1 << 20, help="tokens per trajectory (default 1M)")
    p.add_argument("--episodes", type=int, default=64, help="episodes (trajectories) per step")
    p.add_argument("--group-size", type=int, default=None, help="GRPO group size (default: config's or 8)")
    p.add_argument("--chunk", type=int, default=None, help="learner sequence window in tokens (default 4096)")
    p.add_argument("--capacity", type=float, default=1.0, help="most-loaded expert / mean tokens (>= 1)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU kind (memory, peak)")
    p.add_argument("--gpu-memory-gb", type=float, default=None)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU")
    p.add_argument("--link-gb-s", type=float, default=50.0, help="inter-node bandwidth per GPU, GB/s")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation the step time assumes")
    p.add_argument("--gpus", type=int, default=None, help="the cluster's GPU count (says whether it fits)")
    p.add_argument("--ranks", type=int, default=None, help="plan this many learner ranks (default: minimum)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: gcd-style choice)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: searched)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    if args.overrides and not args.config:
        p.error("k=v overrides go with --config")
    config, name, learner = _config(args)
    gpu = GPUS[args.gpu]
    cluster = Cluster(gpu_memory_gb=args.gpu_memory_gb or gpu.gpu_memory_gb,
                      peak_tflops=args.peak_tflops or gpu.peak_tflops, link_gb_s=args.link_gb_s, mfu=args.mfu,
                      gpus=args.gpus)
    try:
        work = Workload(context=args.context, episodes=args.episodes,
                        group_size=args.group_size or learner.get("group_size") or 8,
                        chunk=args.chunk or learner.get("chunk") or 4096, capacity=args.capacity)
        plan = make_plan(config, work, cluster, ranks=args.ranks, ep=args.ep, cp=args.cp, name=name)
    except ValueError as e:
        print(f"odyssey plan: {e}")
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        render(plan)
    return 0


__all__ = ["cli_main", "render"]
