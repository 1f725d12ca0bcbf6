"""The training loop (the Ray driver): rollout workers -> experience buffer -> learner -> weights -> workers.

    summary = Trainer(cfg).run()          # what `odyssey train CONFIG` and `rl.train.train(cfg)` do

The driver holds no model. It draws tasks (rl/rollout/tasks.py), queues `group_size` samples of each on
the rollout workers (rl/rollout/fleet.py starts Ray and the workers, rl/rollout/dispatch.py feeds them),
stores every finished episode (rl/trajectory.py), gathers groups in the experience buffer (buffer.py),
hands batches of `rollout.episodes / group_size` groups to the learner (learner_client.py), broadcasts
each new policy version to the workers (weight_sync.py), writes one metrics line per step (metrics.py),
evaluates on held-out tasks (eval.py) and checkpoints (checkpoint.py).

Sync and async (orchestrator.max_staleness = k). A group drawn while the weights are at version v is
consumed by the learner at step >= v; its staleness is the learner's version minus the version of its
oldest generated token. The driver (its `Admission`, rl/train/admission.py, which also applies the group
filter of dynamic sampling) keeps at most `(k + 1 - busy) * G` useful groups (ready in the
buffer, or still being played) ahead of the learner, where G is the batch's group count and busy is 1
while a learner step runs, so in fifo order a group is consumed at most k versions after it was drawn:

- k = 0: strictly on-policy. Rollouts of step s run with weights s only while the learner is idle; the
  learner starts when the G groups are in, and no rollout runs while it trains.
- k > 0: rollouts continue while the learner trains. Weights arriving mid-episode are applied between
  decode steps (partial rollouts: tokens record their version, the engine rebuilds old caches). A
  member whose oldest token is more than k versions behind at training time is dropped and counted
  (`dropped/stale`); with buffer orders other than fifo this can happen to groups left waiting.

Dynamic sampling (orchestrator.dynamic_sampling, DAPO): a complete group that the group filter rejects
(orchestrator.group_filter; by default one whose valid members all have the same total reward) is
discarded on arrival (counted), and another task is drawn instead, until
`dynamic_sampling_cap * G` groups were drawn for the step; after that such groups are kept (the
learner then drops them itself, with its own count).

Checkpoints (every `checkpoint_every` steps and at the end) hold the learner state, the buffer, the task
cursor and the samples still in flight or queued (re-queued on resume, same seeds), plus how many
metrics/ledger lines and which store files belong to them. Resuming moves later metrics lines and
store files aside (`metrics.superseded.jsonl`, `trajectories/superseded/`), so the run dir describes
exactly one history. `samples.jsonl` is the ledger: per step, the sample keys trained, dropped as
stale, and discarded by dynamic sampling.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.learner.estimators import estimator
from rl.placement import actor_options, check_fits, cluster_demand, torch_threads
from rl.rollout.dispatch import Dispatcher, Finished, NoWorkersLeft
from rl.rollout.fleet import RolloutFleet, run_samples, worker_spawner
from rl.rollout.health import BatchUnhealthy
from rl.rollout.tasks import Sample, task_stream
from rl.rollout.worker import RolloutWorker, WorkerSettings
from rl.train.admission import Admission
from rl.train.buffer import ExperienceBuffer
from rl.train.checkpoint import latest_checkpoint, write_checkpoint
from rl.train.learner_client import LearnerClient, LearnerDied
from rl.train.metrics import ProgressLine, batch_stats, sample_rows, step_record
from rl.train.sinks import SAMPLES_TEXT_FILE, MetricSinks
from rl.train.stages import StageController, stage_config
from rl.train.weight_sync import WeightSync
from rl.trajectory import TrajectoryStore

DRIVER_STATE = "driver.json"
BUFFER_FILE = "buffer.arrow"
LEARNER_DIR = "learner"
LEDGER_FILE = "samples.jsonl"
EVAL_FILE = "eval.jsonl"
STATE_VERSION = 1


class TrainingStopped(RuntimeError):
    """The run cannot go on (the learner died, no rollout worker left); the message says how to resume."""


@dataclass
class DriverState:
    """What the driver must remember across a restart (checkpoint's driver.json)."""

    step: int = 0  # learner steps done
    version: int = 0  # policy weights version (== step)
    cursor: int = 0  # next training task index
    pending: list[dict] = field(default_factory=list)  # samples in flight or queued (Sample.to_dict)
    counters: dict[str, int] = field(default_factory=dict)  # cumulative
    metrics_lines: int = 0
    ledger_lines: int = 0
    eval_lines: int = 0
    store_files: list[str] = field(default_factory=list)
    resumes: list[dict] = field(default_factory=list)
    samples_text_lines: int = 0
    stage: int = 0  # index into cfg.stages (rl/train/stages.py)
    stage_start: int = 0  # the step the current stage began at

    def to_json(self) -> str:
        return json.dumps({"state_version": STATE_VERSION, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> DriverState:
        d = json.loads(text)
        if d.pop("state_version", None) != STATE_VERSION:
            raise ValueError("checkpoint driver.json was written by another Odyssey version")
        return cls(**d)


def resume_hint(cfg: Any, config_path: str | None = None) -> str:
    cmd = f"odyssey train {config_path or '<CONFIG>'} logging.run_dir={Path(cfg.logging.run_dir).resolve()}"
    return f"re-run `{cmd}` (orchestrator.resume=true) to continue from the latest checkpoint"


class Trainer:
    """One training run. cfg: a RunConfig. config_path: named in resume hints. worker_cls: the rollout
    worker actor class (tests inject one that fails); console: where the live line goes."""

    def __init__(
        self,
        cfg: Any,
        *,
        config_path: str | None = None,
        console: Console | None = None,
        worker_cls: type = RolloutWorker,
    ):
        self.base_cfg = cfg  # with its `stages`; self.cfg is the current stage's effective config
        self.stages = StageController(cfg.stages)
        self.config_path = config_path
        self.console = console or Console()
        self.worker_cls = worker_cls
        o = cfg.orchestrator
        self.group_size = cfg.learner.group_size if estimator(cfg.learner.advantage).grouped else 1
        self.k = o.max_staleness
        self.run_dir = Path(cfg.logging.run_dir).expanduser().resolve()
        self.store = TrajectoryStore(self.run_dir / "trajectories")
        self.sinks = MetricSinks(self.run_dir, cfg.logging, cfg.model_dump(mode="json"))
        self.metrics = self.sinks.jsonl
        self._enter_stage(0)
        self.admission = Admission.from_config(self.cfg, self.groups_per_step)  # staleness bound, filter
        self.buffer = ExperienceBuffer(self.group_size, o.buffer_order)
        self.state = DriverState()
        self.sync = WeightSync(o.weight_sync_timeout_s)
        self.step_counts: dict[str, int] = {}  # counters since the previous metrics line
        self.ledger_discarded: list[str] = []
        self.learner: LearnerClient | None = None
        self.dispatcher: Dispatcher | None = None
        self._started_ray = False  # we started an embedded Ray (and shut it down in close)
        self._switching_stage = False  # start() runs again for the next stage (rl/train/stages.py)

    # ------------------------------------------------------------------ setup
    def _enter_stage(self, index: int) -> None:
        """Make stage `index`'s effective config current (before actors are started from it)."""
        self.cfg = stage_config(self.base_cfg, index) if self.base_cfg.stages else self.base_cfg
        self.groups_per_step = max(1, self.cfg.rollout.episodes // self.group_size)
        self.stream = task_stream(self.cfg, "train")  # env.dataset: rows of its train split
        if hasattr(self, "admission"):  # a stage may change rollout.episodes, so the batch's group count
            self.admission.groups_per_step = self.groups_per_step

    def _log(self, msg: str) -> None:
        self.console.print(f"odyssey train: {msg}", highlight=False, markup=False, soft_wrap=True)

    def _count(self, key: str, n: int = 1) -> None:
        self.step_counts[key] = self.step_counts.get(key, 0) + n
        self.state.counters[key] = self.state.counters.get(key, 0) + n

    def _worker_settings(self) -> WorkerSettings:
        from rl.config import is_hf_policy

        s = WorkerSettings.from_config(self.cfg, store_dir=None)  # the driver stores: no shared disk
        # weights come from the learner (weight sync), so workers need no access to model.init_from; an HF
        # model's architecture is only in its checkpoint, so workers read model.hf_path (same path)
        return dataclasses.replace(
            s, checkpoint=s.checkpoint if is_hf_policy(self.cfg.model) else None,
            torch_threads=torch_threads(self.cfg.orchestrator.rollout_resources),
        )

    def _ready_ref(self, actor: Any) -> Any:
        if self.sync.ref is None:  # at start-up: the weights are pushed once the learner is up
            return actor.ping.remote()
        return self.sync.ready_ref(actor)  # a replacement: ready once it holds the current weights

    def _resume(self) -> Path | None:
        """Load the latest checkpoint when resuming (driver state + buffer; the learner loads in start)."""
        o = self.cfg.orchestrator
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return None
        if not o.resume:
            raise ValueError(
                f"run dir {self.run_dir} holds checkpoint {ckpt.name} and orchestrator.resume is false; "
                "set orchestrator.resume=true to continue it, or choose a new logging.run_dir"
            )
        self.state = DriverState.from_json((ckpt / DRIVER_STATE).read_text())
        self.buffer.load(ckpt / BUFFER_FILE)
        for g in self.buffer.partial.values():
            self.admission.opened(g.members[0][0].task)
        for d in self.state.pending:
            self.admission.opened(Sample.from_dict(d).task)
        moved = self.metrics.keep_first(self.state.metrics_lines)
        _keep_first_lines(self.run_dir / LEDGER_FILE, self.state.ledger_lines)
        _keep_first_lines(self.run_dir / EVAL_FILE, self.state.eval_lines)
        _keep_first_lines(self.run_dir / SAMPLES_TEXT_FILE, self.state.samples_text_lines)
        kept = set(self.state.store_files)
        aside = self.store.root / "superseded"
        later = [p for p in self.store.files() if p.name not in kept]
        if later:
            aside.mkdir(exist_ok=True)
            for p in later:
                os.replace(p, aside / p.name)
        changed = _config_changes(self.run_dir, self.base_cfg)
        if changed:
            self._log(
                f"note: the config differs from the run's config.yaml in {', '.join(changed)}; "
                "resuming with the new values"
            )
        if self._switching_stage:
            return ckpt
        self.state.resumes.append({"from_step": self.state.step, "time": time.time()})
        self._log(
            f"resuming from checkpoint {ckpt} (step {self.state.step}, {len(self.state.pending)} episodes "
            f"re-queued, {self.buffer.n_trajectories} in the buffer; {moved} later metrics lines and "
            f"{len(later)} later store files set aside)"
        )
        return ckpt

    def start(self) -> None:
        """Ray, resume state, learner, weights v0 (or the checkpoint's), rollout workers."""
        from rl.config import write_resolved

        t0 = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = self._resume()
        if ckpt is None:
            self._log(f"starting a new run in {self.run_dir}")
        write_resolved(self.base_cfg, self.run_dir)
        n_stages = len(self.base_cfg.stages)
        if n_stages and self.state.stage >= n_stages:
            raise ValueError(
                f"the checkpoint in {self.run_dir} is in stage {self.state.stage} (0-based), the config "
                f"has {n_stages} stages; restore the config's `stages`, or choose a new logging.run_dir"
            )
        self._enter_stage(self.state.stage if n_stages else 0)
        if self.base_cfg.stages:
            self._log(
                f"stage {self.state.stage + 1}/{len(self.base_cfg.stages)} "
                f"({self.stages.name(self.state.stage)}) since step {self.state.stage_start}"
            )
        if self.state.step >= self.cfg.learner.steps:
            self._log(f"the run is complete: step {self.state.step}, learner.steps={self.cfg.learner.steps}")
            return
        demand = cluster_demand(self.cfg)
        fleet = RolloutFleet(int(demand.get("CPU", 1) + 0.999))
        self._started_ray = fleet.started_ray or self._started_ray  # a stage switch calls start() again
        check_fits(self.cfg)
        self.settings = self._worker_settings()
        o, r = self.cfg.orchestrator, self.cfg.rollout
        options = actor_options(o.rollout_resources)
        spawn = worker_spawner(self.settings, options, self.worker_cls, self._ready_ref)
        self.dispatcher = fleet.launch(  # worker actors start while the learner builds
            spawn,
            r.num_workers,
            r.concurrent_episodes,
            max_infra_retries=o.max_infra_retries,
            max_restarts=o.max_worker_restarts,
            env_id=self.cfg.env.id,
            log=self._log,
        )
        self.learner = LearnerClient(self.cfg)
        if ckpt is not None:
            self.learner.load(ckpt / LEARNER_DIR)
        self.sync.publish(self.learner.weights(), self.state.version)
        self.dispatcher.put([Sample.from_dict(d) for d in self.state.pending])
        learner_info = self.learner.ready()
        self.dispatcher.wait_ready(o.weight_sync_timeout_s)
        self._push_weights(publish=False)  # version 0 (or the checkpoint's) to every worker
        self._record_placement(learner_info)
        self.sinks.open(self.state.step + 1)
        self._log(
            f"{r.num_workers} rollout workers and the learner ready in {time.perf_counter() - t0:.1f} s; "
            f"{self.groups_per_step} groups of {self.group_size} per step, max_staleness {self.k}"
        )

    def _record_placement(self, learner_info: dict) -> None:
        """<run_dir>/placement.json: the node (id, resources) of every learner rank and rollout worker."""
        import ray

        assert self.dispatcher is not None
        actors = self.dispatcher.ready_actors()
        infos = ray.get([a.info.remote() for a in actors.values()], timeout=120)
        nodes = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        placement = {
            "learner": [{**i, "node_resources": nodes.get(i["node_id"], {})} for i in learner_info["ranks"]],
            "workers": [{**i, "node_resources": nodes.get(i["node_id"], {})} for i in infos],
        }
        (self.run_dir / "placement.json").write_text(json.dumps(placement, indent=1))

    # ------------------------------------------------------------------ rollouts
    def _draw(self, busy: bool) -> None:
        """Queue new tasks while fewer useful groups than the staleness bound allows are ahead."""
        assert self.dispatcher is not None
        while self.admission.room(len(self.buffer), busy):
            task = self.stream.task(self.state.cursor)
            self.state.cursor += 1
            self.admission.opened(task)
            self.dispatcher.put(self.stream.samples(task, self.group_size))

    def _on_finished(self, f: Finished) -> None:
        self.store.append(f.traj)
        if not f.final:
            self._count("infra_retries")
            return
        self._count("episodes_finished")
        group = self.buffer.add(f.sample, f.traj)
        if group is None:
            return
        self.admission.closed(group.key)
        if not self.admission.admit(group):  # dynamic sampling: discarded, another task is drawn
            self.buffer.discard(group.key)
            self._count(self.admission.counter)
            self.ledger_discarded += [s.key for s, _ in group.members]

    def _poll(self, timeout: float) -> None:
        assert self.dispatcher is not None
        before = self.dispatcher.restarts
        for f in self.dispatcher.poll(timeout):
            self._on_finished(f)
        if self.dispatcher.restarts > before:
            self._count("worker_restarts", self.dispatcher.restarts - before)

    # ------------------------------------------------------------------ learner
    def _push_weights(self, publish: bool = True) -> None:
        assert self.dispatcher is not None and self.learner is not None
        if publish:
            self.sync.publish(self.learner.weights(), self.state.version)
        failed = self.sync.push(self.dispatcher.ready_actors())
        if failed and len(failed) == len(self.dispatcher.ready_actors()):
            self.learner.ready(timeout=60)  # every worker failed: is the weights' source (the learner) gone?
        for worker_id, reason in failed.items():
            self._count("worker_restarts")
            self.dispatcher.replace(worker_id, reason)

    def _train_step(self) -> dict[str, Any] | None:
        """Take a batch, run one learner step while rollouts continue (async) or wait (sync)."""
        assert self.learner is not None
        version = self.state.version
        batch, dropped = self.buffer.take(self.groups_per_step, version, self.k)
        self.admission.step_taken()
        if dropped:
            self._count("dropped/stale", len(dropped))
        if not batch:
            self._ledger({"step": None, "trained": [], "stale": [s.key for s, _ in dropped], "discarded": []})
            return None
        self._check_infra(batch)
        t0 = time.perf_counter()
        fut = self.learner.step([t for _, t in batch])
        while not self.learner.done(fut):
            self._draw(busy=True)
            if self.dispatcher.idle:  # nothing to collect: block on the learner (polling would spin a core)
                self.learner.wait(fut, timeout=0.2)
            else:
                self._poll(timeout=0.2)
        learner_metrics = self.learner.result(fut)
        learner_s = time.perf_counter() - t0
        self.state.step += 1
        self.state.version += 1
        t1 = time.perf_counter()
        self._push_weights()
        sync_s = time.perf_counter() - t1
        self._ledger(
            {
                "step": self.state.step,
                "trained": [s.key for s, _ in batch],
                "stale": [s.key for s, _ in dropped],
                "discarded": self.ledger_discarded,
            }
        )
        self.ledger_discarded = []
        return {
            "batch": batch_stats(batch, version),
            "learner": learner_metrics,
            "timings": {"learner": learner_s, "weight_sync": sync_s},
            "samples": sample_rows(batch, self.cfg.logging.sample_rollouts),
        }

    def _check_infra(self, batch: list) -> None:
        """rl.rollout.health.InfraGuard over the batch: BatchUnhealthy when an env failed on more than
        rollout.max_infra_fraction of its episodes (training on the rest would be a biased sample)."""
        from rewards.compose import infra_error_of
        from rl.rollout.health import InfraGuard

        planned: dict[str, int] = {}
        bad: dict[str, int] = {}
        sources: dict[str, int] = {}
        examples: list[str] = []
        for _, t in batch:
            env_id = str(t.metadata.get("env_id", self.cfg.env.id))
            planned[env_id] = planned.get(env_id, 0) + 1
            error = infra_error_of(t)
            if error is not None:
                bad[env_id] = bad.get(env_id, 0) + 1
                src = str(t.metadata.get("infra_source") or "unknown")
                sources[src] = sources.get(src, 0) + 1
                examples.append(error)
        InfraGuard(self.cfg.rollout.max_infra_fraction).check(bad, planned, examples, sources)

    def _ledger(self, entry: dict) -> None:
        with open(self.run_dir / LEDGER_FILE, "a") as f:
            f.write(json.dumps(entry) + "\n")
        self.state.ledger_lines += 1

    # ------------------------------------------------------------------ checkpoints, eval
    def _checkpoint(self) -> float:
        assert self.dispatcher is not None and self.learner is not None
        t0 = time.perf_counter()
        train_pending = [
            s for s in (*self.dispatcher.in_flight(), *self.dispatcher.queue) if s.task.split == "train"
        ]
        self.state.pending = [s.to_dict() for s in sorted(train_pending, key=lambda s: s.order)]
        self.state.store_files = [p.name for p in self.store.files()]
        self.state.metrics_lines = self.metrics.line_count()
        self.state.samples_text_lines = len(_read_jsonl(self.run_dir / SAMPLES_TEXT_FILE))

        def fill(tmp: Path) -> None:
            self.learner.save(tmp / LEARNER_DIR)
            self.buffer.save(tmp / BUFFER_FILE)
            (tmp / DRIVER_STATE).write_text(self.state.to_json())

        path = write_checkpoint(self.run_dir, self.state.step, fill, self.cfg.orchestrator.keep_checkpoints)
        self._log(f"checkpoint {path}")
        return time.perf_counter() - t0

    def _evaluate(self) -> dict[str, Any]:
        """Held-out evaluation at the current weights; appended to eval.jsonl with the step."""
        from rl.train.eval import env_difficulty, eval_samples, summarize

        assert self.dispatcher is not None
        o = self.cfg.orchestrator
        t0 = time.perf_counter()
        samples = eval_samples(self.cfg, o.eval_episodes, o.eval_pass_k, o.eval_difficulties)
        results = run_samples(self.dispatcher, samples, on_other=self._on_finished)
        out = summarize(samples, results, o.eval_pass_k, self.cfg.env.id, env_difficulty(self.cfg))
        with open(self.run_dir / EVAL_FILE, "a") as f:
            f.write(json.dumps({"step": self.state.step, **out, "wall_s": time.perf_counter() - t0}) + "\n")
        self.state.eval_lines += 1
        k = o.eval_pass_k
        self._log(
            f"held-out eval at step {self.state.step}: success {_fmt(out.get('success'))} "
            f"(T={self.cfg.rollout.temperature:g}), pass@{k} {_fmt(out.get(f'pass@{k}'))}, "
            f"greedy {_fmt(out.get('greedy'))}"
        )
        return out

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train to learner.steps; returns a summary. Raises TrainingStopped with the resume hint."""
        try:
            self.start()
            return self._loop()
        except LearnerDied as e:
            raise TrainingStopped(
                f"the learner actor died ({e}); the run stopped at step {self.state.step}. "
                + resume_hint(self.cfg, self.config_path)
            ) from e
        except BatchUnhealthy as e:
            raise TrainingStopped(
                f"{e} (at step {self.state.step}; nothing of this batch was trained)"
            ) from e
        except NoWorkersLeft as e:
            raise TrainingStopped(
                f"{e}; the run stopped at step {self.state.step} (orchestrator.max_worker_restarts="
                f"{self.cfg.orchestrator.max_worker_restarts}). " + resume_hint(self.cfg, self.config_path)
            ) from e
        finally:
            self.close()

    def _loop(self) -> dict[str, Any]:
        o, total = self.cfg.orchestrator, self.cfg.learner.steps
        t_start = time.perf_counter() - sum(r.get("wall_s", 0.0) for r in self.metrics.read()[-1:])
        last_ckpt = self.state.step
        if o.eval_every and self.state.step == 0 and self.state.eval_lines == 0:
            self._evaluate()  # the policy before any RL step, on the same held-out tasks
        with ProgressLine(total, self.console, self.cfg.logging.log_every) as progress:
            while self.state.step < total:
                t0 = time.perf_counter()
                while not self.buffer.batch_ready(self.groups_per_step, self.admission.open_indices()):
                    self._draw(busy=False)
                    self._poll(timeout=0.5)
                rollout_s = time.perf_counter() - t0
                out = self._train_step()
                if out is None:
                    continue
                evaluation, eval_s = None, 0.0
                if o.eval_every and (self.state.step % o.eval_every == 0 or self.state.step == total):
                    t1 = time.perf_counter()
                    evaluation = self._evaluate()
                    eval_s = time.perf_counter() - t1
                counts, self.step_counts = self.step_counts, {}
                rec = step_record(
                    step=self.state.step,
                    policy_version=self.state.version,
                    wall_s=time.perf_counter() - t_start,
                    batch=out["batch"],
                    learner=out["learner"],
                    timings={
                        "rollout": rollout_s,
                        **out["timings"],
                        "eval": eval_s,
                        "step": time.perf_counter() - t0,
                    },
                    counters=counts,
                    evaluation=evaluation,
                )
                rec["stage"] = self.state.stage
                rec["throughput/rollout_tokens_per_s"] = out["batch"]["generated_tokens"] / max(
                    rec["time/step_s"], 1e-9
                )
                self.sinks.write(rec)
                self.sinks.write_samples(self.state.step, out["samples"])
                steps_in_stage = self.state.step - self.state.stage_start
                success = (evaluation or {}).get("success")
                if self.state.step < total and self.stages.should_advance(
                    self.state.stage, steps_in_stage, success
                ):  # the gate is met: no rollout of the next step starts under this stage's limits
                    self._next_stage(steps_in_stage, success)
                    last_ckpt = self.state.step
                    progress.update(rec)
                    continue
                if self.state.step < total:  # the next rollouts start before the checkpoint is written
                    self._draw(busy=False)
                    self._poll(timeout=0)
                due = o.checkpoint_every and self.state.step % o.checkpoint_every == 0
                if due or self.state.step == total:
                    ckpt_s = self._checkpoint()
                    last_ckpt = self.state.step
                    progress.note(f"checkpoint at step {self.state.step} ({ckpt_s:.1f} s)")
                progress.update(rec)
        evals = _read_jsonl(self.run_dir / EVAL_FILE)
        return {
            "run_dir": str(self.run_dir),
            "steps": self.state.step,
            "last_checkpoint": last_ckpt,
            "counters": dict(self.state.counters),
            "final": self.metrics.read()[-1] if self.metrics.path.exists() else {},
            "evals": evals,
        }

    def _next_stage(self, steps_in_stage: int, success: float | None) -> None:
        """The gate of the current stage is met: checkpoint in the next stage, then restart the workers and
        the learner from that checkpoint with the next stage's config (the resume path)."""
        done = self.stages.name(self.state.stage)
        self.state.stage += 1
        self.state.stage_start = self.state.step
        self._log(
            f"stage {done} done at step {self.state.step} ({steps_in_stage} steps, held-out success "
            f"{_fmt(success)}); entering stage {self.stages.name(self.state.stage)}"
        )
        self._checkpoint()
        self._close_actors()
        self.buffer = ExperienceBuffer(self.group_size, self.cfg.orchestrator.buffer_order)
        self.admission.reset()
        self.sync = WeightSync(self.cfg.orchestrator.weight_sync_timeout_s)
        self._switching_stage = True
        try:
            self.start()
        finally:
            self._switching_stage = False

    def _close_actors(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None
        if self.learner is not None:
            self.learner.close()
            self.learner = None

    def close(self) -> None:
        t0 = time.perf_counter()
        self._close_actors()
        self.sinks.close()
        t1 = time.perf_counter()
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        if os.environ.get("ODYSSEY_TIMING"):
            self._log(f"close: actors {t1 - t0:.1f} s, ray shutdown {time.perf_counter() - t1:.1f} s")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _config_changes(run_dir: Path, cfg: Any) -> list[str]:
    """Dotted keys whose value differs between the run dir's config.yaml and `cfg`."""
    from rl.config import RESOLVED_NAME, parse_yaml

    path = run_dir / RESOLVED_NAME
    if not path.exists():
        return []
    old, new = _flat(parse_yaml(path.read_text())), _flat(cfg.model_dump(mode="json"))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "-"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def _keep_first_lines(path: Path, n: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    if len(lines) > n:
        with open(path.with_name(path.stem + ".superseded" + path.suffix), "a") as f:
            f.write("\n".join(lines[n:]) + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines[:n]))
    shutil.move(tmp, path)
