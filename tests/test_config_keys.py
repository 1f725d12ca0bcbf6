"""Every config key does what it says: for each key of the covered sections, a probe changes it away from the
base config and observes something the run builds from the config (the policy, the env a worker makes, the
tasks, the scores, real episodes of a RolloutWorker, the sandbox pool it would start, the training loop's own
objects); the observation must change. A key without a probe fails `test_every_key_has_a_probe`, so a knob
that nothing reads cannot be added silently.

To cover another section, add it to SECTIONS and a probe per key to PROBES.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rl.config import RunConfig, _leaf_paths, _submodel, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SECTIONS = ("model", "env", "rewards", "rollout", "logging")
# playing real episodes: multi-turn dataset-qa (wrong answers get another try), short turns
PLAY = (
    "env.kwargs={verifier: exact-match, multi_turn: true}",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=12",
    "rollout.concurrent_episodes=4",
)


@dataclass(frozen=True)
class Probe:
    """override: "key=value" (YAML value); observe(cfg): what the run builds from it; base: overrides of
    configs/quickstart.yaml both configs start from."""

    override: str
    observe: Callable[[RunConfig], Any]
    base: tuple[str, ...] = ()


# ---- observers: the run's own builders ----------------------------------------------------------------


def settings(cfg: RunConfig):
    from rl.rollout.worker import WorkerSettings

    return WorkerSettings.from_config(cfg)


def policy(cfg: RunConfig) -> dict[str, Any]:
    """The rollout worker's policy (on the meta device for presets larger than tiny)."""
    from rl.rollout.worker import build_policy

    s = settings(cfg)
    with torch.device("meta" if s.model_preset != "tiny" and not s.checkpoint else "cpu"):
        m = build_policy(s)
    p = next(m.parameters())
    return {
        "hidden": m.config.hidden_size,
        "layers": m.config.num_hidden_layers,
        "dtype": str(p.dtype),
        "weights": None if p.is_meta else float(p.float().sum()),
    }


class _NoEngine:
    weight_version = 0


def worker_env(cfg: RunConfig) -> dict[str, Any]:
    """The env a rollout worker makes for an episode, reset on the first training task."""
    from rl.rollout.tasks import task_stream
    from rl.rollout.worker import RolloutWorker

    env = RolloutWorker(settings(cfg), engine=_NoEngine()).make_env()
    task = task_stream(cfg, "train").task(0)
    messages, info = env.reset(seed=task.seed, options=task.reset_options())
    out = {
        "class": type(env).__name__,
        "max_turns": env.max_turns,
        "messages": messages,
        "task": info["task_id"],
    }
    out["verifier"] = type(getattr(env, "verifier", None)).__name__
    env.close()
    return out


def tasks(cfg: RunConfig) -> dict[str, Any]:
    from rl.rollout.tasks import task_stream

    train, held = task_stream(cfg, "train"), task_stream(cfg, "eval")
    return {
        "train": [(t.row.index, t.row.prompt, t.row.answer, t.seed) for t in map(train.task, range(6))],
        "eval": sorted({held.task(i).row.index for i in range(20)}),
    }


def scores(cfg: RunConfig) -> dict[str, Any]:
    """One finished episode scored with the worker's reward specs."""
    from rewards import compose
    from tests.test_reward_forms import episode

    t = compose(episode("it is 5"), settings(cfg).rewards)
    return {"rewards": t.rewards, "error": t.reward_error}


@functools.cache
def _episodes(cfg_json: str) -> dict[str, Any]:
    from rl.rollout.tasks import task_stream
    from rl.rollout.worker import RolloutWorker

    cfg = RunConfig.model_validate_json(cfg_json)
    worker = RolloutWorker(settings(cfg), 0)
    try:
        samples = task_stream(cfg, "train").first_samples(4, cfg.learner.group_size)
        out = asyncio.run(worker.run(samples, return_trajectories=True))
    finally:
        asyncio.run(worker.close())
    trajs = out["trajectories"]
    return {
        "tokens": [t.tokens.tolist() for t in trajs],
        "turns": [t.n_assistant_turns for t in trajs],
        "longest_turn": max(len(s) for t in trajs for s in t.assistant_spans()),
        "truncation": [t.metadata.get("truncation") for t in trajs],
        "max_batch": worker.engine.stats["max_batch"],
    }


