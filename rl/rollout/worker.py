"""`RolloutWorker`: one engine, one sandbox pool, many concurrent episodes -> scored, stored trajectories.

    samples = TaskStream(base_seed=0).first_samples(4, group_size=2)   # rl/rollout/tasks.py
    worker = RolloutWorker(settings, worker_id=0)          # in-process (tests, scripts)
    report = asyncio.run(worker.run(samples))

    actor = ray.remote(RolloutWorker).remote(settings, 0)  # the same class as a Ray (async) actor
    traj = ray.get(actor.run_sample.remote(samples[0]))    # what rl/rollout/dispatch.py calls

A sample is (task, sample index): the env regenerates the task from `task.seed` and reset options,
the sampling draws from the sample's own seed (greedy samples decode at temperature 0).
Episodes run as asyncio tasks (at most `settings.concurrency` at once in `run`; the dispatcher keeps
at most that many `run_sample` calls in flight) that share one batched engine (`engine.agenerate`),
so their decode steps are batched together while others wait on the sandbox. Each finished episode
is scored with `rewards.compose` (configured specs) and counted in the worker's statistics; `run`
appends it to the worker's `TrajectoryStore` at once (in-process use), while `run_sample` returns it
to the caller, which stores it (on Ray, the driver: workers need no shared disk). Every sample yields
exactly one trajectory: failures come back as trajectories marked `infra_error` (see agent_loop.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import shutil
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envs.threads import hung_threads
from rewards.compose import RewardMetrics
from rl.policy import PolicySpec
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from rl.rollout.engines import build_engine
from rl.rollout.tasks import Sample
from rl.trajectory import Trajectory, TrajectoryStore


@dataclass
class WorkerSettings:
    """Everything a worker needs (plain data: pickled to Ray actors). Built from a RunConfig by
    `WorkerSettings.from_config`.

    env_id / env_kwargs: `envs.make(env_id, sandbox_pool=..., **env_kwargs)`.
    model_preset / model_overrides / checkpoint / dtype / init_seed: the policy, built by
    `rl.policy.build_policy` (these five fields are a `rl.policy.PolicySpec`). seed: the engine's base
    seed (requests carry their own; see rl/rollout/tasks.py).
    engine: "torch" (TorchEngine), "vllm" (VllmEngine on the plugin) or a factory's `pkg.module:fn`
    (rl/rollout/engines.py).
    episode: budgets and decoding. concurrency: episodes in flight per worker. shared_pool: the worker
    starts one shared SandboxPool of `sandbox_pool_size` (default: concurrency) on `sandbox_image`
    (None = default) when the env uses sandboxes; False = each env leases from its own pool.
    rewards: reward specs for rewards.compose ([] = leave unscored). store_dir: TrajectoryStore root.
    """

    env_id: str = "arith"
    env_kwargs: dict = field(default_factory=dict)
    model_preset: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    checkpoint: str | None = None
    dtype: str = "float32"
    init_seed: int = 0
    seed: int = 0
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    concurrency: int = 8
    shared_pool: bool = True
    sandbox_pool_size: int | None = None
    sandbox_image: str | None = None
    rewards: list = field(default_factory=list)
    store_dir: str | None = None
    max_batch_size: int = 64
    prefill_chunk_size: int = 2048
    torch_threads: int | None = None
    engine: str = "torch"

    @classmethod
    def from_config(cls, cfg: Any, store_dir: str | None = None) -> WorkerSettings:
        """From an `rl.config.RunConfig`: env, model (init seed = learner.seed), rollout budgets and
        sampling, sandbox pool (rollout.sandbox_pool_size 0 = each env makes its own), rewards."""
        r = cfg.rollout
        env_kwargs = dict(cfg.env.kwargs)
        env_kwargs["max_turns"] = r.max_turns  # the one source of the turn limit (rl/config/checks.py)
        return cls(
            env_id=cfg.env.id,
            env_kwargs=env_kwargs,
            **dataclasses.asdict(PolicySpec.from_config(cfg)),
            seed=r.seed,
            episode=EpisodeConfig(
                max_new_tokens=r.max_new_tokens,
                max_episode_tokens=r.max_tokens,
                max_turns=r.max_turns,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
            ),
            concurrency=r.concurrent_episodes,
            shared_pool=r.sandbox_pool_size > 0,
            sandbox_pool_size=r.sandbox_pool_size,
            sandbox_image=r.sandbox_image,
            rewards=[e.model_dump(exclude_none=True) for e in cfg.rewards],
            store_dir=store_dir,
            max_batch_size=max(64, r.concurrent_episodes),
            engine=r.engine,
        )


def policy_vision(engine: Any) -> tuple[int, int]:
    """(vision_patch_size, vision_max_pixels) of the engine's policy, (0, 0) when unknown or text-only: the
    codec prepares env images with them. TorchEngine: its model's config; VllmEngine: its checkpoint's
    config.json (it then refuses the images itself, naming the engine to use)."""
    cfg = getattr(engine, "config", None)
    if cfg is not None:
        return int(getattr(cfg, "vision_patch_size", 0) or 0), int(getattr(cfg, "vision_max_pixels", 0) or 0)
    model_dir = getattr(engine, "model_dir", None)
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return int(raw.get("vision_patch_size") or 0), int(raw.get("vision_max_pixels") or 0)
    return 0, 0


@dataclass
class WorkerReport:
    """Statistics of one `run` (summed over its episodes; merged across workers by `merge`)."""

    episodes: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    infra_errors: int = 0
    terminated: int = 0
    truncated: int = 0
    successes: float = 0.0
    wall_s: float = 0.0
    engine_forward_s: float = 0.0
    rewards: RewardMetrics = field(default_factory=RewardMetrics)  # per-component means, reward errors
    finish_reasons: dict[str, int] = field(default_factory=dict)
    infra_examples: list[str] = field(default_factory=list)
    episodes_by_env: dict[str, int] = field(default_factory=dict)
    infra_by_env: dict[str, int] = field(default_factory=dict)  # infra errors per env id (rl.rollout.health)
    infra_by_source: dict[str, int] = field(default_factory=dict)  # "env" | "sandbox" | "engine"
    workers: int = 1
    infra_retries: int = 0  # infra-failed attempts that were re-run (not counted in `episodes`)

    def add(self, t: Trajectory) -> None:
        env_id = str(t.metadata.get("env_id", "?"))
        self.episodes_by_env[env_id] = self.episodes_by_env.get(env_id, 0) + 1
        if t.infra_error:
            source = str(t.metadata.get("infra_source") or "unknown")
            self.infra_by_env[env_id] = self.infra_by_env.get(env_id, 0) + 1
            self.infra_by_source[source] = self.infra_by_source.get(source, 0) + 1
        self.episodes += 1
        self.tokens += t.n_tokens
        self.generated_tokens += t.n_generated
        self.turns += t.n_assistant_turns
        for info in t.step_infos:
            self.tool_calls += len(info.get("tool_calls") or [])
            self.tool_errors += len(info.get("tool_errors") or [])
        if t.infra_error:
            self.infra_errors += 1
            if len(self.infra_examples) < 3:
                self.infra_examples.append(t.infra_error[:300])
        self.terminated += bool(t.terminated and not t.infra_error)
        self.truncated += bool(t.truncated)
        self.successes += float(t.outcome or 0.0)
        self.rewards.update(t)
        for r in t.metadata.get("finish_reasons", []):
            self.finish_reasons[r] = self.finish_reasons.get(r, 0) + 1

    def merge(self, other: WorkerReport) -> WorkerReport:
        out = WorkerReport(rewards=self.rewards.merge(other.rewards))
        for k in self.__dataclass_fields__:
            v, w = getattr(self, k), getattr(other, k)
            if k == "rewards":
                continue
            if isinstance(v, dict):
                merged = dict(v)
                for kk, vv in w.items():
                    merged[kk] = merged.get(kk, 0) + vv
                setattr(out, k, merged)
            elif isinstance(v, list):
                setattr(out, k, (v + w)[:3])
            elif k == "wall_s":
                out.wall_s = max(v, w)  # workers run in parallel
            else:
                setattr(out, k, v + w)
        return out

    @property
    def reward_errors(self) -> int:
        return self.rewards.n_reward_errors

    def reward_means(self) -> dict[str, float]:
        """Mean of each reward component over the scored episodes."""
        return {k: self.rewards.sums[k] / self.rewards.counts[k] for k in sorted(self.rewards.sums)}

    @property
    def tokens_per_s(self) -> float:
        """Generated (sampled) tokens per second of wall time."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_s=self.tokens_per_s, reward_means=self.reward_means(), reward_errors=self.reward_errors
        )
        return d


