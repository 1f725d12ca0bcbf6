"""Every config key does what it says: for each key of the covered sections, a probe changes it away from the
base config and observes something the run builds from the config (the policy, the env a worker makes, the
tasks, the scores, real episodes of a RolloutWorker, the sandbox pool it would start, the training loop's own
objects); the observation must change. A key without a probe fails `test_every_key_has_a_probe`, so a knob
that nothing reads cannot be added silently.

To cover another section, add it to SECTIONS and a probe per key to PROBES. Keys that act only inside a
running training loop on Ray are in RUN_ONLY with the test that shows their effect.
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
SECTIONS = ("model", "env", "rewards", "rollout", "logging", "learner", "orchestrator", "stages")
# playing real episodes: multi-turn dataset-qa (wrong answers get another try), short turns
PLAY = (
    "env.kwargs={verifier: exact-match, multi_turn: true}",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=12",
    "rollout.concurrent_episodes=4",
)


@dataclass(frozen=True)
class Probe:
    """override: "key=value" (YAML value); observe(cfg): what the run builds from it; base: overrides both
    configs start from; start: "quickstart" (configs/quickstart.yaml) or "learner" (the small policy of
    tests/learner_fixtures.py, which its scored batches fit)."""

    override: str
    observe: Callable[[RunConfig], Any]
    base: tuple[str, ...] = ()
    start: str = "quickstart"


# ---- observers: the run's own builders ----------------------------------------------------------------


def settings(cfg: RunConfig):
    from rl.rollout.worker import WorkerSettings

    return WorkerSettings.from_config(cfg)


def policy(cfg: RunConfig) -> dict[str, Any]:
    """The rollout worker's policy (on the meta device for presets larger than tiny)."""
    from rl.policy import build_policy

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


def infra_verdict(cfg: RunConfig) -> Any:
    """The training loop's infra guard on a batch where the env failed on 3 of 5 episodes."""
    from rl.rollout.health import BatchUnhealthy
    from rl.train.loop import Trainer
    from tests.traj_factory import make_traj

    batch = []
    for i in range(5):
        t = make_traj([("prompt", 4), ("assistant", 4)], seed=i)
        t.metadata.update(env_id="arith", infra_source="env")
        t.infra_error = "env.step: ValueError" if i < 3 else None
        batch.append((None, t))
    try:
        Trainer(cfg)._check_infra(batch)
    except BatchUnhealthy:
        return "stopped"
    return "trained"


def ray_demand(cfg: RunConfig) -> Any:
    from rl.placement import cluster_demand

    return cluster_demand(cfg)


def metric_sinks(cfg: RunConfig) -> Any:
    """The sinks the training loop opens for its metrics records (or the error that stops it)."""
    from rl.train.loop import Trainer

    sinks = Trainer(cfg).sinks
    try:
        sinks.open(first_step=1)
    except RuntimeError as e:
        return str(e)
    kinds = [type(s).__name__ for s in sinks.extra]
    sinks.close()
    return kinds


def sampled_rollouts(cfg: RunConfig) -> list[str]:
    """The samples the training loop logs as text for a batch of two groups of three."""
    from rl.train.loop import Trainer
    from rl.train.metrics import sample_rows
    from tests.test_train_unit import _group

    batch = _group(0, [0.0, 1.0, 0.5]) + _group(1, [0.2, 0.3, 0.4])
    trainer = Trainer(cfg)
    return [r["sample"] for r in sample_rows(batch, trainer.cfg.logging.sample_rollouts)]


STAGED = (
    "orchestrator.eval_every=5",
    "stages=[{name: short, set: {rollout.max_tokens: 256}, until_steps: 3, until_eval_success: 0.5},"
    " {name: long, set: {rollout.max_tokens: 512}}]",
)


def stage_plan(cfg: RunConfig) -> dict[str, Any]:
    """What the training loop runs in stage 0 and when it leaves it (steps done, held-out success)."""
    from rl.train.loop import Trainer

    t = Trainer(cfg)
    gate = {(n, s): t.stages.should_advance(0, n, s) for n in (1, 2, 3, 4) for s in (None, 0.4, 0.7)}
    return {"name": t.stages.name(0), "max_tokens": t.cfg.rollout.max_tokens, "gate": gate}


