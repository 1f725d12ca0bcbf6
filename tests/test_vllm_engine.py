"""VllmEngine (vLLM + the Odyssey plugin) against the trainer's model and TorchEngine: tiny preset, fp32.

Oracles (tests/vllm_helpers.py): the trainer's full forward on exactly the tokens the engine fed and
sampled gives the log-probs of the sampled distribution and the routed experts of every token;
TorchEngine gives greedy continuations. One vLLM engine for the module (prefix caching on, the default).

- parity: log-probs max |diff| <= 1e-4 (T=1, and T=0.7 / top-p 0.9 / top-k 50), routed-expert sets equal on
  >= 99.9% of (token, layer), greedy continuations of 64 tokens identical to TorchEngine, for prompts
  shorter and longer than one cache block (the KDA state crosses vLLM's block boundary);
- sessions: a continuation (prefix-cache hit on its own earlier turns) == a fresh prefill of the whole
  conversation; different sessions never share cache blocks (salted);
- stops and budgets like TorchEngine, the flushed last token has its routing;
- concurrency: agenerate from many tasks == generate;
- weight sync: update_weights -> parity with the new weights; wrong keys refused with nothing loaded;
- bad input: prompt over max_model_len, unknown architecture, failed engine start naming the fix.
- multi-process engine (the core in its own process): parity, then update_weights, over vLLM's RPC.
"""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from rl.rollout.engine import GenerationRequest, InferenceEngine, TorchEngine
from rl.rollout.sampling import SamplingParams
from tests.vllm_helpers import (
    engine_routing,
    prompt,
    require_vllm,
    routing_agreement,
    save_policy,
    trainer_view,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_TOL = 1e-4  # fp32, trainer vs vLLM rollout (issue 14)
ROUTING_MIN = 0.999  # fraction of (token, layer) with equal expert sets
MAX_LEN = 1024
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, OdysseyForCausalLM]:
    path = tmp_path_factory.mktemp("vllm_tiny")
    return path, save_policy("tiny", path, seed=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    require_vllm()
    from model.tokenizer import load_tokenizer
    from rl.rollout.vllm_engine import VllmEngine

    tok = load_tokenizer()
    eng = VllmEngine(str(ckpt[0]), detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False),
                     max_model_len=MAX_LEN, max_num_seqs=8)
    yield eng
    eng.shutdown()


def _reload(engine, model: OdysseyForCausalLM) -> None:
    engine.update_weights(model.state_dict(), version=engine.weight_version + 1)