def episodes(key: str) -> Callable[[RunConfig], Any]:
    """Observe `key` of 4 real episodes (tiny TorchEngine policy, dataset-qa rows) played with the config."""

    def observe(cfg: RunConfig) -> Any:
        return _episodes(cfg.model_dump_json())[key]

    return observe


def sandbox_pool(cfg: RunConfig) -> Any:
    """(size, image) of the SandboxPool a worker starts for a sandbox env (recorded, not started)."""
    import sandbox.pool
    from rl.rollout.worker import RolloutWorker

    started = []

    class Recorder:
        def __init__(self, size: int, image: str) -> None:
            started.append((size, image))

        async def start(self) -> None:
            pass

    real = sandbox.pool.SandboxPool
    sandbox.pool.SandboxPool = Recorder
    try:
        asyncio.run(RolloutWorker(settings(cfg), engine=_NoEngine())._ensure_pool())
    finally:
        sandbox.pool.SandboxPool = real
    return started


def engine(cfg: RunConfig) -> Any:
    """Whether `odyssey rollout`/`train` start (engine_problem), and the engine the worker is told to build
    (WorkerSettings.engine, once the vLLM engine is in this checkout)."""
    from rl.rollout.cli import engine_problem

    return engine_problem(cfg.rollout.engine), getattr(settings(cfg), "engine", None)


def trainer(attr: str) -> Callable[[RunConfig], Any]:
    def observe(cfg: RunConfig) -> Any:
        from rl.train.loop import Trainer

        return getattr(Trainer(cfg), attr)

    return observe


def ray_demand(cfg: RunConfig) -> Any:
    from rl.train.placement import cluster_demand

    return cluster_demand(cfg)