def progress_lines(cfg: RunConfig) -> int:
    """Lines the training loop's progress display prints over 4 steps (as Trainer.run builds it)."""
    from rich.console import Console

    from rl.train.metrics import ProgressLine

    out = io.StringIO()
    with ProgressLine(4, Console(file=out), cfg.logging.log_every) as line:
        for step in range(1, 5):
            line.update({"step": step})
    return out.getvalue().count("odyssey train: step")


def _batch(kind: str) -> list:
    """Scored trajectories for the small policy. "ragged": groups of single-turn episodes (rewards 0/1/2);
    "turns": two-turn episodes with per-turn rewards, a quarter of them truncated; "shared": ragged, each
    group's members with one 24-token prompt (ids within the shipped tokenizer, for an HF checkpoint); "tied":
    ragged with its second group's rewards all equal."""
    import numpy as np

    from model.tokenizer import load_tokenizer
    from tests.learner_fixtures import ragged_batch, scored_traj

    if kind == "ragged":
        return ragged_batch(seed=0)
    if kind == "tied":  # ragged with its second group all-equal (grpo drops it)
        out = ragged_batch(seed=0)
        for t in out[4:]:
            t.rewards = {"total": 1.0}
        return out
    rng = np.random.default_rng(1)
    if kind == "shared":
        vocab = len(load_tokenizer())
        out = ragged_batch(seed=0, routed=False, lengths=[40 + 3 * i for i in range(8)])
        for g in range(2):
            prompt = rng.integers(16, vocab, 24).astype(np.int32)
            for t in out[4 * g:4 * g + 4]:
                t.tokens[:24] = prompt
                t.tokens %= vocab
        return out
    out = []
    for g in range(2):
        for i in range(4):
            layout = [("prompt", 6), ("assistant", 5 + i), ("observation", 3), ("assistant", 4 + g)]
            t = scored_traj(rng, layout, float(i % 3), f"g{g}", truncated=(i == 3))
            t.turn_rewards = [0.25 * (i % 2), 0.0]
            out.append(t)
    return out


def _learner_run(cfg: RunConfig, batch: str) -> dict[str, Any]:
    """Two `Learner.step`s (rl/learner/learner.py) on a fixed batch: every metric but timings, the learning
    rate of each step, a checksum of the weights after them, and whether layers recompute activations."""
    from rl.learner import Learner

    torch.manual_seed(0)
    learner = Learner(cfg)
    trajs = _batch(batch)
    steps = [learner.step(trajs) for _ in range(2)]
    timing = ("learner/step_s", "learner/tokens_per_s")
    return {
        "metrics": [{k: round(float(v), 6) for k, v in m.items() if k not in timing} for m in steps],
        "weights": round(float(sum(p.detach().double().sum() for p in learner.module.parameters())), 6),
        "checkpointing": bool(getattr(learner.policy, "is_gradient_checkpointing", False)),
    }


@functools.cache
def _learner_cached(cfg_json: str, batch: str) -> dict[str, Any]:
    return _learner_run(RunConfig.model_validate_json(cfg_json), batch)


def learner_steps(batch: str = "ragged") -> Callable[[RunConfig], Any]:
    def observe(cfg: RunConfig) -> Any:
        return _learner_cached(cfg.model_dump_json(), batch)

    return observe


def dynamic_sampling(cfg: RunConfig) -> dict[str, Any]:
    """Feed the training loop (Trainer._on_finished) 3 complete groups whose members all scored the same:
    how many it keeps for the learner and how many it discards."""
    from rl.rollout.dispatch import Finished
    from rl.train.loop import Trainer
    from tests.traj_factory import make_traj

    trainer = Trainer(cfg)
    for i in range(3):
        task = trainer.stream.task(i)
        for s in trainer.stream.samples(task, trainer.group_size):
            t = make_traj([("prompt", 3), ("assistant", 2)], outcome=0.0, metadata=s.metadata())
            t.rewards = {"total": 0.0}
            trainer._on_finished(Finished(s, t, 0, final=True))
    return {"kept": len(trainer.buffer), "discarded": trainer.step_counts.get("discarded/zero_variance", 0)}


