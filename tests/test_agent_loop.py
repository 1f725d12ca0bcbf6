"""The agent loop: token faithfulness, trainer/inference and R3 parity on real episodes, failure handling.

Logic tests drive the loop with `ScriptedEngine` (an InferenceEngine that emits given texts, e.g. the arith
oracle's tool calls) so that tool calls actually happen; the numerical tests use the real TorchEngine on
the tiny model. Envs are the real `arith` env, in-process (use_sandbox=False) for speed, and with real
Docker sandboxes in the tests marked `docker` (including a container killed mid-episode).
"""

from __future__ import annotations

import asyncio
import subprocess

import numpy as np
import pytest
import torch

import envs
from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from model.tokenizer import encode_chat, load_tokenizer
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from rl.rollout.engine import TorchEngine
from rl.rollout.tasks import Sample, Task, TaskStream
from rl.rollout.worker import RolloutWorker, WorkerSettings
from rl.trajectory import TrajectoryStore
from tests.scripted_engine import ScriptedEngine

PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer())


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def arith(**kw):
    kw.setdefault("use_sandbox", False)
    return envs.make("arith", difficulty=1, tools_in_prompt=False, **kw)


def _run(engine, env, codec, cfg=None, seed=3):
    return asyncio.run(run_episode(engine, env, codec, cfg or EpisodeConfig(max_new_tokens=64), seed=seed))


def _conversation_ids(codec, env_messages, tools, turns_and_obs):
    """Reference: render the whole conversation at once (what the trainer's template would give)."""
    msgs = list(env_messages)
    for text, obs in turns_and_obs:
        msgs.append({"role": "assistant", "content": text})
        msgs.extend(obs)
    return encode_chat(codec.tok, msgs, tools, add_generation_prompt=True)


# ----------------------------------------------------------------------------- logic (scripted policy)
def test_oracle_episode_is_token_faithful(codec):
    """The arith oracle solves the task; the trajectory equals rendering the full conversation at once,
    each span detokenises to the text produced / returned, and the engine only ever got new tokens."""
    env = arith()
    probe = arith()
    messages, _ = probe.reset(seed=3)
    oracle = probe.oracle_actions()
    obs_seen = []
    for a in oracle:
        obs_seen.append(probe.step(a)[0])
    eng = ScriptedEngine(codec, oracle)
    traj = _run(eng, env, codec)

    assert traj.outcome == 1.0 and traj.terminated and not traj.truncated and traj.infra_error is None
    assert [s["tool_results"] for s in traj.step_infos] == [[o[0]["content"]] for o in obs_seen]
    assert traj.n_assistant_turns == len(oracle) == len(traj.step_infos)
    # faithfulness: full-conversation render == trajectory (+ the final turn's forced end-of-turn)
    ref = _conversation_ids(codec, messages, env.tool_schemas(), list(zip(oracle[:-1], obs_seen[:-1])))
    last = codec.tok.encode(oracle[-1], add_special_tokens=False)
    assert traj.tokens.tolist() == ref + last
    # each span detokenises to its text
    asst = traj.assistant_spans()
    for span, text in zip(asst, oracle):
        gen = traj.tokens[span.start : span.end][traj.loss_mask[span.start : span.end] == 1].tolist()
        assert codec.decode(gen) == text
    obs_spans = [s for s in traj.turns if s.role == "observation"]
    for span, obs in zip(obs_spans, obs_seen):
        assert codec.decode(traj.tokens[span.start : span.end].tolist()) == codec.decode(
            codec.continuation(obs)
        )
        assert obs[0]["content"] in codec.decode(traj.tokens[span.start : span.end].tolist())
    # never re-tokenised: the engine received each non-generated token exactly once
    assert sum(len(p) for p in eng.prompts) == int((traj.loss_mask == 0).sum())
    assert eng.prompts[0] == encode_chat(codec.tok, messages, env.tool_schemas(), add_generation_prompt=True)
    # forced end-of-turn after a </tool_call> stop: in the assistant span, not trained on
    s0 = asst[0]
    assert traj.tokens[s0.end - 1] == codec.eot_id and traj.loss_mask[s0.end - 1] == 0
    assert np.isnan(traj.rollout_logprobs[traj.loss_mask == 0]).all()
    assert (traj.rollout_logprobs[traj.loss_mask == 1] == -0.5).all()
    assert eng.released == 1