# ----------------------------------------------------------------------------- plugin wiring
def test_entry_point_registers_the_plugin(engine):
    """pyproject's vllm.general_plugins entry point names model.vllm_plugin:register, which registers the
    architecture with vLLM and odyssey_moe with AutoConfig."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    target = eps["vllm.general_plugins"]["odyssey"]
    assert target == "model.vllm_plugin:register"
    assert "OdysseyForCausalLM" in ModelRegistry.get_supported_archs()
    assert AutoConfig.for_model("odyssey_moe").__class__ is OdysseyConfig
    assert isinstance(engine, InferenceEngine)
    assert engine.prefix_caching and engine.block_size >= 32


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 50)])
def test_logprob_and_routing_parity(engine, ckpt, temperature, top_p, top_k):
    """Sampled continuations: the engine's log-probs and routed experts == the trainer's on the same tokens.
    Prompts of 7, 60 and 200 tokens (the last spans several cache blocks) decoded in one batch."""
    model = ckpt[1]
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=40)
    prompts = [prompt(i, n) for i, n in enumerate((7, 60, 200))]
    results = engine.generate([GenerationRequest(p, sp) for p in prompts])
    worst, agree = 0.0, []
    for p, res in zip(prompts, results):
        assert len(res.token_ids) == 40 and res.finish_reason == "length"
        lp, routed = trainer_view(model, p + res.token_ids, len(p), temperature, top_p, top_k)
        worst = max(worst, (lp - torch.tensor(res.logprobs)).abs().max().item())
        agree.append(routing_agreement(engine_routing(res), routed))
    print(f"\nT={temperature} top_p={top_p} top_k={top_k}: logprob max|diff| {worst:.2e}, "
          f"routing agreement {min(agree):.5f}")
    assert worst <= LOGPROB_TOL
    assert min(agree) >= ROUTING_MIN


def test_greedy_64_tokens_identical_to_torch_engine(engine, ckpt):
    model = ckpt[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=64)
    reqs = [GenerationRequest(prompt(10 + i, n), sp) for i, n in enumerate((5, 90, 170))]
    ours = engine.generate(reqs)
    ref = TorchEngine(model).generate(reqs)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert a.logprobs == [0.0] * 64  # greedy: a point mass, TorchEngine's rule
        assert np.array_equal(engine_routing(a), engine_routing(b))


# ----------------------------------------------------------------------------- sessions
def test_session_continuation_equals_fresh_prefill(engine, ckpt):
    """Three greedy turns on one session (each continuation hits the prefix cache of the session's earlier
    turns) == one fresh request on the whole conversation, token for token and expert for expert; the
    routing collected over the turns == the trainer's on the whole conversation."""
    model = ckpt[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    turn_inputs = [prompt(20, 150), prompt(21, 40), prompt(22, 70)]
    session, conv, rows = None, [], []
    before = engine.stats["cached_tokens"]
    for new in turn_inputs:
        res = engine.generate([GenerationRequest(new, sp, session)])[0]
        fresh = engine.generate([GenerationRequest(conv + new, sp)])[0]
        assert res.token_ids == fresh.token_ids
        assert res.prompt_len == len(new)
        assert np.array_equal(res.routed_experts, fresh.routed_experts)
        assert np.array_equal(res.prompt_routed_experts, fresh.prompt_routed_experts[len(conv):])
        rows += [res.prompt_routed_experts, res.routed_experts]
        conv = conv + new + res.token_ids
        session = res.session
        assert session.num_tokens == len(conv) and session.cache.tokens == conv
    assert engine.stats["cached_tokens"] > before  # later turns reused the session's own blocks
    _, routed = trainer_view(model, conv, 1)
    assert routing_agreement(np.concatenate(rows).astype(np.int64), routed) >= ROUTING_MIN
    engine.release(session)
    assert session.cache is None


def test_sessions_never_share_prefix_blocks(engine):
    """Two new sessions with the same 300-token prompt: neither reads the other's cache blocks (salted by
    session), so the second computes its whole prompt (and records its routing)."""
    p = prompt(30, 300)
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    a = engine.generate([GenerationRequest(p, sp)])[0]
    before = engine.stats["cached_tokens"]
    b = engine.generate([GenerationRequest(p, sp)])[0]
    assert engine.stats["cached_tokens"] == before
    assert np.array_equal(a.prompt_routed_experts, b.prompt_routed_experts)


# ----------------------------------------------------------------------------- stops, budgets, async
def test_stops_and_budgets_like_torch_engine(engine, ckpt):
    """Stop token, stop string, budget and prefill-only requests: the same tokens and finish reasons as
    TorchEngine, and routing for every token (the stopping token is flushed, so it has its row too)."""
    model = ckpt[1]
    p = prompt(40, 12)
    free = GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=30))
    seq = TorchEngine(model).generate([free])[0].token_ids
    stop_string = engine.detokenize(seq[10:12])
    assert stop_string
    cases = [
        SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(seq[9],)),
        SamplingParams(temperature=0, max_new_tokens=30, stop_strings=(stop_string,)),
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=0, max_new_tokens=0),
    ]
    reqs = [GenerationRequest(p, sp) for sp in cases]
    ours = engine.generate(reqs)
    ref = TorchEngine(model, detokenize=engine.detokenize).generate(reqs)
    assert [r.finish_reason for r in ours] == ["stop_token", "stop_string", "length", "length"]
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert np.array_equal(engine_routing(a), engine_routing(b))
        assert a.token_ids == [] or a.routed_experts.shape[0] == len(a.token_ids)
    assert ours[3].token_ids == [] and ours[3].routed_experts is None
    assert ours[3].prompt_routed_experts.shape[0] == len(p) and ours[3].session.cache.tokens == p


def test_agenerate_batches_concurrent_requests(engine):
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    reqs = [GenerationRequest(prompt(50 + i, 8 + 5 * i), sp) for i in range(6)]
    blocking = engine.generate(reqs)
    engine.stats["max_batch"] = 0

    async def run():
        try:
            return await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        finally:
            await engine.aclose()

    concurrent = asyncio.run(run())
    assert [r.token_ids for r in concurrent] == [r.token_ids for r in blocking]
    assert all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(concurrent, blocking))
    assert engine.stats["max_batch"] >= 2  # the concurrent callers shared vLLM steps