def held_out(cfg: RunConfig) -> list:
    """The held-out samples the training loop evaluates on (Trainer._evaluate's eval_samples call)."""
    from rl.train.eval import eval_samples

    o = cfg.orchestrator
    return [s.key for s in eval_samples(cfg, o.eval_episodes, o.eval_pass_k, o.eval_difficulties)]


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
def hf_checkpoint(tmp_path_factory) -> str:
    """A saved small random HF Llama (model.hf_path)."""
    from tests.test_hf_policy import make_llama

    return make_llama(tmp_path_factory.mktemp("hf"))


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
    "model.hf_path": Probe("model.hf_path=<hf_checkpoint>", policy),
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
    "rollout.max_infra_fraction": Probe("rollout.max_infra_fraction=0.9", infra_verdict),
    "rollout.sandbox_image": Probe(
        "rollout.sandbox_image=my-image:1", sandbox_pool, (*ARITH, "rollout.sandbox_pool_size=2")
    ),
    # logging
    "logging.run_dir": Probe("logging.run_dir=<tmp>/elsewhere", trainer("run_dir")),
    "logging.log_every": Probe("logging.log_every=2", progress_lines),
    "logging.tensorboard": Probe("logging.tensorboard=false", metric_sinks),
    "logging.wandb_project": Probe("logging.wandb_project=odyssey-probe", metric_sinks),
    "logging.sample_rollouts": Probe("logging.sample_rollouts=4", sampled_rollouts),
    # stages
    "stages.N.name": Probe("stages.0.name=warm", stage_plan, STAGED),
    "stages.N.set": Probe("stages.0.set={rollout.max_tokens: 384}", stage_plan, STAGED),
    "stages.N.until_steps": Probe("stages.0.until_steps=2", stage_plan, STAGED),
    "stages.N.until_eval_success": Probe("stages.0.until_eval_success=0.8", stage_plan, STAGED),
}

GAE = ("learner.advantage=gae",)
EPOCHS = ("learner.ppo_epochs=2",)  # PPO clipping acts from the second update of a batch (ratio 1 before)
CRITIC = (*GAE, "learner.value_model=critic")
L, T = "learner", learner_steps("turns")
LORA = ("model.hf_path=<hf_checkpoint>",
        "learner.lora={rank: 2, alpha: 4.0, target_modules: [q_proj, v_proj], dropout: 0.0}")
