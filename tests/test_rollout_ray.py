"""Rollout on a real Ray cluster with real Docker sandboxes.

- `odyssey rollout` (cli_main) with two RolloutWorker actors and the TorchEngine policy;
- two actors driven by a calculator-using scripted policy, so calc really runs in the Docker sandboxes;
- `ray job submit --working-dir . -- odyssey rollout ...` against a `ray start --head` cluster, between two
  local runs: all three load the one KDA kernel binary built before them and compile nothing (issue 18).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.rollout.tasks import TaskStream
from rl.rollout.worker import RolloutWorker, WorkerSettings
from rl.trajectory import TrajectoryStore
from tests.calc_oracle_engine import CalcOracleEngine

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.ray, pytest.mark.docker]


@pytest.fixture(scope="module")
def docker_image(docker_sandbox):
    """The sandbox image (shared fixture: skips with the fix, or fails when ODYSSEY_REQUIRE_DOCKER=1)."""
    return docker_sandbox


FAST = [
    "rollout.max_new_tokens=8",
    "rollout.max_turns=2",
    "rollout.concurrent_episodes=2",
    "rollout.sandbox_pool_size=1",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_two_ray_workers(ray_session, docker_image, tmp_path):
    from rl.rollout.cli import cli_main

    run_dir = tmp_path / "run"
    rc = cli_main(
        ["configs/tiny.yaml", "--episodes", "4", "--run-dir", str(run_dir), "rollout.num_workers=2", *FAST]
    )
    assert rc == 0
    trajs = TrajectoryStore(run_dir / "trajectories").read_all()
    # the first 4 samples of the training stream: tasks 0 and 1, group_size (tiny.yaml: 4) -> 4 of task 0
    assert sorted(t.metadata["sample_key"] for t in trajs) == [f"train/0/{j}" for j in range(4)]
    assert (
        len({t.metadata["sample_seed"] for t in trajs}) == 4 and len({t.metadata["seed"] for t in trajs}) == 1
    )
    assert {t.metadata["worker_id"] for t in trajs} == {0, 1}  # a group spans workers
    assert all(t.infra_error is None and "total" in t.rewards and t.n_generated > 0 for t in trajs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_stored"] == 4 and summary["workers"] == 2 and summary["worker_failures"] == []
    assert (run_dir / "config.yaml").exists()
    marks = summary["startup_s"]  # seconds since this (test) process started, in the order they happened
    assert list(marks) == ["config", "ray", "workers_ready", "first_episode"], marks
    assert 0 < marks["config"] <= marks["ray"] <= marks["workers_ready"] <= marks["first_episode"], marks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ray_workers_run_tools_in_docker(ray_session, docker_image, tmp_path):
    import ray

    from rl.rollout.worker import RolloutWorker, WorkerSettings

    settings = WorkerSettings(
        env_id="arith",
        env_kwargs={"difficulty": 1},
        store_dir=str(tmp_path / "store"),
        rewards=[{"name": "outcome", "weight": 1.0}, {"name": "subgoal", "weight": 0.2}],
        concurrency=2,
        sandbox_pool_size=2,
    )
    actor = ray.remote(num_cpus=1)(RolloutWorker)
    workers = [actor.remote(settings, i, engine=CalcOracleEngine()) for i in range(2)]
    samples = TaskStream(base_seed=0).first_samples(4, group_size=1)
    try:
        reports = ray.get([w.run.remote(samples[i::2]) for i, w in enumerate(workers)], timeout=300)
    finally:
        ray.get([w.close.remote() for w in workers], timeout=120)
        for w in workers:
            ray.kill(w)
    trajs = TrajectoryStore(tmp_path / "store").read_all()
    assert len(trajs) == 4 and {t.metadata["worker_id"] for t in trajs} == {0, 1}
    for t in trajs:
        assert t.infra_error is None and t.outcome == 1.0 and t.rewards["outcome"] == 1.0, t.step_infos
        assert t.step_infos[0]["tool_calls"][0]["name"] == "calc" and t.step_infos[0]["subgoals"]
    assert sum(r["tool_calls"] for r in reports) == 8 and sum(r["infra_errors"] for r in reports) == 0


class DyingRolloutWorker(RolloutWorker):
    """A RolloutWorker actor that dies (os._exit, like an OOM kill) during its second episode, after the
    first one came back."""

    async def run_one(self, sample):
        if self._done >= 1:
            os._exit(1)
        return await super().run_one(sample)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dead_worker_is_replaced_and_nothing_is_lost(ray_session, docker_image, tmp_path):
    """Worker 0 dies during its second episode: the failure is named, a new actor reruns the episode it
    held, and every sample is stored exactly once."""
    import io

    import ray
    from rich.console import Console

    from rl.rollout.cli import run_on_ray

    settings = WorkerSettings(
        env_id="arith",
        env_kwargs={"difficulty": 1},
        store_dir=str(tmp_path / "store"),
        rewards=[{"name": "outcome", "weight": 1.0}],
        concurrency=1,
        sandbox_pool_size=1,
    )
    spawned: list[int] = []

    restarted_at = []

    def factory(i: int):
        if i in spawned:
            restarted_at.append(time.perf_counter())
        cls = DyingRolloutWorker if i == 0 and i not in spawned else RolloutWorker
        spawned.append(i)
        return ray.remote(num_cpus=1, max_restarts=0)(cls).remote(settings, i, engine=CalcOracleEngine())

    samples = TaskStream(base_seed=0).first_samples(6, group_size=2)
    t0 = time.perf_counter()
    report, failures = run_on_ray(settings, samples, 2, Console(file=io.StringIO()), actor_factory=factory)
    t1 = time.perf_counter()
    # the driver's wall time covers the restart (the new actor's start-up and its episodes), not only the
    # replacement worker's own run: tokens/s is not inflated by a restart
    assert restarted_at and t1 - restarted_at[0] <= report.wall_s <= t1 - t0, (report.wall_s, t0, t1)
    keys = sorted(t.metadata["sample_key"] for t in TrajectoryStore(tmp_path / "store").read_all())
    assert keys == sorted(s.key for s in samples)  # every sample once: none lost, none duplicated
    assert len(failures) == 1 and failures[0].startswith("rollout worker 0 failed"), failures
    assert "1 episodes re-queued" in failures[0] and "replaced" in failures[0]
    assert spawned == [0, 1, 0] and report.episodes == 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(docker_image):
    """A `ray start --head --block` cluster of its own (own temp dir and ports); SIGTERM stops it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)  # a job imports the package from its uploaded working dir, as a user's does
    tmp = Path(f"/tmp/ray_head_{os.getpid()}")  # AF_UNIX socket paths must stay short
    tmp.mkdir(exist_ok=True)
    dash = _free_port()
    cmd = [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={_free_port()}",
        f"--dashboard-port={dash}",
        "--include-dashboard=true",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        "--num-cpus=4",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
    ]
    log = open(tmp / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:
            r = subprocess.run(
                [str(VENV_BIN / "ray"), "job", "list", "--address", address],
                env=env,
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                break
            if head.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray head did not come up: {(tmp / 'head.log').read_text()[-3000:]}")
            time.sleep(2)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _kernel_cache_state() -> tuple[tuple[int, int], ...]:
    """(builds in the cache's log, the binary's mtime) of each compiled kernel file (kda_cpu, fused_cpu)."""
    from model import artifact_cache, fused_cpu, kda_cpu

    return tuple(
        (artifact_cache.build_count(k.cache_name), k.binary.stat().st_mtime_ns)
        for k in (kda_cpu.KERNELS, fused_cpu.KERNELS)
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_run_job_and_local_run_compile_nothing(ray_head, tmp_path):
    """A local `odyssey rollout`, then `ray job submit --working-dir .` (the job and its actors import the
    package from Ray's uploaded copy, at another path), then a local run again: each loads both kernel files
    (kda_cpu, fused_cpu) from their one content-keyed cache entry (their logs say so) and none compiles (the
    caches' build logs and the binaries' mtimes do not change).
    The job's episodes are stored and scored as usual."""
    from model import fused_cpu, kda_cpu

    address, env = ray_head
    for k in (kda_cpu, fused_cpu):
        assert k.load() is not None, f"{k.SOURCE.name} did not build: run python -m {k.__name__} --verbose"
    state = _kernel_cache_state()
    loaded = [f"{k.CACHE_NAME}: fused CPU kernels from {k.KERNELS.binary.parent}"
              for k in (kda_cpu, fused_cpu)]
    local_env, job_env = {**env, "PYTHONPATH": str(REPO)}, env
    submit = [str(VENV_BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
              "--entrypoint-num-cpus", "1", "--"]  # fmt: skip
    probe = subprocess.run(
        [*submit, "python", "-c", "import model.kda_cpu as k; print('IMPORTED_FROM', k.__file__)"],
        cwd=REPO, env=job_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0 and "IMPORTED_FROM" in probe.stdout, probe.stdout[-3000:]
    assert f"IMPORTED_FROM {REPO}" not in probe.stdout  # the uploaded copy: a path this checkout is not at

    def rollout(kind: str) -> tuple[Path, str]:
        run_dir = tmp_path / kind
        args = ["rollout", "configs/tiny.yaml", "--episodes", "4", "--run-dir", str(run_dir), *FAST]
        cmd = [*submit, "odyssey", *args] if kind == "job" else [str(VENV_BIN / "odyssey"), *args]
        r = subprocess.run(cmd, cwd=REPO, env=job_env if kind == "job" else local_env, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"{kind}: {out[-4000:]}"
        # every kernel the run loads comes from its one cache entry (rollouts load fused_cpu; kda_cpu only
        # serves long no-grad prefills)
        seen = re.findall(r"\] (\w+: fused CPU kernels from \S+)", out)
        assert seen and set(seen) <= set(loaded), f"{kind}: {out[-4000:]}"
        assert "building the fused CPU kernels" not in out, f"{kind}: {out[-4000:]}"
        assert _kernel_cache_state() == state, f"{kind} rebuilt the kernels"
        return run_dir, out

    rollout("local")
    run_dir, out = rollout("job")
    assert "rollout summary" in out and "succeeded" in out
    trajs = TrajectoryStore(run_dir / "trajectories").read_all()
    assert len(trajs) == 4 and {t.metadata["worker_id"] for t in trajs} <= {0, 1}
    assert all(t.infra_error is None and "total" in t.rewards for t in trajs)
    assert json.loads((run_dir / "summary.json").read_text())["episodes_stored"] == 4
    rollout("local-again")
