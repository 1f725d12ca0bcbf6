"""Evaluation on held-out tasks: greedy and sampled success, pass@k, by env and difficulty.

    odyssey eval configs/tiny.yaml --checkpoint runs/tiny/checkpoints/step-000040 --episodes 64
    odyssey eval configs/tiny.yaml --checkpoint runs/tiny/warmup --episodes 64      # any save_pretrained dir

Held-out tasks are the "eval" split of the task stream (rl/rollout/tasks.py): their env seeds are odd,
every training seed is even, so they are disjoint from training tasks by construction; every evaluation
of a config plays the same held-out tasks (indices 0..N/k-1), so evaluations are comparable.

`--episodes N` sampled episodes: N / k held-out tasks (k = orchestrator.eval_pass_k), each played k times
at the training temperature (rollout.temperature) and once greedily (temperature 0), at every difficulty
of `orchestrator.eval_difficulties` (None: the env's configured one). Reported, overall and per
`<env>/d<difficulty>`:

    success          mean outcome of the sampled episodes (= pass@1)
    pass@k           unbiased estimator per task, 1 - C(n - c, k) / C(n, k), averaged over tasks
                     (n valid samples, c of them solved: outcome >= 1)
    greedy           mean outcome of the greedy episodes
    infra_errors     episodes lost to infrastructure (excluded from every mean, never scored 0)

During training (`orchestrator.eval_every`), the same runs on the training workers at the current weights
and lands in the step's metrics line as eval/<key>.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rl.rollout.tasks import Sample, load_dataset, task_stream


def eval_samples(cfg: Any, episodes: int, k: int, difficulties: list[int] | None = None) -> list[Sample]:
    """The held-out samples: episodes / k tasks x (k sampled + 1 greedy), for each difficulty."""
    if episodes < k or episodes % k:
        raise ValueError(f"eval episodes ({episodes}) must be a positive multiple of eval_pass_k ({k})")
    out: list[Sample] = []
    dataset = load_dataset(cfg)  # env.dataset: the held-out rows of its eval split
    for d in difficulties if difficulties is not None else [None]:
        stream = task_stream(cfg, "eval", {} if d is None else {"difficulty": int(d)}, dataset)
        for i in range(episodes // k):
            task = stream.task(i)
            out += stream.samples(task, k) + stream.samples(task, 1, greedy=True)
    return out


def env_difficulty(cfg: Any) -> Any:
    """The difficulty of tasks with no difficulty option: env.kwargs' (the env's default, 0, when unset).
    Training-time and `odyssey eval` metrics name their cells `<env>/d<difficulty>` by it alike."""
    return cfg.env.kwargs.get("difficulty", 0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n <= 0:
        return float("nan")
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _difficulty(sample: Sample, default: Any) -> Any:
    return sample.task.reset_options().get("difficulty", default)


def summarize(
    samples: list[Sample], results: dict[str, Any], k: int, env_id: str, difficulty: Any = None
) -> dict:
    """Flat metrics from the episodes of `samples` (results: sample key -> trajectory)."""
    from rewards.compose import infra_error_of

    out: dict[str, Any] = {}
    cells: dict[str, list[Sample]] = {"": samples}
    for s in samples:
        cells.setdefault(f"{env_id}/d{_difficulty(s, difficulty)}/", []).append(s)
    for prefix, group in cells.items():
        sampled = [s for s in group if not s.greedy]
        greedy = [s for s in group if s.greedy]
        ok = lambda s: infra_error_of(results[s.key]) is None  # noqa: E731
        outcome = lambda s: float(results[s.key].outcome or 0.0)  # noqa: E731
        valid_s, valid_g = [s for s in sampled if ok(s)], [s for s in greedy if ok(s)]
        by_task: dict[str, list[float]] = {}
        for s in valid_s:
            by_task.setdefault(s.task.key, []).append(outcome(s))
        passes = [pass_at_k(len(v), sum(x >= 1.0 for x in v), k) for v in by_task.values()]
        out[f"{prefix}success"] = sum(map(outcome, valid_s)) / len(valid_s) if valid_s else None
        out[f"{prefix}pass@{k}"] = sum(passes) / len(passes) if passes else None
        out[f"{prefix}greedy"] = sum(map(outcome, valid_g)) / len(valid_g) if valid_g else None
        out[f"{prefix}infra_errors"] = len(group) - len(valid_s) - len(valid_g)
        out[f"{prefix}episodes"] = len(group)
    return out


def table(metrics: dict[str, Any], k: int, title: str) -> Table:
    t = Table(title=title, header_style="bold")
    for col in ("cell", "success (T)", f"pass@{k}", "greedy", "episodes", "infra errors"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    cells = [""] + sorted({key.rsplit("/", 1)[0] + "/" for key in metrics if "/" in key})

    def f(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))

    for c in cells:
        t.add_row(
            c.rstrip("/") or "all",
            f(metrics.get(f"{c}success")),
            f(metrics.get(f"{c}pass@{k}")),
            f(metrics.get(f"{c}greedy")),
            f(metrics.get(f"{c}episodes")),
            f(metrics.get(f"{c}infra_errors")),
        )
    return t


def policy_dir(checkpoint: str | Path, cfg: Any = None) -> Path:
    """The save_pretrained directory of `checkpoint`: itself (a warm-up or any saved policy), or
    <checkpoint>/learner/policy (a training checkpoint, rl/train/checkpoint.py). A learner.lora training
    checkpoint holds only its adapter: with the run's `cfg` (whose learner.lora must be the one it was
    written with) its merged policy, built once into <checkpoint>/learner/merged_policy
    (`merged_lora_policy`)."""
    from rl.learner.learner import ADAPTER_FILE

    p = Path(checkpoint).expanduser().resolve()
    for cand in (p, p / "learner" / "policy", p / "policy"):
        if (cand / "config.json").is_file():
            return cand
    for d in (p, p / "learner"):
        if (d / ADAPTER_FILE).is_file():
            if cfg is None:
                raise ValueError(
                    f"--checkpoint {checkpoint}: a learner.lora checkpoint holds only its LoRA adapter "
                    f"({ADAPTER_FILE}); its policy is merged from the run config's model and learner.lora: "
                    "give the config it was trained with")
            return merged_lora_policy(d, cfg)
    raise ValueError(
        f"--checkpoint {checkpoint}: no policy there (expected config.json in it, in learner/policy/ of a "
        "training checkpoint, or in policy/); training checkpoints live in <run_dir>/checkpoints/step-NNNNNN"
    )


def merged_lora_policy(learner_dir: Path, cfg: Any) -> Path:
    """<learner_dir>/merged_policy: the config's model with the adapter of `learner_dir` merged in
    (W + (alpha / rank) B A, rl/learner/lora.py `merged_state_dict`), saved as a plain checkpoint the
    rollout engines load; built once (a COMPLETE marker), refused when `cfg`'s learner.lora is not the one
    the adapter was written with."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from rl.learner.learner import ADAPTER_FILE, STATE_FILE
    from rl.learner.lora import apply_lora, load_adapter_state_dict, merged_state_dict
    from rl.policy import PolicySpec, build_policy

    out = learner_dir / "merged_policy"
    if (out / "COMPLETE").is_file():
        return out
    state = torch.load(learner_dir / STATE_FILE, map_location="cpu", weights_only=False)
    saved = state.get("learner_config", {}).get("lora")
    lora = cfg.learner.lora
    if lora is None or saved != lora.model_dump(mode="json"):
        raise ValueError(
            f"{learner_dir}: its adapter was written with learner.lora {saved}, the config has "
            f"{lora.model_dump(mode='json') if lora else None}: give the config the run was trained with")
    spec = PolicySpec.from_config(cfg).replace(dtype="float32")
    policy = apply_lora(build_policy(spec, train=False), lora)
    load_adapter_state_dict(policy, load_file(str(learner_dir / ADAPTER_FILE)))
    merged = merged_state_dict(policy)
    base = build_policy(spec, train=False)
    base.load_state_dict(merged)  # strict: the merged keys are exactly the base model's
    shutil.rmtree(out, ignore_errors=True)
    base.save_pretrained(out)
    (out / "COMPLETE").write_text("merged from " + ADAPTER_FILE + "\n")
    return out