PROBES |= {
    # learner: two real Learner steps on a fixed batch (the small policy of tests/learner_fixtures.py)
    "learner.advantage": Probe("learner.advantage=rloo", learner_steps(), start=L),
    "learner.policy_loss": Probe("learner.policy_loss=cispo", learner_steps(), start=L),
    "learner.steps": Probe("learner.steps=2", learner_steps(), ("learner.lr_schedule=cosine",), L),
    "learner.lr": Probe("learner.lr=1e-3", learner_steps(), start=L),
    "learner.lr_schedule": Probe("learner.lr_schedule=linear", learner_steps(), ("learner.steps=3",), L),
    "learner.warmup_steps": Probe("learner.warmup_steps=2", learner_steps(), start=L),
    "learner.weight_decay": Probe("learner.weight_decay=0.5", learner_steps(), start=L),
    "learner.betas": Probe("learner.betas=[0.5, 0.6]", learner_steps(), start=L),
    "learner.grad_clip": Probe("learner.grad_clip=1e-6", learner_steps(), start=L),
    "learner.group_size": Probe("learner.group_size=2", trainer("group_size")),  # samples drawn per task
    "learner.scale_rewards": Probe("learner.scale_rewards=none", learner_steps(), start=L),
    "learner.negative_advantage_weight": Probe(
        "learner.negative_advantage_weight=0", learner_steps(), start=L
    ),
    "learner.turn_credit": Probe("learner.turn_credit=true", T, start=L),
    "learner.clip_eps_low": Probe("learner.clip_eps_low=0.01", learner_steps(), EPOCHS, L),
    "learner.clip_eps_high": Probe("learner.clip_eps_high=0.01", learner_steps(), EPOCHS, L),
    "learner.kl_coef": Probe("learner.kl_coef=0.5", learner_steps(), start=L),
    "learner.kl_estimator": Probe("learner.kl_estimator=k1", learner_steps(), ("learner.kl_coef=0.5",), L),
    "learner.entropy_coef": Probe("learner.entropy_coef=0.5", learner_steps(), start=L),
    "learner.loss_agg": Probe("learner.loss_agg=seq_mean_token_sum", learner_steps(), start=L),
    "learner.overlong_filter": Probe("learner.overlong_filter=true", T, start=L),
    "learner.equal_groups_in_normaliser": Probe(
        "learner.equal_groups_in_normaliser=true", learner_steps("tied"), start=L
    ),
    "learner.tis_cap": Probe("learner.tis_cap=null", learner_steps(), start=L),
    "learner.mis_band": Probe("learner.mis_band=[0.5, 2.0]", learner_steps(), start=L),
    "learner.mis_level": Probe(
        "learner.mis_level=sequence", learner_steps(), ("learner.mis_band=[0.5, 2.0]",), L
    ),
    "learner.routing_replay": Probe("learner.routing_replay=false", learner_steps(), start=L),
    "learner.ppo_epochs": Probe("learner.ppo_epochs=2", learner_steps(), start=L),
    "learner.num_minibatches": Probe("learner.num_minibatches=2", learner_steps(), start=L),
    "learner.gamma": Probe("learner.gamma=0.5", T, GAE, L),
    "learner.gae_lambda": Probe("learner.gae_lambda=0.5", T, GAE, L),
    "learner.value_model": Probe("learner.value_model=critic", learner_steps(), GAE, L),
    "learner.critic_preset": Probe("learner.critic_preset=tiny", learner_steps(), CRITIC, L),
    "learner.value_coef": Probe("learner.value_coef=2.0", learner_steps(), GAE, L),
    "learner.value_clip": Probe("learner.value_clip=1e-4", learner_steps(), (*GAE, *EPOCHS), L),
    "learner.micro_batch_tokens": Probe("learner.micro_batch_tokens=64", learner_steps(), start=L),
    # a group's common prompt computed once (HF policies): fewer tokens through the model, reported
    "learner.share_prefixes": Probe("learner.share_prefixes=false", learner_steps("shared"),
                                    base=("model.hf_path=<hf_checkpoint>",)),
    # LoRA on the HF policy: only the adapters train; rank, alpha, targets and dropout change the steps
    "learner.lora.rank": Probe("learner.lora.rank=4", learner_steps("shared"), LORA),
    "learner.lora.alpha": Probe("learner.lora.alpha=64", learner_steps("shared"), LORA),
    "learner.lora.target_modules": Probe("learner.lora.target_modules=[q_proj]", learner_steps("shared"),
                                         LORA),
    "learner.lora.dropout": Probe("learner.lora.dropout=0.5", learner_steps("shared"), LORA),
    "learner.activation_checkpointing": Probe(
        "learner.activation_checkpointing=true", learner_steps(), start=L
    ),
    # metrics count the windows; losses stay equal (tests/test_sequence_chunks.py)
    "learner.sequence_chunk_tokens": Probe("learner.sequence_chunk_tokens=16", learner_steps(), start=L),
    "learner.num_ranks": Probe("learner.num_ranks=2", ray_demand, start=L),
    "learner.seed": Probe("learner.seed=3", learner_steps(), start=L),
    # orchestrator: the training loop's own objects and decisions (no Ray)
    "orchestrator.rollout_resources": Probe("orchestrator.rollout_resources={CPU: 2}", ray_demand),
    "orchestrator.learner_resources": Probe("orchestrator.learner_resources={CPU: 3}", ray_demand),
    "orchestrator.max_staleness": Probe("orchestrator.max_staleness=0", trainer("k")),
    "orchestrator.dynamic_sampling": Probe("orchestrator.dynamic_sampling=true", dynamic_sampling),
    "orchestrator.dynamic_sampling_cap": Probe(
        "orchestrator.dynamic_sampling_cap=1.0", dynamic_sampling, ("orchestrator.dynamic_sampling=true",)
    ),
    "orchestrator.group_filter": Probe(
        "orchestrator.group_filter=tests.test_train_admission:keep_all", dynamic_sampling,
        ("orchestrator.dynamic_sampling=true",),
    ),
    "orchestrator.buffer_order": Probe(
        "orchestrator.buffer_order=length", lambda c: trainer("buffer")(c).order
    ),
    "orchestrator.weight_sync_timeout_s": Probe(
        "orchestrator.weight_sync_timeout_s=5", lambda c: trainer("sync")(c).timeout_s
    ),
    "orchestrator.eval_episodes": Probe("orchestrator.eval_episodes=8", held_out),
    "orchestrator.eval_pass_k": Probe("orchestrator.eval_pass_k=2", held_out),
    "orchestrator.eval_difficulties": Probe("orchestrator.eval_difficulties=[0, 1]", held_out, ARITH),
}

