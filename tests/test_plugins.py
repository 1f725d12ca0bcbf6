"""Env registry and plugin discovery: the example plugin pip-installed into a temp dir and found
through its `odyssey.envs` entry point (in a fresh interpreter and in-process), broken and
duplicate plugins reported by name while everything else loads, and `odyssey envs list`."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium
import pytest

import envs
from envs import registry
from envs.registry import EnvLoadError, EnvNotFoundError, EnvRegistrationError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """`pip install` of examples/plugin_env into a temp target dir (never into the shared venv)."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = tmp / "src"
    shutil.copytree(
        ROOT / "examples" / "plugin_env", src, ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    site = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    res = subprocess.run([*cmd, "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (site / "odyssey_example_env" / "env.py").exists()
    return site


@pytest.fixture
def on_path():
    """Put directories on sys.path for one test and rescan plugins; undo both afterwards."""
    added: list[str] = []

    def add(path: Path) -> None:
        sys.path.insert(0, str(path))
        added.append(str(path))
        importlib.invalidate_caches()

    yield add
    for p in added:
        sys.path.remove(p)
    for name in [m for m in sys.modules if m.startswith(("odyssey_example_env", "odyssey_raising_plugin"))]:
        del sys.modules[name]
    importlib.invalidate_caches()
    registry.discover()


def _fake_dist(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[odyssey.envs]\n{entry_points}\n")


# ---------------------------------------------------------------------------------- example plugin
def test_installed_plugin_found_in_fresh_interpreter(plugin_site):
    script = textwrap.dedent(
        """
        import json, gymnasium, envs
        from rl.cli import main
        entries = {e.id: e.to_dict() for e in envs.list_envs()}
        env = gymnasium.make("odyssey/WordCount-v0", max_words=3)
        env.reset(seed=0)
        last = [env.step(a) for a in env.unwrapped.oracle_actions()][-1]
        print(json.dumps({"entry": entries["word-count"], "success": last[4]["success"]}))
        main(["envs", "list"])
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{plugin_site}{os.pathsep}{ROOT}", "COLUMNS": "200"}
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr
    first, table = res.stdout.split("\n", 1)
    out = json.loads(first)
    assert out["entry"] == {
        "id": "word-count",
        "gym_id": "odyssey/WordCount-v0",
        "source": "plugin odyssey-example-env",
        "entry_point": "odyssey_example_env.env:WordCountEnv",
        "status": "ok",
        "error": None,
    }
    assert out["success"] == 1.0
    assert "word-count" in table and "plugin odyssey-example-env" in table and "arith" in table


def test_installed_plugin_found_in_process(plugin_site, on_path):
    assert "word-count" not in {e.id for e in envs.list_envs(load=False)}
    on_path(plugin_site)
    registry.discover()
    env = envs.make("word-count", max_words=5)
    msgs, info = env.reset(seed=1)
    assert info["env_id"] == "word-count" and msgs[1]["content"].startswith("Sentence: ")
    steps = [env.step(a) for a in env.oracle_actions()]
    assert steps[0][4]["subgoals"] == ["counted"] and steps[-1][4]["success"] == 1.0
    gym_env = gymnasium.make("odyssey/WordCount-v0")
    assert gym_env.unwrapped.env_id == "word-count"


# ---------------------------------------------------------------------------------- broken plugins
def test_broken_plugins_reported_by_name_while_others_load(tmp_path, on_path, plugin_site):
    site = tmp_path / "site"
    _fake_dist(site, "broken-missing", "ghost-env = odyssey_no_such_module:Env")
    _fake_dist(site, "broken-raises", "exploding-env = odyssey_raising_plugin:Env")
    (site / "odyssey_raising_plugin.py").write_text("raise RuntimeError('plugin import exploded')\n")
    _fake_dist(site, "dup-plugin", "arith = envs.arith:ArithEnv")
    on_path(site)
    on_path(plugin_site)
    with pytest.warns(
        UserWarning, match="'arith' from dup-plugin was not registered: env id 'arith' is already"
    ):
        registry.discover()
    with pytest.warns(UserWarning) as caught:
        entries = envs.list_envs()
    messages = "\n".join(str(w.message) for w in caught)
    assert "'ghost-env' (plugin broken-missing)" in messages and "ModuleNotFoundError" in messages
    assert "'exploding-env' (plugin broken-raises)" in messages and "plugin import exploded" in messages

    status = {(e.id, e.source): e.status for e in entries}
    assert status[("ghost-env", "plugin broken-missing")] == "broken"
    assert status[("exploding-env", "plugin broken-raises")] == "broken"
    assert status[("arith", "plugin dup-plugin")] == "broken"
    for ok in [("arith", "builtin"), ("code-repair", "builtin"), ("long-docs", "builtin")]:
        assert status[ok] == "ok"
    assert status[("word-count", "plugin odyssey-example-env")] == "ok"

    with pytest.raises(EnvLoadError, match=r"env 'ghost-env' \(plugin broken-missing\) failed to import"):
        envs.make("ghost-env")
    assert envs.make("arith", use_sandbox=False).reset(seed=0)[1]["env_id"] == "arith"  # the builtin wins
    assert envs.make("word-count").reset(seed=0)[1]["env_id"] == "word-count"


def test_cli_lists_broken_plugins(tmp_path, on_path, capsys):
    site = tmp_path / "site"
    _fake_dist(site, "broken-missing", "ghost-env = odyssey_no_such_module:Env")
    on_path(site)
    registry.discover()
    assert registry.cli_main(["list"]) == 0
    table = capsys.readouterr().out
    assert "ghost-env" in table and "broken" in table and "No module named" in table
    assert registry.cli_main(["list", "--strict"]) == 1
    capsys.readouterr()
    assert registry.cli_main(["list", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["ghost-env"]["status"] == "broken" and rows["arith"]["status"] == "ok"


# ------------------------------------------------------------------------------------ registry API
class _Tiny(envs.ToolEnv):
    def generate_task(self, seed, options):
        return type("T", (), {"task_id": f"tiny/{seed}", "prompt": "hi"})()


def test_register_make_and_errors():
    entry = envs.register("tiny-test", _Tiny)
    try:
        assert entry.gym_id == "odyssey/TinyTest-v0" and entry.source == "user"
        assert envs.make("tiny-test").env_id == "tiny-test"
        assert envs.make("odyssey/TinyTest-v0").reset(seed=2)[1]["task_id"] == "tiny/2"
        assert gymnasium.make("odyssey/TinyTest-v0").unwrapped.env_id == "tiny-test"
        with pytest.raises(EnvRegistrationError, match="'tiny-test' is already registered by user"):
            envs.register("tiny-test", "envs.arith:ArithEnv")
        with pytest.raises(EnvRegistrationError, match="already used by 'tiny-test'"):
            envs.register("tiny_test", _Tiny)
        envs.register("tiny-test", "envs.arith:ArithEnv", overwrite=True)
        assert envs.make("tiny-test", use_sandbox=False).task is None
    finally:
        envs.unregister("tiny-test")
    assert "odyssey/TinyTest-v0" not in gymnasium.registry
    with pytest.raises(EnvNotFoundError, match="no env 'arth'. Did you mean 'arith'?"):
        envs.make("arth")
    with pytest.raises(EnvRegistrationError, match="must look like 'package.module:ClassName'"):
        envs.register("x-env", "not a path")
    with pytest.raises(EnvRegistrationError, match="must start with a letter or digit"):
        envs.register("-bad", _Tiny)
    envs.register("not-an-env", lambda **kw: object())
    try:
        with pytest.raises(TypeError, match="not a gymnasium.Env"):
            envs.make("not-an-env")
    finally:
        envs.unregister("not-an-env")


@pytest.mark.docker
def test_installed_plugin_with_sandbox(plugin_site, on_path, docker_sandbox):  # noqa: F811
    from sandbox.pool import SandboxPool

    on_path(plugin_site)
    registry.discover()
    pool = SandboxPool(size=1, image=docker_sandbox)
    pool.start_sync()
    try:
        env = envs.make("word-count", use_sandbox=True, sandbox_pool=pool)
        env.reset(seed=0)
        steps = [env.step(a) for a in env.oracle_actions()]
        assert steps[0][0][0]["content"] == str(env.task.count)  # `wc -w` ran in the sandbox
        assert steps[-1][4]["success"] == 1.0
        env.close()
    finally:
        pool.close_sync()
