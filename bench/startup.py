"""Start-up of a rollout: `ray job submit` to a running cluster against a local `odyssey rollout` (issue 18).

Against a real `ray start --head` on this machine, in one run (so the machine's load affects all of them),
each figure the median of ROUNDS rounds; a round runs, in order, the issue's command
`odyssey rollout configs/tiny.yaml --episodes 8`:

    local       `odyssey rollout ...` (an embedded Ray)                        launch -> first stored episode
    job         `ray job submit --working-dir . -- odyssey rollout ...`        launch -> first stored episode
    second job  the same job again, submitted right after the first finished  launch -> first stored episode

"First stored episode" is the first Arrow file in the run's trajectory store (the driver appends each
episode as it finishes). Each run also writes its own start-up marks (summary.json "startup_s",
rl/rollout/startup.py: seconds since its process started to config read, Ray up, workers ready, first
episode); for a job, launch -> first episode minus the driver's own mark is what `ray job submit` adds
before the entrypoint runs (upload, job supervisor). Checked, and asserted: the jobs import the package
from Ray's uploaded copy of the repo (a different path than this checkout), and no run compiles either
C++ kernel (kda_cpu, fused_cpu): each cache's build log and binary mtime do not change
(model/artifact_cache.py), and no run logs a build. Before the content-keyed cache, every job at a new
path recompiled kda_cpu.cpp (issue 18: 73 s to the first episode against 16 s locally). Target: a job's
first episode within 1.5x of the local run's.

    .venv/bin/python bench/startup.py            # -> bench/results/startup.json (~5 min on 2 quiet cores)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model import artifact_cache, fused_cpu, kda_cpu  # noqa: E402

VENV_BIN = Path(sys.executable).parent
ROUNDS = 3
TARGET_RATIO = 1.5
ROLLOUT = ["configs/tiny.yaml", "--episodes", "8"]
KERNELS = (kda_cpu.KERNELS, fused_cpu.KERNELS)
PHASES = ("config", "ray", "workers_ready", "first_episode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    return env


def start_head(tmp: Path) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` with its own temp dir and ports (the `odyssey` of this venv on PATH)."""
    dash = _free_port()
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={_free_port()}",
        f"--dashboard-port={dash}", "--include-dashboard=true",
        f"--dashboard-agent-listen-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
        "--num-cpus=3", f"--temp-dir={tmp}", "--disable-usage-stats",
    ]  # fmt: skip
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}  # jobs must import the uploaded copy
    log = open(tmp / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 180
    while subprocess.run([str(VENV_BIN / "ray"), "job", "list", "--address", address], env=env,
                         capture_output=True).returncode != 0:  # fmt: skip
        if head.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"ray head did not come up: {(tmp / 'head.log').read_text()[-3000:]}")
        time.sleep(2)
    return head, address


def timed_run(cmd: list[str], store: Path, env: dict[str, str], timeout: float = 900) -> dict:
    """Run `cmd`; seconds from launch to the first Arrow file in `store`, and to the process's exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)  # drains the pipe
    reader.start()
    first = None
    try:
        while proc.poll() is None:
            if first is None and store.is_dir() and any(store.glob("*.arrow")):
                first = time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{cmd[:3]} timed out:\n{''.join(out)[-3000:]}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:  # never leave a run behind
            proc.kill()
            proc.wait()
    exit_s = time.perf_counter() - t0
    reader.join(timeout=30)
    text = "".join(out)
    if first is None and store.is_dir() and any(store.glob("*.arrow")):
        first = exit_s  # finished between two polls
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed (rc {proc.returncode}):\n{text[-4000:]}")
    return {"first_episode_s": round(first, 2), "exit_s": round(exit_s, 2), "log": text}


def last_compile_s() -> dict[str, float | None]:
    """Seconds the last recorded build of each kernel took (what every job at a new path paid before)."""
    out = {}
    for k in KERNELS:
        log = artifact_cache.cache_root() / k.cache_name / artifact_cache.BUILD_LOG
        lines = log.read_text().splitlines() if log.is_file() else []
        out[k.cache_name] = float(lines[-1].split("seconds=")[1].split()[0]) if lines else None
    return out


def kernel_state() -> dict[str, tuple[int, int]]:
    """Per kernel: (builds recorded in its cache's log, its binary's mtime in ns)."""
    out = {}
    for k in KERNELS:
        out[k.cache_name] = (artifact_cache.build_count(k.cache_name), k.binary.stat().st_mtime_ns)
    return out


def startup_marks(run_dir: Path) -> dict[str, float]:
    """The run's own start-up marks (seconds since its process started), from its summary.json."""
    return json.loads((run_dir / "summary.json").read_text())["startup_s"]