#: keys whose effect shows only inside a running training loop on Ray: the test that shows it
RUN_ONLY: dict[str, str] = {
    "orchestrator.max_infra_retries": "tests/test_train_ray.py (infra re-runs)",
    "orchestrator.max_worker_restarts": "tests/test_train_ray.py (a rollout worker killed mid-step)",
    "orchestrator.checkpoint_every": "tests/test_train_ray.py (kill -9 of the driver, then resume)",
    "orchestrator.keep_checkpoints": "tests/test_train_unit.py (checkpoints are pruned)",
    "orchestrator.resume": "tests/test_train_ray.py (kill -9 of the driver, then resume)",
    "orchestrator.eval_every": "tests/test_train_ray.py (eval_every runs held-out eval)",
    "learner.context_parallel": "tests/test_learner_group.py (a context-parallel group equals one rank)",
    "learner.sharding": "tests/test_learner_fsdp.py (FSDP ranks equal one rank; each holds 1/N of the bytes)",
    "learner.fsdp_param_dtype": "tests/test_learner_fsdp.py (bfloat16 compute moves the step off fp32's)",
    "learner.fsdp_reduce_dtype": "tests/test_learner_fsdp.py (bfloat16 compute moves the step off fp32's)",
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
    missing = [k for k in keys if k not in PROBES and k not in RUN_ONLY]
    assert not missing, f"config keys without a probe of their effect (tests/test_config_keys.py): {missing}"
    assert not [k for k in [*PROBES, *RUN_ONLY] if k not in keys], "probes of keys that do not exist"


def test_learner_observation_is_deterministic(tmp_path):
    """A probe can only fail if the same config observes the same: two fresh learner runs agree exactly."""
    cfg = _load([], {"tmp": str(tmp_path)}, "learner")
    assert _learner_run(cfg, "ragged") == _learner_run(cfg, "ragged")


def _load(overrides: list[str], fill: dict[str, str], start: str = "quickstart") -> RunConfig:
    """The start config with the run dir in the test's tmp dir, then `overrides`."""
    from rl.config import apply_override, validate_config
    from tests.learner_fixtures import small_config

    def filled(o: str) -> str:
        for name, value in fill.items():
            o = o.replace(f"<{name}>", value)
        return o

    overrides = [f"logging.run_dir={fill['tmp']}/run", *map(filled, overrides)]
    if start == "quickstart":
        return load_config(QUICKSTART, overrides)
    data = small_config().model_dump(mode="json")
    for o in overrides:
        apply_override(data, o)
    return validate_config(data)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PROBES))
def test_key_has_an_effect(key, checkpoint, hf_checkpoint, two_column_data, tmp_path):
    probe = PROBES[key]
    fill = {"checkpoint": checkpoint, "hf_checkpoint": hf_checkpoint, "two_column_data": two_column_data,
            "tmp": str(tmp_path)}
    base = _load(list(probe.base), fill, probe.start)
    changed = _load([*probe.base, probe.override], fill, probe.start)
    name = probe.override.split("=", 1)[0]
    assert changed.model_dump() != base.model_dump(), f"{probe.override} did not change the config"
    before, after = probe.observe(base), probe.observe(changed)
    assert before != after, (
        f"{name}: changing it ({probe.override}) changed nothing the run builds: {before!r}"
    )


def test_overrides_apply_on_top_of_a_checkpoint_and_a_wrong_preset_is_named(checkpoint, tmp_path):
    """With model.init_from, model.overrides still reach the policy (here balancing=none), and a
    model.preset that does not describe the checkpoint is an error naming the fields, not ignored."""
    fill = {"checkpoint": checkpoint, "tmp": str(tmp_path)}
    cfg = _load(["model.init_from=<checkpoint>", "model.overrides={balancing: none}"], fill, "quickstart")
    from rl.policy import build_policy

    m = build_policy(settings(cfg))
    assert m.config.balancing == "none" and {moe.balancing for moe in m.moe_layers()} == {"none"}
    with pytest.raises(ValueError, match=r"model.preset: 'small' does not describe the checkpoint .*"
                                         r"hidden_size=128 .*set model.preset=tiny"):
        _load(["model.init_from=<checkpoint>", "model.preset=small"], fill, "quickstart")