def progress_lines(cfg: RunConfig) -> int:
    """Lines the training loop's progress display prints over 4 steps (as Trainer.run builds it)."""
    from rich.console import Console

    from rl.train.metrics import ProgressLine

    out = io.StringIO()
    with ProgressLine(4, Console(file=out), cfg.logging.log_every) as line:
        for step in range(1, 5):
            line.update({"step": step})
    return out.getvalue().count("odyssey train: step")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A saved tiny policy whose weights differ from the fresh init (seed 1 instead of learner.seed 0)."""
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("ckpt")
    OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def two_column_data(tmp_path_factory) -> str:
    rows = [
        {"prompt": f"p{i}", "question": f"q{i}", "answer": str(i), "solution": f"s{i}"} for i in range(30)
    ]
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


RG = ("env.id=reasoning-gym/chain_sum", "env.dataset=null", "env.kwargs={}", "rewards=[{name: outcome}]")
SLOW_ASYNC = "rewards=[{name: 'tests.custom_rewards:async_traj_len', params: {delay_s: 0.5}}]"
ARITH = ("env.id=arith", "env.dataset=null", "env.kwargs={}", "rewards=[{name: outcome}]")
PROBES: dict[str, Probe] = {
    # model
    "model.preset": Probe("model.preset=small", policy),
    "model.overrides": Probe("model.overrides={num_hidden_layers: 4}", policy),
    "model.dtype": Probe("model.dtype=bfloat16", policy),
    "model.init_from": Probe("model.init_from=<checkpoint>", policy),
    # env
    "env.id": Probe("env.id=reasoning-gym/basic_arithmetic", worker_env, RG),
    "env.kwargs": Probe("env.kwargs={verifier: exact-match}", worker_env),
    "env.dataset.path": Probe("env.dataset.path=<two_column_data>", tasks),
    "env.dataset.eval_size": Probe(
        "env.dataset.eval_size=0.3", tasks, ("env.dataset.path=<two_column_data>",)
    ),
    "env.dataset.seed": Probe("env.dataset.seed=7", tasks),
    "env.dataset.prompt_field": Probe(
        "env.dataset.prompt_field=question", tasks, ("env.dataset.path=<two_column_data>",)
    ),
    "env.dataset.answer_field": Probe(
        "env.dataset.answer_field=solution", tasks, ("env.dataset.path=<two_column_data>",)
    ),
    # rewards
    "rewards.N.name": Probe("rewards.0.name=env_reward", scores),
    "rewards.N.weight": Probe("rewards.1.weight=2.0", scores),
    "rewards.N.params": Probe("rewards.2.params={max_tokens: 0}", scores),
    "rewards.N.key": Probe("rewards.0.key=verifier", scores),
    "rewards.N.timeout_s": Probe("rewards.0.timeout_s=0.05", scores, (SLOW_ASYNC,)),
    # rollout
    "rollout.engine": Probe("rollout.engine=vllm", engine),
    "rollout.num_workers": Probe("rollout.num_workers=3", ray_demand),
    "rollout.concurrent_episodes": Probe("rollout.concurrent_episodes=1", episodes("max_batch"), PLAY),
    "rollout.episodes": Probe("rollout.episodes=32", trainer("groups_per_step")),
    "rollout.max_turns": Probe("rollout.max_turns=1", episodes("turns"), PLAY),
    "rollout.max_tokens": Probe("rollout.max_tokens=64", episodes("truncation"), PLAY),
    "rollout.max_new_tokens": Probe("rollout.max_new_tokens=4", episodes("longest_turn"), PLAY),
    "rollout.temperature": Probe("rollout.temperature=0.0", episodes("tokens"), PLAY),
    "rollout.top_p": Probe("rollout.top_p=0.05", episodes("tokens"), PLAY),
    "rollout.top_k": Probe("rollout.top_k=1", episodes("tokens"), PLAY),
    "rollout.seed": Probe("rollout.seed=5", episodes("tokens"), PLAY),
    "rollout.sandbox_pool_size": Probe("rollout.sandbox_pool_size=3", sandbox_pool, ARITH),
    "rollout.sandbox_image": Probe(
        "rollout.sandbox_image=my-image:1", sandbox_pool, (*ARITH, "rollout.sandbox_pool_size=2")
    ),
    # logging
    "logging.run_dir": Probe("logging.run_dir=<tmp>/elsewhere", trainer("run_dir")),
    "logging.log_every": Probe("logging.log_every=2", progress_lines),
}


def covered_keys() -> list[str]:
    """Leaf keys of SECTIONS (list items as N); a sub-section (env.dataset) is covered by its keys."""
    out = []
    for path in _leaf_paths(RunConfig):
        if not path.startswith(SECTIONS) or "." not in path:
            continue
        node = RunConfig
        for part in path.split("."):
            if part.isdigit():
                continue
            node = _submodel(node.model_fields[part].annotation) if node is not None else None
        if node is None:  # a value, not a section
            out.append(path.replace(".0.", ".N."))
    return out


def test_every_key_has_a_probe():
    keys = covered_keys()
    assert "env.dataset.seed" in keys and "rewards.N.timeout_s" in keys and "rollout.seed" in keys
    missing = [k for k in keys if k not in PROBES]
    assert not missing, f"config keys without a probe of their effect (tests/test_config_keys.py): {missing}"
    assert not [k for k in PROBES if k not in keys], "probes of keys that do not exist"


def _load(overrides: list[str], fill: dict[str, str]) -> RunConfig:
    """configs/quickstart.yaml with the run dir in the test's tmp dir, then `overrides`."""
    def filled(o: str) -> str:
        for name, value in fill.items():
            o = o.replace(f"<{name}>", value)
        return o

    return load_config(QUICKSTART, [f"logging.run_dir={fill['tmp']}/run", *map(filled, overrides)])


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PROBES))
def test_key_has_an_effect(key, checkpoint, two_column_data, tmp_path):
    probe = PROBES[key]
    fill = {"checkpoint": checkpoint, "two_column_data": two_column_data, "tmp": str(tmp_path)}
    base = _load(list(probe.base), fill)
    changed = _load([*probe.base, probe.override], fill)
    name = probe.override.split("=", 1)[0]
    assert changed.model_dump() != base.model_dump(), f"{probe.override} did not change the config"
    before, after = probe.observe(base), probe.observe(changed)
    assert before != after, (
        f"{name}: changing it ({probe.override}) changed nothing the run builds: {before!r}"
    )