def test_budgets_truncate(codec):
    eng = ScriptedEngine(codec, ["no tool here"] * 20)
    traj = _run(eng, arith(max_turns=3), codec)
    assert traj.truncated and not traj.terminated and traj.n_assistant_turns == 3
    assert traj.metadata["truncation"] == "env" and traj.outcome is None
    traj = _run(ScriptedEngine(codec, ["x"] * 20), arith(), codec, EpisodeConfig(max_turns=2))
    assert traj.truncated and traj.n_assistant_turns == 2 and traj.metadata["truncation"] == "max_turns"
    traj = _run(ScriptedEngine(codec, ["x"] * 20), arith(), codec, EpisodeConfig(max_episode_tokens=200))
    assert traj.truncated and traj.metadata["truncation"] == "token_budget" and traj.n_tokens <= 200


class CrashingEnv:
    """Wraps an env; astep raises on the given call (an env bug or a dead dependency mid-episode)."""

    def __init__(self, env, crash_on: int):
        self.env, self.crash_on, self.calls = env, crash_on, 0
        self.env_id = env.env_id

    async def areset(self, **kw):
        if self.crash_on == 0:
            raise ConnectionError("reset failed")
        return await self.env.areset(**kw)

    def tool_schemas(self):
        return self.env.tool_schemas()

    async def astep(self, text):
        self.calls += 1
        if self.calls == self.crash_on:
            raise RuntimeError("env died")
        return await self.env.astep(text)

    async def aclose(self):
        await self.env.aclose()


def test_failures_give_marked_stored_trajectories(codec, tmp_path):
    """env.step crash, env.reset crash and engine crash mid-episode: each yields one stored trajectory
    with infra_error set, the completed turns kept, and is never scored."""
    store = tmp_path / "store"
    settings = WorkerSettings(
        store_dir=str(store), rewards=[{"name": "outcome", "weight": 1.0}], concurrency=3, shared_pool=False
    )
    plans = {0: ("step", 2), 1: ("reset", 0), 2: ("engine", 1)}

    oracle = ['<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>'] * 4
    engines = {
        i: ScriptedEngine(codec, oracle, fail_on_turn=1 if plans[i][0] == "engine" else None) for i in plans
    }
    counter = iter(range(3))

    class Router:  # one engine per episode index, so each plan is deterministic
        weight_version = 0
        stats: dict = {}

        async def agenerate(self, req):
            return await engines[int(req.request_id.split(":")[0]) % 3].agenerate(req)

        def release(self, s):
            pass

    def factory(pool):
        i = next(counter)
        return CrashingEnv(arith(), crash_on=plans[i][1] if plans[i][0] != "engine" else -1)

    worker = RolloutWorker(settings, engine=Router(), env_factory=factory, tokenizer=codec.tok)
    # sample seeds 0, 1, 2 -> request ids "0:turn", "1:turn", "2:turn"
    asyncio.run(worker.run([Sample(Task("train", i, seed=i), 0, seed=i) for i in range(3)]))
    got = {t.metadata["task_index"]: t for t in TrajectoryStore(store).read_all()}
    assert sorted(got) == [0, 1, 2]
    step, reset, engine = got[0], got[1], got[2]
    assert "env died" in step.infra_error and step.n_assistant_turns == 2 and step.n_tokens > 0
    assert step.step_infos[-1]["infra_error"] and "total" not in step.rewards
    assert "reset failed" in reset.infra_error and reset.n_tokens == 0
    assert "engine exploded" in engine.infra_error and engine.n_assistant_turns == 1
    assert engine.turns[-1].role == "assistant"  # the unsent observation was dropped, not recorded
    assert all(
        t.outcome is None and t.metadata["reward_status"] == "skipped_infra_error" for t in got.values()
    )
    assert [got[i].metadata["infra_source"] for i in (0, 1, 2)] == ["env", "env", "engine"]


def test_worker_engine_choice_follows_the_config():
    """rollout.engine reaches the worker (WorkerSettings.engine) and picks the engine class; an unknown name
    is refused naming the choices (the vLLM engine itself: tests/test_vllm_rollout.py)."""
    from rl.config import load_config
    from rl.rollout.engine import TorchEngine
    from rl.rollout.engines import build_engine

    vllm_cfg = load_config("configs/tiny.yaml", ["rollout.engine=vllm"])
    assert WorkerSettings.from_config(vllm_cfg).engine == "vllm"
    settings = WorkerSettings.from_config(load_config("configs/tiny.yaml", []))
    engine, tmp = build_engine(settings, detokenize=str)
    assert settings.engine == "torch" and isinstance(engine, TorchEngine) and tmp is None
    settings.engine = "jax"
    with pytest.raises(ValueError, match="unknown rollout engine 'jax': choose from torch, vllm"):
        build_engine(settings, detokenize=str)