# ----------------------------------------------------------------------------- weight sync
def test_update_weights_then_parity_again(engine, ckpt, tmp_path):
    """New weights (another seed, other biases) through update_weights: parity holds against the new
    trainer model; the version is reported; afterwards the original weights are restored the same way."""
    old = ckpt[1]
    new = save_policy("tiny", tmp_path / "new", seed=7, bias_std=0.5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)
    p = prompt(60, 140)
    before = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8))])[0]
    turn1 = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=20))])[0]
    try:
        _reload(engine, new)
        # a session from before the update: its cached blocks were computed with the old weights and must
        # not be reused; its continuation equals a fresh prefill of the whole conversation with the new ones
        more = prompt(61, 30)
        cont = engine.generate([GenerationRequest(more, SamplingParams(temperature=0, max_new_tokens=12),
                                                  turn1.session)])[0]
        conv = p + turn1.token_ids + more
        greedy12 = SamplingParams(temperature=0, max_new_tokens=12)
        fresh = engine.generate([GenerationRequest(conv, greedy12)])[0]
        assert cont.token_ids == fresh.token_ids
        assert np.array_equal(cont.prompt_routed_experts, fresh.prompt_routed_experts[-len(more):])
        _, routed_new = trainer_view(new, conv + cont.token_ids, len(conv))
        assert routing_agreement(engine_routing(cont), routed_new[-(len(more) + 12):]) >= ROUTING_MIN
        assert engine.weight_version >= 1
        res = engine.generate([GenerationRequest(p, sp)])[0]
        assert res.weight_version == engine.weight_version
        lp, routed = trainer_view(new, p + res.token_ids, len(p))
        err = (lp - torch.tensor(res.logprobs)).abs().max().item()
        agree = routing_agreement(engine_routing(res), routed)
        print(f"\nafter update_weights: logprob max|diff| {err:.2e}, routing agreement {agree:.5f}")
        assert err <= LOGPROB_TOL and agree >= ROUTING_MIN
        greedy = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8))])[0]
        assert greedy.token_ids == TorchEngine(new).generate(
            [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8))])[0].token_ids
    finally:
        _reload(engine, old)
    again = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8))])[0]
    assert again.token_ids == before.token_ids


def test_update_weights_refuses_wrong_keys(engine, ckpt):
    model = ckpt[1]
    sd = model.state_dict()
    p = prompt(70, 20)
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    before = engine.generate([GenerationRequest(p, sp)])[0].token_ids
    version = engine.weight_version
    missing = {k: v for k, v in sd.items() if "lm_head" not in k}
    with pytest.raises(ValueError, match=r"missing=\['lm_head.weight'\]"):
        engine.update_weights(missing, version + 1)
    extra = {**{k: torch.zeros_like(v) for k, v in sd.items()}, "model.bogus.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected=\['model.bogus.weight'\]"):
        engine.update_weights(extra, version + 1)
    assert engine.weight_version == version
    assert engine.generate([GenerationRequest(p, sp)])[0].token_ids == before  # nothing was loaded


# ----------------------------------------------------------------------------- bad input
def test_prompt_longer_than_the_model_limit(engine):
    with pytest.raises(ValueError, match=r"max_model_len=1024.*raise max_model_len"):
        engine.generate([GenerationRequest(prompt(80, MAX_LEN), SamplingParams(max_new_tokens=4))])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.generate([GenerationRequest([], SamplingParams())])
    # the engine still serves after the refusals
    assert engine.generate([GenerationRequest(prompt(81, 5), SamplingParams(max_new_tokens=2))])[0].token_ids


def test_images_are_refused_naming_torch_engine(engine):
    """VllmEngine has no multimodal input path yet: a request with images is refused with the engine to use
    (docs/vllm.md), and the engine keeps serving. The checkpoint (tiny, vision settings) loads its patch
    embedding like any other weight."""
    import numpy as np

    from model.image import prepare_image
    from model.tokenizer import encode_chat_images, load_tokenizer

    img = prepare_image(np.zeros((16, 16, 3), np.uint8), 8, 64 * 64)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}]}]
    enc = encode_chat_images(load_tokenizer(), msgs)
    with pytest.raises(ValueError, match=r"does not serve images.*rollout.engine=torch"):
        engine.generate([GenerationRequest(enc.ids, SamplingParams(max_new_tokens=2), images=enc.images)])
    assert engine.generate([GenerationRequest(prompt(82, 5), SamplingParams(max_new_tokens=2))])[0].token_ids
    from rl.rollout.worker import policy_vision

    assert policy_vision(engine) == (8, 64 * 64)  # a worker's codec prepares images, the engine refuses them