def main() -> int:
    for k in KERNELS:
        assert k.load() is not None, f"the {k.cache_name} kernels do not build here: run `make setup`"
    env = _env()
    local_env = {**env, "PYTHONPATH": str(REPO)}
    job_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    load0 = list(os.getloadavg())
    tmp = Path(tempfile.mkdtemp(prefix="odyssey_startup_", dir="/tmp"))
    head, address = start_head(tmp)
    submit = [str(VENV_BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
              "--entrypoint-num-cpus", "1", "--"]  # fmt: skip
    runs: dict[str, list[dict]] = {"local": [], "job": [], "second_job": []}
    try:
        probe = subprocess.run(
            [*submit, "python", "-c", "import model.kda_cpu as k; print('IMPORTED_FROM', k.__file__)"],
            cwd=REPO, env=job_env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        found = [ln.split()[1] for ln in probe.stdout.splitlines() if ln.startswith("IMPORTED_FROM")]
        where = found[0] if found else ""
        assert probe.returncode == 0 and where and not where.startswith(str(REPO)), probe.stdout[-2000:]
        state0 = kernel_state()
        for r in range(ROUNDS):
            for kind in ("local", "job", "second_job"):
                run_dir = tmp / f"r{r}-{kind}"
                args = [*ROLLOUT, "--run-dir", str(run_dir)]
                if kind == "local":
                    cmd, run_env = [str(VENV_BIN / "odyssey"), "rollout", *args], local_env
                else:
                    cmd, run_env = [*submit, "odyssey", "rollout", *args], job_env
                res = timed_run(cmd, run_dir / "trajectories", run_env)
                log = res.pop("log")
                res["compiled_kernels"] = "building the fused CPU kernels" in log  # the cache's progress
                res["startup_s"] = marks = startup_marks(run_dir)
                res["before_entrypoint_s"] = round(res["first_episode_s"] - marks["first_episode"], 2)
                runs[kind].append(res)
                print(f"round {r} {kind:>10}: first episode {res['first_episode_s']:6.1f} s, "
                      f"exit {res['exit_s']:6.1f} s")  # fmt: skip
        state1 = kernel_state()
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(x["first_episode_s"] for x in v) for k, v in runs.items()}
    phases = {k: {p: statistics.median(x["startup_s"][p] for x in v) for p in PHASES}
              | {"before_entrypoint": statistics.median(x["before_entrypoint_s"] for x in v)}
              for k, v in runs.items()}  # fmt: skip
    ratio = med["job"] / med["local"]
    compiled = any(x["compiled_kernels"] for v in runs.values() for x in v)
    no_compile = state1 == state0 and not compiled
    result = {
        "what": "seconds from launch to the first stored episode (median of rounds); "
        f"`odyssey rollout {' '.join(ROLLOUT)}`; jobs: `ray job submit --working-dir .` to "
        "`ray start --head`, same machine",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": load0, "load_average_at_end": list(os.getloadavg())},
        "rounds": ROUNDS,
        "local_first_episode_s": med["local"],
        "job_first_episode_s": med["job"],
        "second_job_first_episode_s": med["second_job"],
        "job_over_local": round(ratio, 3),
        "second_job_over_local": round(med["second_job"] / med["local"], 3),
        "target_job_over_local": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "phases_s": phases,  # medians; cumulative seconds since the run's process started (+ before it)
        "kernel_builds_during_bench": {k: state1[k][0] - state0[k][0] for k in state0},
        "last_kernel_compile_s": last_compile_s(),  # from the caches' build logs: the cost a rebuild adds
        "kernel_binaries_unchanged": {k: state1[k][1] == state0[k][1] for k in state0},
        "job_imported_from": where,
        "runs": runs,
    }  # fmt: skip
    out = REPO / "bench" / "results" / "startup.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    assert no_compile, "a run compiled a C++ kernel: the cache is not shared across paths"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
