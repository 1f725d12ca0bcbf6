"""`odyssey rollout CONFIG --episodes N [k=v ...]`: run agent episodes, score them, store them, summarise.

    odyssey rollout configs/tiny.yaml --episodes 32
    odyssey rollout configs/tiny.yaml --episodes 8 rollout.num_workers=1 rollout.temperature=0.7
    ray job submit --working-dir . -- odyssey rollout configs/tiny.yaml --episodes 4 \
        logging.run_dir=$PWD/runs/tiny

1. Load and validate the run config (rl/config.py) with the overrides; every problem is listed, exit 2.
2. Make the run dir `<logging.run_dir>/rollout-<UTC time>` (or --run-dir): the resolved `config.yaml`,
   the trajectory store `trajectories/` (Arrow, rl/trajectory.py) and `summary.json`.
3. Ray: join the cluster when RAY_ADDRESS is set (as in `ray job submit`), otherwise start an embedded
   one (RAY_AUTH_MODE=disabled, no dashboard). `rollout.num_workers` RolloutWorker actors (1 CPU each)
   get the episode indices round-robin; each runs `rollout.concurrent_episodes` at once on its own
   engine and sandbox pool, scores with the configured rewards and appends to the store as episodes
   finish. `--no-ray` runs one worker in this process instead.
4. A progress bar (plain log lines when stdout is not a terminal), then the summary table.

A worker that dies (actor killed, OOM) is named in the output and replaced once by a fresh actor that
reruns exactly its episodes missing from the store, with the same seeds. The summary is computed from
the store, so it counts every stored episode; its wall time and tokens/s are the driver's (from the
moment every worker is up to the last episode, worker restarts included). Trajectories are written by
the workers: on a multi-node cluster the run dir must be on a shared filesystem.

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
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.rollout.health import BatchUnhealthy, InfraGuard
from rl.rollout.summary import RolloutProgress, report_from_dict, report_from_store, summary_table
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
    t0 = time.perf_counter()
    stopped = None
    try:
        if args.no_ray:
            report, failures = asyncio.run(_run_local(settings, n, console, guard)), []
        else:
            report, failures = run_on_ray(settings, n, workers, console, guard=guard)
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
    summary = {
        "episodes_requested": n,
        "episodes_stored": stored,
        "run_dir": str(run_dir),
        "store": str(store_dir),
        "driver_wall_s": wall,
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


async def _run_local(
    settings: WorkerSettings, n: int, console: Console, guard: InfraGuard | None = None, worker: Any = None
) -> WorkerReport:
    """Episodes 0..n-1 on one in-process worker; BatchUnhealthy (episodes cancelled) when `guard` says so."""
    worker = worker or RolloutWorker(settings, 0)
    t0 = time.perf_counter()
    task = asyncio.ensure_future(worker.run(list(range(n))))
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


def _init_ray(num_workers: int) -> bool:
    """Join RAY_ADDRESS (set by `ray job submit`, or by hand: RAY_ADDRESS=auto) or start an embedded Ray;
    True when we started it (and must shut it down)."""
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
        num_cpus=max(os.cpu_count() or 1, num_workers),
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


def _stored_indices(store_dir: Path) -> set[int]:
    from rl.trajectory import TrajectoryStore

    if not store_dir.exists():
        return set()
    return {
        int(t.metadata["episode_index"]) for t in TrajectoryStore(store_dir) if "episode_index" in t.metadata
    }


def run_on_ray(
    settings: WorkerSettings,
    n: int,
    num_workers: int,
    console: Console,
    actor_factory: Callable[[int, int], Any] | None = None,
    max_restarts: int = 1,
    guard: InfraGuard | None = None,
) -> tuple[WorkerReport, list[str]]:
    """Episodes 0..n-1 round-robin over `num_workers` RolloutWorker actors, with a progress display.

    A worker that dies (actor killed, OOM, crash) is reported by name and replaced by a fresh actor (at
    most `max_restarts` times per worker) that reruns exactly its episodes missing from the store, with
    the same seeds. actor_factory(worker_id, attempt) -> actor handle (default: a 1-CPU RolloutWorker).
    guard: stops the run (BatchUnhealthy, actors killed) once it judges the infra errors too many.
    Returns the merged report of the workers that finished (wall_s: the driver's, from every actor being
    up to the last result, restarts included) and the failure messages.
    """
    import ray

    started = _init_ray(num_workers)
    if actor_factory is None:
        actor_cls = ray.remote(num_cpus=1, max_restarts=0)(RolloutWorker)

        def actor_factory(i: int, attempt: int) -> Any:
            return actor_cls.remote(settings, i)

    store_dir = Path(settings.store_dir) if settings.store_dir else None
    actors = {i: actor_factory(i, 0) for i in range(num_workers)}
    ray.get([a.ping.remote() for a in actors.values()])  # every actor is up: the driver's clock starts
    t0 = time.perf_counter()
    attempts = dict.fromkeys(actors, 0)
    splits = {i: list(range(i, n, num_workers)) for i in range(num_workers)}
    assigned = {i: len(v) for i, v in splits.items()}
    refs = {actors[i].run.remote(splits[i]): i for i in range(num_workers) if splits[i]}
    report, failures = WorkerReport(workers=0), []
    last: dict[int, dict[str, Any]] = {}  # latest progress per worker (attempts summed in `base`)
    base: dict[int, dict[str, Any]] = {}
    polls: dict[int, Any] = {i: a.progress.remote() for i, a in actors.items()}  # never blocks the bar
    dead: list[Any] = []
    try:
        with RolloutProgress(n, console) as prog:
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                for ref in ready:
                    i = refs.pop(ref)
                    polls.pop(i, None)
                    try:
                        rep = report_from_dict(ray.get(ref))
                    except Exception as e:  # RayTaskError / RayActorError: name the worker, keep the rest
                        msg = str(e).strip().splitlines()[-1][:500] if str(e).strip() else ""
                        failures.append(f"worker {i} failed ({type(e).__name__}: {msg})")
                        missing = sorted(
                            set(splits[i]) - (_stored_indices(store_dir) if store_dir else set())
                        )
                        if missing and attempts[i] < max_restarts:
                            attempts[i] += 1
                            failures[-1] += (
                                f"; rerunning its {len(missing)} unfinished episodes on a new actor"
                            )
                            dead.append(actors[i])
                            prev = last.pop(i, {})
                            base[i] = {
                                "done": assigned[i] - len(missing),
                                "generated_tokens": base.get(i, {}).get("generated_tokens", 0)
                                + prev.get("generated_tokens", 0),
                                "infra_errors": base.get(i, {}).get("infra_errors", 0)
                                + prev.get("infra_errors", 0),
                            }
                            splits[i] = missing
                            actors[i] = actor_factory(i, attempts[i])
                            new = actors[i].run.remote(missing)
                            refs[new] = i
                            pending.append(new)
                            polls[i] = actors[i].progress.remote()
                        elif missing:
                            failures[-1] += f"; {len(missing)} of its episodes are not in the store"
                        continue
                    report = report.merge(rep)
                    last[i] = {
                        "done": rep.episodes,
                        "generated_tokens": rep.generated_tokens,
                        "infra_errors": rep.infra_errors,
                    }
                for i, ref in list(polls.items()):
                    if ray.wait([ref], timeout=0)[0]:
                        try:
                            last[i] = ray.get(ref)
                            polls[i] = actors[i].progress.remote()
                        except Exception:  # a dead actor: its run ref reports the failure
                            polls.pop(i)
                totals = [
                    sum(d.get(k, 0) for d in (*last.values(), *base.values()))
                    for k in ("done", "generated_tokens", "infra_errors")
                ]
                prog.update(*totals)
                _check_guard(guard, settings, n, [*last.values(), *base.values()])
    finally:
        for a in actors.values():
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(a)
        for a in dead:
            ray.kill(a)
        if started:
            ray.shutdown()
    report.wall_s = time.perf_counter() - t0
    return report, failures