def evaluate_checkpoint(cfg: Any, checkpoint: str | Path, episodes: int, console: Console) -> dict[str, Any]:
    """Play the held-out samples on `rollout.num_workers` Ray workers loading the policy of `checkpoint`
    (workers read it themselves: the directory must be reachable from their nodes)."""
    import dataclasses

    from rl.placement import actor_options, check_fits, cluster_demand, torch_threads
    from rl.rollout.fleet import RolloutFleet, worker_spawner
    from rl.rollout.worker import WorkerSettings

    o = cfg.orchestrator
    samples = eval_samples(cfg, episodes, o.eval_pass_k, o.eval_difficulties)
    settings = dataclasses.replace(
        WorkerSettings.from_config(cfg, store_dir=None),
        checkpoint=str(policy_dir(checkpoint, cfg)),
        torch_threads=torch_threads(o.rollout_resources),
    )
    # no learner runs here: only the rollout workers' resources are asked for and checked
    fleet = RolloutFleet(int(cluster_demand(cfg, with_learner=False).get("CPU", 1) + 0.999))
    try:
        check_fits(cfg, with_learner=False)
        fleet.launch(
            worker_spawner(settings, actor_options(o.rollout_resources)),
            cfg.rollout.num_workers,
            cfg.rollout.concurrent_episodes,
            max_infra_retries=o.max_infra_retries,
            max_restarts=o.max_worker_restarts,
            env_id=cfg.env.id,
            log=lambda m: console.print(f"odyssey eval: {m}", highlight=False, markup=False),
        )
        results = fleet.run_samples(samples)
    finally:
        fleet.close()
    return summarize(samples, results, o.eval_pass_k, cfg.env.id, env_difficulty(cfg))