class RolloutWorker:
    """Runs episodes concurrently on one engine. Usable in-process or as a Ray actor.

    settings: WorkerSettings. worker_id: names this worker in trajectory metadata.
    engine / env_factory / sandbox_pool: injected for tests (defaults: a TorchEngine on
    `build_policy(settings)`, `envs.make` on a SandboxPool the worker owns).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        worker_id: int = 0,
        *,
        engine: Any = None,
        env_factory: Callable[[Any], Any] | None = None,
        sandbox_pool: Any = None,
        tokenizer: Any = None,
    ):
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # checkpoint loading bars would flood the driver's log
        self.settings = settings
        self.worker_id = worker_id
        if settings.torch_threads:
            torch.set_num_threads(int(settings.torch_threads))
        if tokenizer is None:  # an HF checkpoint's own tokenizer when it ships one (docs/hf.md)
            from model.tokenizer import policy_tokenizer

            tokenizer = policy_tokenizer(settings.checkpoint)
        self.codec = ChatCodec(tokenizer)
        self._engine_dir: str | None = None
        self._own_engine = engine is None  # an injected engine is the caller's to shut down
        if engine is None:
            engine, self._engine_dir = build_engine(settings, self.codec.decode)
        self.engine = engine
        self.codec.patch_size, self.codec.max_pixels = policy_vision(engine)
        self._env_factory = env_factory
        self._pool = sandbox_pool
        self._own_pool = False
        self._pool_lock: asyncio.Lock | None = None
        self._pool_checked = False
        self._pool_warmup: asyncio.Task | None = None  # started by `ping`, awaited by the first episode
        self.store = TrajectoryStore(settings.store_dir) if settings.store_dir else None
        self._specs = None
        if settings.rewards:
            from rewards import validate_reward_specs

            self._specs = validate_reward_specs(settings.rewards)
        self._done = 0
        self._in_flight = 0
        self._report = WorkerReport()
        self._endpoint: Any = None  # the policy endpoint of agent envs, started by the first such episode
        self._io: concurrent.futures.ThreadPoolExecutor | None = None  # store writes, weight loads

    # ------------------------------------------------------------------ env + sandbox
    async def _ensure_pool(self) -> None:
        """Start the shared SandboxPool once, if configured and the env actually uses sandboxes."""
        warmup = self._pool_warmup
        if warmup is not None and warmup is not asyncio.current_task():
            self._pool_warmup = None
            await warmup  # `ping` started it: the first episode gets its failure, as if it had started it
        if self._pool_checked or not self.settings.shared_pool:
            return
        if self._pool_lock is None:
            self._pool_lock = asyncio.Lock()
        async with self._pool_lock:  # concurrent first episodes wait for one pool to be started
            if not self._pool_checked:
                try:
                    await self._start_pool()
                finally:
                    self._pool_checked = True

    async def _start_pool(self) -> None:
        s = self.settings
        if self._pool is not None:  # injected (tests)
            return
        try:
            probe = self.make_env()  # constructing an env leases nothing
        except Exception:  # no pool; run_one stores each episode marked with the construction error
            return
        uses = bool(getattr(probe, "uses_sandbox", False))
        probe.close()
        if not uses:
            return
        from sandbox.image import DEFAULT_IMAGE
        from sandbox.pool import SandboxPool

        size = s.sandbox_pool_size or s.concurrency
        pool = SandboxPool(size=max(1, size), image=s.sandbox_image or DEFAULT_IMAGE)
        await pool.start()
        self._pool, self._own_pool = pool, True  # visible to episodes only once started

    def make_env(self) -> Any:
        if self._env_factory is not None:
            return self._env_factory(self._pool)
        import envs

        kwargs = dict(self.settings.env_kwargs)
        kwargs.setdefault("tools_in_prompt", False)  # the chat template renders the tool schemas
        return envs.make(self.settings.env_id, sandbox_pool=self._pool, **kwargs)

    # ------------------------------------------------------------------ episodes
    async def run_sample(self, sample: Sample) -> Trajectory:
        """One episode of `sample`: play and score; the caller stores what it returns (on Ray, the driver:
        rl/rollout/dispatch.py). Always returns a trajectory (failures are marked `infra_error`)."""
        await self._ensure_pool()
        self._in_flight += 1
        try:
            traj = await self.run_one(sample)
            self._report.add(traj)
            return traj
        finally:
            self._in_flight -= 1
            self._done += 1

    async def run_one(self, sample: Sample) -> Trajectory:
        """One episode of `sample`: play and score (not counted, not stored). Always returns a trajectory."""
        return await self.score(await self.play(sample))

    async def play(self, sample: Sample) -> Trajectory:
        """Play one episode of `sample` (unscored). Always returns a trajectory."""
        s = self.settings
        task = sample.task
        meta = {**sample.metadata(), "worker_id": self.worker_id}
        cfg = dataclasses.replace(s.episode, temperature=0.0) if sample.greedy else s.episode
        try:
            env = self.make_env()
        except Exception as e:  # the env cannot even be built: still a marked, stored record
            traj = failed_trajectory(
                f"env construction: {type(e).__name__}: {e}",
                sample,
                s.env_id,
                self.engine.weight_version,
                meta,
            )
            traj.metadata["infra_source"] = "env"
        else:
            from envs.agent_env import AgentEnv

            if isinstance(env, AgentEnv):  # the user's agent drives the policy over the OpenAI API
                from rl.rollout.agent_episode import run_agent_episode

                return await run_agent_episode(
                    self.engine,
                    env,
                    self.codec,
                    cfg,
                    await self._policy_endpoint(),
                    seed=task.seed,
                    sample_seed=sample.seed,
                    reset_options=task.reset_options() or None,
                    metadata=meta,
                )
            traj = await run_episode(
                self.engine,
                env,
                self.codec,
                cfg,
                seed=task.seed,
                sample_seed=sample.seed,
                reset_options=task.reset_options() or None,
                metadata=meta,
            )
        return traj

    async def _policy_endpoint(self) -> Any:
        """This worker's OpenAI-compatible endpoint (rl/rollout/endpoint.py), started on first use."""
        if self._endpoint is None:
            from rl.rollout.endpoint import PolicyEndpoint

            endpoint = PolicyEndpoint()
            await endpoint.start()
            self._endpoint = endpoint
        return self._endpoint

    def _blocking(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """`fn(*args)` on this worker's own threads: never the loop's default executor, which user code (an
        async reward's asyncio.to_thread) may fill; agents and verifiers run on threads of their own."""
        if self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(4, f"worker{self.worker_id}-io")
        return asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def score(self, traj: Trajectory) -> Trajectory:
        """Score `traj` in place (async rewards, e.g. judges, are awaited here; other episodes go on)."""
        if self._specs:
            from rewards import acompose

            t0 = time.perf_counter()
            await acompose(traj, self._specs)
            traj.metadata["reward_s"] = round(time.perf_counter() - t0, 4)  # the metrics' time/reward_s
        return traj

    async def _store_and_count(self, traj: Trajectory) -> None:
        """Append `traj` to the worker's store (at once: a crash loses at most the episodes in flight) and
        count it in the report; a write cancelled mid-flight still counts if it lands."""
        if self.store is not None:
            stored = asyncio.ensure_future(self._blocking(self.store.append, traj))
            try:
                await asyncio.shield(stored)
            except asyncio.CancelledError:  # the write runs on in its thread: count it if it lands
                await asyncio.wait([stored])
                if not stored.cancelled() and stored.exception() is None:
                    self._report.add(traj)
                raise
        self._report.add(traj)

    async def run(self, samples: Sequence[Sample], return_trajectories: bool = False) -> dict:
        """Run `samples` (at most `concurrency` played at once; scoring does not hold a slot, so the next
        episode plays while an async reward waits). Returns the report dict (and the trajectories under
        "trajectories" when asked; in-process use)."""
        t0 = time.perf_counter()
        f0 = self.engine.stats.get("forward_s", 0.0) if hasattr(self.engine, "stats") else 0.0
        self._report, self._done = WorkerReport(), 0
        await self._ensure_pool()
        sem = asyncio.Semaphore(max(1, self.settings.concurrency))
        trajs: list[Trajectory | None] = [None] * len(samples)

        async def one(j: int, sample: Sample) -> None:
            self._in_flight += 1
            try:
                async with sem:  # bounds the episodes being played; a slow judge scores outside the slot
                    traj = await self.play(sample)
                trajs[j] = traj = await self.score(traj)
                await self._store_and_count(traj)
            except Exception:  # scoring/storing bugs: surface, but after the other episodes
                traceback.print_exc()
                raise
            finally:
                self._in_flight -= 1
                self._done += 1

        results = await asyncio.gather(*(one(j, x) for j, x in enumerate(samples)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        self._report.wall_s = time.perf_counter() - t0
        if hasattr(self.engine, "stats"):
            self._report.engine_forward_s = self.engine.stats.get("forward_s", 0.0) - f0
        if errors:
            raise RuntimeError(
                f"worker {self.worker_id}: {len(errors)} episodes could not be stored: {errors[0]!r}"
            )
        out = self._report.to_dict()
        if return_trajectories:
            out["trajectories"] = trajs
        return out

    async def progress(self) -> dict:
        """Live counters (the driver polls this for its progress bar)."""
        r = self._report
        return {
            "done": self._done,
            "in_flight": self._in_flight,
            "generated_tokens": r.generated_tokens,
            "infra_errors": r.infra_errors,
            "tool_errors": r.tool_errors,
            "infra_by_env": dict(r.infra_by_env),
            "infra_by_source": dict(r.infra_by_source),
            "infra_examples": list(r.infra_examples),
            "hung_threads": len(hung_threads()),  # agents/verifiers past their timeouts, still running
        }

    async def update_weights(self, weights: Any, version: int) -> int:
        """Load policy weights `version` into the engine; returns the version now loaded.

        weights: a state_dict, or a one-element list holding the ObjectRef of one (rl/train/weight_sync.py:
        the learner puts the weights in Ray's object store once, every worker gets them from there), or of a
        sharded learner's WeightBuckets manifest (rl/learner/shard_export.py: the engine loads the buckets one
        by one through `update_weights_stream`; an engine without it gets them assembled). The
        engine applies them between decode steps; episodes in flight continue on the new weights."""
        if isinstance(weights, list):
            (ref,) = weights
            weights = await ref
        from rl.weight_buckets import WeightBuckets

        if isinstance(weights, WeightBuckets):  # a sharded learner's sync: fetch and load a bucket at a time
            stream = getattr(self.engine, "update_weights_stream", None)
            if stream is not None:
                await self._blocking(stream, weights.names, weights.stream(), int(version))
                return int(self.engine.weight_version)
            weights = await self._blocking(lambda: {k: v for b in weights.stream() for k, v in b.items()})
        await self._blocking(self.engine.update_weights, weights, int(version))
        return int(self.engine.weight_version)

    async def weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def close(self) -> None:
        warmup, self._pool_warmup = self._pool_warmup, None
        if warmup is not None:  # a pool still starting is closed below once it exists, never leaked
            await asyncio.gather(warmup, return_exceptions=True)
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            await endpoint.stop()
        if hasattr(self.engine, "aclose"):
            await self.engine.aclose()
        if self._own_engine and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
        if self._engine_dir:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None
        io, self._io = self._io, None
        if io is not None:  # a write still running finishes in its thread
            io.shutdown(wait=False)
        if self._own_pool and self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def ping(self) -> int:
        """The readiness check (the driver waits for every worker's). It also starts the sandbox pool in the
        background, so container start-up overlaps the other workers' start-up instead of delaying the first
        episode; the first episode waits for it (and gets its error, if it failed)."""
        if self.settings.shared_pool and not self._pool_checked and self._pool_warmup is None:
            self._pool_warmup = asyncio.create_task(self._ensure_pool())
        return self.worker_id

    async def info(self) -> dict:
        """Where and what this worker is: id, pid, Ray node id, loaded weights version, episodes in flight."""
        import os

        try:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            node = None
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "node_id": node,
            "weight_version": int(self.engine.weight_version),
            "in_flight": self._in_flight,
        }


def failed_trajectory(
    error: str, sample: Sample, env_id: str, version: int, metadata: dict | None = None
) -> Trajectory:
    """An empty trajectory of `sample` marked `infra_error` (the episode could not run at all)."""
    meta = {**sample.metadata(), **(metadata or {}), "seed": sample.task.seed, "env_id": env_id,
            "policy_version": int(version)}
    return Trajectory.empty(meta, infra_error=error)
