"""model/artifact_cache.py and the kernel build keyed by content (issue 18): the same inputs give the same
artefact from any path; one build under an flock while others wait; a killed build blocks nothing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from model import artifact_cache, kda_cpu

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, cache: Path, cwd: Path, pythonpath: Path = REPO, **kw) -> subprocess.Popen:
    env = {**os.environ, "ODYSSEY_CACHE_DIR": str(cache), "PYTHONPATH": str(pythonpath)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, **kw,
    )  # fmt: skip


BUILD = """
    import time
    from model.artifact_cache import cached_build
    def build(tmp):
        time.sleep({sleep})
        (tmp / "out.txt").write_text("built")
        return "fresh"
    where, built = cached_build("demo", "k1", build, what="the demo artefact")
    print("RESULT", where, built, (where / "out.txt").read_text())
"""


def test_same_key_same_artefact_from_any_working_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ODYSSEY_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def build(tmp: Path) -> str:
        calls.append(tmp)
        (tmp / "out.txt").write_text("x")
        return "fresh"

    lines: list[str] = []
    where, built = artifact_cache.cached_build("demo", "k1", build, say=lines.append)
    assert built == "fresh" and (where / "out.txt").read_text() == "x" and len(calls) == 1
    assert any(ln.startswith("building demo into") for ln in lines)
    assert any(ln.startswith("built demo in") for ln in lines)
    for d in ("a", "b"):  # another working directory: nothing is built
        (tmp_path / d).mkdir()
        monkeypatch.chdir(tmp_path / d)
        assert artifact_cache.cached_build("demo", "k1", build, say=lines.append) == (where, None)
    assert len(calls) == 1 and artifact_cache.build_count("demo", "k1") == 1
    assert artifact_cache.content_key("ab", "c") != artifact_cache.content_key("a", "bc")


def test_a_failed_build_leaves_nothing_and_is_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("ODYSSEY_CACHE_DIR", str(tmp_path))

    def broken(tmp: Path) -> None:
        (tmp / "half.o").write_text("partial")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        artifact_cache.cached_build("demo", "k1", broken, say=lambda m: None)
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["k1.lock"]
    where, built = artifact_cache.cached_build("demo", "k1", lambda tmp: (tmp / "ok").touch() or 1, say=print)
    assert built == 1 and (where / "ok").exists() and artifact_cache.build_count("demo") == 1


def test_concurrent_processes_build_once(tmp_path):
    """Three processes ask at once: one builds (2 s), the others say they wait and then use its result."""
    cache = tmp_path / "cache"
    procs = [_run(BUILD.format(sleep=2.0), cache, tmp_path) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = [ln for o in outs for ln in o.splitlines() if ln.startswith("RESULT")]
    assert len(results) == 3 and len({r.split()[1] for r in results}) == 1  # one directory for all
    assert all(r.endswith(" built") for r in results)
    assert sum(" fresh " in r for r in results) == 1  # exactly one process built it
    assert sum("waiting for another process to finish building the demo artefact" in o for o in outs) >= 1
    log = (cache / "demo" / artifact_cache.BUILD_LOG).read_text().splitlines()
    assert len(log) == 1 and " key=k1 " in log[0]


def test_a_build_killed_midway_blocks_nothing(tmp_path):
    """SIGKILL a process in the middle of its build (holding the lock, its temp dir half written): the next
    process does not wait on a stale lock (the kernel dropped the flock), removes the temp dir, builds."""
    cache = tmp_path / "cache"
    victim = _run(BUILD.format(sleep=600), cache, tmp_path, start_new_session=True)
    group = cache / "demo"
    deadline = time.time() + 60
    while not list(group.glob(".k1.tmp-*")):  # the victim holds the lock and is building
        assert time.time() < deadline and victim.poll() is None, victim.communicate()[0]
        time.sleep(0.1)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    t0 = time.perf_counter()
    after = _run(BUILD.format(sleep=0.0), cache, tmp_path)
    out = after.communicate(timeout=60)[0]
    assert after.returncode == 0 and " fresh built" in out, out
    assert time.perf_counter() - t0 < 30  # no waiting on the dead builder's lock
    assert not list(group.glob(".k1.tmp-*")) and (group / "k1" / "out.txt").exists()


def test_kernel_key_is_content_not_path(tmp_path):
    """A copy of the package at another path (as `ray job submit` uploads it) computes the same key and loads
    the cached binary without compiling; a changed source gets a new key."""
    assert kda_cpu.load() is not None, "kda_cpu.cpp did not build: run python -m model.kda_cpu --verbose"
    key = kda_cpu.build_key()
    so = artifact_cache.cache_root() / kda_cpu.CACHE_NAME / key / f"{kda_cpu.module_name()}.so"
    mtime, builds = so.stat().st_mtime_ns, artifact_cache.build_count(kda_cpu.CACHE_NAME)
    copy = tmp_path / "elsewhere"
    shutil.copytree(REPO / "model", copy / "model", ignore=shutil.ignore_patterns("__pycache__"))
    code = f"""
        import model.kda_cpu as k
        assert k.__file__.startswith({str(copy)!r}), k.__file__
        print("KEY", k.build_key(), k.load() is not None)
    """
    p = _run(code, artifact_cache.cache_root(), copy, pythonpath=copy)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and f"KEY {key} True" in out, out
    assert "building" not in out
    assert so.stat().st_mtime_ns == mtime and artifact_cache.build_count(kda_cpu.CACHE_NAME) == builds
    src = copy / "model" / "kda_cpu.cpp"
    src.write_text(src.read_text() + "\n// changed\n")
    code = "import model.kda_cpu as k; print('KEY', k.build_key())"
    p = _run(code, artifact_cache.cache_root(), copy, pythonpath=copy)
    assert f"KEY {key}" not in p.communicate(timeout=300)[0]