def cli_main(argv: list[str]) -> int:
    """`odyssey eval CONFIG --checkpoint DIR --episodes N [k=v ...]`: held-out evaluation (module doc)."""
    p = argparse.ArgumentParser(prog="odyssey eval", description="Evaluate a policy on held-out tasks.")
    p.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument(
        "--checkpoint", required=True, help="training checkpoint (step-NNNNNN) or save_pretrained dir"
    )
    p.add_argument(
        "--episodes", type=int, default=None, help="sampled episodes (default orchestrator.eval_episodes)"
    )
    p.add_argument("--out", default=None, help="JSON results file (default <checkpoint>-eval.json beside it)")
    args = p.parse_intermixed_args(argv)
    console, err = Console(), Console(stderr=True)
    from rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        n = cfg.orchestrator.eval_episodes if args.episodes is None else args.episodes
        eval_samples(cfg, n, cfg.orchestrator.eval_pass_k)  # validates n against k
        policy_dir(args.checkpoint, cfg)
    except (ConfigError, ValueError) as e:
        err.print(f"odyssey eval: {e}", highlight=False, markup=False)
        return 2
    k = cfg.orchestrator.eval_pass_k
    console.print(
        f"odyssey eval: {n} sampled + {n // k} greedy episodes per difficulty, held-out {cfg.env.id} tasks, "
        f"policy {policy_dir(args.checkpoint, cfg)}",
        highlight=False,
    )
    t0 = time.perf_counter()
    metrics = evaluate_checkpoint(cfg, args.checkpoint, n, console)
    metrics["wall_s"] = round(time.perf_counter() - t0, 2)
    console.print(table(metrics, k, f"held-out evaluation (T={cfg.rollout.temperature:g} and greedy)"))
    out = Path(args.out) if args.out else Path(str(Path(args.checkpoint).resolve()) + "-eval.json")
    record = {"checkpoint": str(args.checkpoint), "sampled_episodes": n, "pass_k": k, **metrics}
    out.write_text(json.dumps(record, indent=1))
    console.print(f"results: {out}", highlight=False)
    return 0