def test_unknown_architecture_is_named(tmp_path):
    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    # HF causal LMs are served (tests/test_hf_policy_vllm.py); an encoder is not
    bert = {"model_type": "bert", "architectures": ["BertModel"]}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    with pytest.raises(ValueError, match=r"BertModel.*serves OdysseyForCausalLM checkpoints and HF causal"):
        VllmEngine(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        VllmEngine(str(tmp_path / "nowhere"))


def test_failed_engine_start_names_the_fix(ckpt):
    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    expected = re.compile(r"vLLM failed to start.*Fix: lower max_model_len", re.S)
    with pytest.raises(RuntimeError, match=expected):
        VllmEngine(str(ckpt[0]), max_model_len=10**9)


# ----------------------------------------------------------------------------- multi-process engine
def test_multiprocess_engine_parity_and_weight_update(ckpt, monkeypatch, tmp_path):
    """The engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default and what tensor
    parallelism uses): routing, timing and weight reloads cross vLLM's msgpack RPC (worker methods called
    by name, no pickled functions); parity with the trainer holds, before and after update_weights."""
    require_vllm()
    import vllm.envs

    from rl.rollout.vllm_engine import VllmEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    vllm.envs.disable_envs_cache()  # an in-process engine of this module froze vLLM's reads of the env
    eng = VllmEngine(str(ckpt[0]), max_model_len=MAX_LEN, max_num_seqs=4)
    try:
        assert type(eng.core.engine_core).__name__ == "SyncMPClient"  # the core runs in another process
        sp = SamplingParams(temperature=1.0, max_new_tokens=24)
        prompts = [prompt(90, 9), prompt(91, 130)]
        for p, res in zip(prompts, eng.generate([GenerationRequest(p, sp) for p in prompts])):
            lp, routed = trainer_view(ckpt[1], p + res.token_ids, len(p))
            assert (lp - torch.tensor(res.logprobs)).abs().max().item() <= LOGPROB_TOL
            assert routing_agreement(engine_routing(res), routed) >= ROUTING_MIN
        assert eng.worker_timing()["forwards"] > 0
        new = save_policy("tiny", tmp_path / "new", seed=7, bias_std=0.5)
        eng.update_weights(new.state_dict(), version=1)
        greedy = SamplingParams(temperature=0, max_new_tokens=12)
        res = eng.generate([GenerationRequest(prompts[1], greedy)])[0]
        ref = TorchEngine(new).generate([GenerationRequest(prompts[1], greedy)])[0]
        assert res.token_ids == ref.token_ids and res.weight_version == 1
        assert np.array_equal(engine_routing(res), engine_routing(ref))
    finally:
        eng.shutdown()


def test_openai_client_agent_through_the_endpoint_on_vllm(engine, ckpt):
    """The unmodified OpenAI-client example agent drives VllmEngine through the policy endpoint
    (rl/rollout/endpoint.py): the stored episode's log-probs equal the trainer's forward of the stored
    tokens (<= 1e-4) and its routes agree on >= 99.9% of (token, layer), as for direct requests."""
    from envs.agent_env import AgentEnv
    from examples.openai_agent.agent import solve
    from model.tokenizer import load_tokenizer
    from rl.rollout.agent_episode import run_agent_episode
    from rl.rollout.agent_loop import ChatCodec, EpisodeConfig
    from rl.rollout.endpoint import PolicyEndpoint

    model = ckpt[1]
    codec = ChatCodec(load_tokenizer())

    def task(seed):
        return {"prompt": f"What is {seed} plus 2?", "answer": str(seed + 2)}

    async def run():
        endpoint = PolicyEndpoint()
        await endpoint.start()
        try:
            env = AgentEnv(agent=solve, tasks=task)
            cfg = EpisodeConfig(max_new_tokens=32, max_episode_tokens=MAX_LEN - 64)
            return await run_agent_episode(engine, env, codec, cfg, endpoint, seed=4)
        finally:
            await endpoint.stop()

    traj = asyncio.run(run())
    assert traj.infra_error is None and traj.outcome is not None and traj.metadata["requests"] >= 1
    ids = torch.as_tensor(traj.tokens, dtype=torch.long)
    with torch.no_grad():
        lp = model.token_logprobs(ids[:-1], ids[1:])
        routed = model(ids, return_routed_experts=True).routed_experts.numpy()
    mask = torch.as_tensor(traj.loss_mask[1:].astype(bool))
    got = torch.as_tensor(traj.rollout_logprobs[1:])[mask]
    assert (lp[mask] - got).abs().max().item() <= 1e-4
    assert routing_agreement(traj.routed_experts.astype(np.int64), routed) >= 0.999