# ----------------------------------------------------------------------------- real engine
def test_real_engine_episode_parity_and_faithfulness(codec, model):
    """TorchEngine on the tiny model, 3 turns of arith: rollout logprobs == token_logprobs (T=1) on the
    trajectory's tokens, recorded routing == a full forward's, and text spans round-trip."""
    eng = TorchEngine(model, detokenize=codec.decode)
    cfg = EpisodeConfig(max_new_tokens=12, max_turns=3, max_episode_tokens=4096)
    sent = []
    env = arith()
    orig = env.astep

    async def astep(text):
        sent.append(text)
        return await orig(text)

    env.astep = astep
    traj = _run(eng, env, codec, cfg, seed=11)
    assert traj.n_assistant_turns == 3 and traj.infra_error is None
    ids = torch.tensor(traj.tokens.astype(np.int64))
    with torch.no_grad():
        lp = model.token_logprobs(ids[:-1], ids[1:])
        routed = model(ids, return_routed_experts=True).routed_experts
    gen = np.flatnonzero(traj.loss_mask)
    err = (lp[gen - 1] - torch.from_numpy(traj.rollout_logprobs[gen])).abs().max().item()
    assert err < PARITY_TOL, err
    assert np.array_equal(traj.routed_experts.astype(np.int64), routed.numpy())
    for span, text in zip(traj.assistant_spans(), sent):
        toks = traj.tokens[span.start : span.end][traj.loss_mask[span.start : span.end] == 1].tolist()
        if toks and toks[-1] in codec.stop_ids:
            toks = toks[:-1]
        assert codec.decode(toks) == text


# ----------------------------------------------------------------------------- real sandboxes
@pytest.fixture(scope="module")
def sandbox_pool(docker_sandbox):
    """A module pool on the shared `docker_sandbox` fixture (skips with the fix, or fails in CI)."""
    from sandbox.pool import SandboxPool

    pool = SandboxPool(size=2, image=docker_sandbox)
    pool.start_sync()
    yield pool
    pool.close_sync()


@pytest.mark.docker
def test_arith_in_real_sandbox_and_container_killed_mid_episode(codec, sandbox_pool, tmp_path):
    """Oracle episode with calc running in Docker succeeds; killing the container after turn 1 yields a
    stored trajectory marked with the sandbox error (never a zero-scored failure, never lost)."""
    store = tmp_path / "store"
    settings = WorkerSettings(
        store_dir=str(store), rewards=[{"name": "outcome", "weight": 1.0}], concurrency=1
    )
    made = []

    def factory(pool):
        env = envs.make("arith", difficulty=1, tools_in_prompt=False, sandbox_pool=pool)
        made.append(env)
        return env

    oracle = lambda: made[-1].oracle_actions()  # noqa: E731
    killer = {"armed": False}

    class KillAfterFirst(ScriptedEngine):
        async def agenerate(self, req):
            if killer["armed"] and len(self.prompts) == 1:
                subprocess.run(["docker", "kill", made[-1].sandbox.id], check=True, capture_output=True)
            return await super().agenerate(req)

    ok_engine = ScriptedEngine(codec, oracle)
    worker = RolloutWorker(
        settings, engine=ok_engine, env_factory=factory, sandbox_pool=sandbox_pool, tokenizer=codec.tok
    )
    stream = TaskStream(base_seed=0)
    asyncio.run(worker.run(stream.samples(stream.task(0), 1)))
    killer["armed"] = True
    worker.engine = KillAfterFirst(codec, oracle)
    asyncio.run(worker.run(stream.samples(stream.task(1), 1)))
    got = {t.metadata["task_index"]: t for t in TrajectoryStore(store).read_all()}
    good, killed = got[0], got[1]
    assert good.outcome == 1.0 and good.rewards["total"] == 1.0 and good.infra_error is None
    assert good.step_infos[0]["tool_results"][0].strip().lstrip("-").isdigit()
    assert killed.infra_error and "Sandbox" in killed.infra_error, killed.infra_error
    assert killed.n_assistant_turns == 2 and killed.outcome is None and "total" not in killed.rewards
    assert killed.metadata["infra_source"] == "sandbox" and "infra_source" not in good.metadata
