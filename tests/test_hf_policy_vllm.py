"""An HF causal LM (a small random Llama saved here) on VllmEngine, through vLLM's own Llama code.

Oracles (fp32): greedy tokens == TorchEngine's on the same HFPolicy; sampled log-probs (T = 1) == the
learner's token_logprobs (<= 1e-4); after `update_weights` with the learner's state_dict (HF checkpoint
names), both hold again against the new weights, and the log-probs differ from the old weights' (the
update really landed). A Qwen3-MoE checkpoint (vLLM's Qwen3MoeForCausalLM) matches the trainer as well,
also after `update_weights` / a 2-bucket `update_weights_stream` of the learner's state_dict, whose fused
expert tensors (experts.gate_up_proj / down_proj) the engine reverts to the checkpoint's per-expert names.
"""

from __future__ import annotations

import pytest
import torch

from model.hf_policy import HFPolicy
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams
from tests.test_hf_policy import _prompts, make_llama, make_qwen3_moe
from tests.vllm_helpers import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PARITY_TOL = 1e-4


@pytest.fixture
def start():
    """VllmEngine(path) on small limits; shut down after the test (one in-process engine at a time)."""
    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    engines = []

    def make(path: str) -> VllmEngine:
        engines.append(VllmEngine(path, max_model_len=256, max_num_seqs=8, seed=0))
        return engines[-1]

    yield make
    for e in engines:
        e.shutdown()


def _max_logprob_error(policy: HFPolicy, prompts, results) -> float:
    err = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, results):
            t = torch.tensor(p + r.token_ids)
            lp = policy.token_logprobs(t[:-1], t[1:])[len(p) - 1:]
            err = max(err, (lp - torch.tensor(r.logprobs)).abs().max().item())
    return err


def test_vllm_llama_matches_torch_engine_and_trainer_also_after_a_weight_update(tmp_path, start):
    path = make_llama(tmp_path / "llama")
    policy = HFPolicy.from_pretrained(path).eval()
    torch_engine = TorchEngine(HFPolicy.from_pretrained(path))
    engine = start(path)
    prompts = _prompts(4, seed=5)
    greedy = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in prompts]
    sampled = [GenerationRequest(p, SamplingParams(max_new_tokens=12)) for p in prompts]

    got = engine.generate(greedy)
    assert [r.token_ids for r in got] == [r.token_ids for r in torch_engine.generate(greedy)]
    assert all(r.routed_experts is None and r.prompt_routed_experts is None for r in got)
    res = engine.generate(sampled)
    assert _max_logprob_error(policy, prompts, res) <= PARITY_TOL

    with torch.no_grad():  # new weights, by the learner's (HF checkpoint) names
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    engine.update_weights(sd, version=1)
    torch_engine.update_weights(sd, version=1)
    got = engine.generate(greedy)
    assert [r.token_ids for r in got] == [r.token_ids for r in torch_engine.generate(greedy)]
    res = engine.generate(sampled)
    assert all(r.weight_version == 1 for r in res)
    assert _max_logprob_error(policy, prompts, res) <= PARITY_TOL
    old = HFPolicy.from_pretrained(path).eval()
    assert _max_logprob_error(old, prompts, res) > 1e-2  # the update landed in vLLM

    with pytest.raises(ValueError, match="missing=.*lm_head.weight"):
        engine.update_weights({k: v for k, v in sd.items() if k != "lm_head.weight"}, version=2)


def test_vllm_qwen3_moe_logprobs_match_the_trainer(tmp_path, start):
    path = make_qwen3_moe(tmp_path / "moe")
    policy = HFPolicy.from_pretrained(path).eval()
    engine = start(path)
    prompts = _prompts(3, seed=6)
    res = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in prompts])
    assert _max_logprob_error(policy, prompts, res) <= PARITY_TOL
    greedy = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=10)) for p in prompts]
    want = TorchEngine(HFPolicy.from_pretrained(path)).generate(greedy)
    assert [r.token_ids for r in engine.generate(greedy)] == [r.token_ids for r in want]


def _perturbed_moe_learner(path: str) -> tuple[HFPolicy, dict[str, torch.Tensor]]:
    """The learner (HFPolicy, transformers-loaded: fused expert names), every weight moved by 0.05 N(0, 1),
    and its state_dict (the keys `update_weights` receives from an HF learner)."""
    policy = HFPolicy.from_pretrained(path).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd), "the learner's experts are not fused"
    return policy, sd


def test_vllm_qwen3_moe_update_weights_with_fused_expert_names_matches_the_trainer(tmp_path, start):
    path = make_qwen3_moe(tmp_path / "moe")
    policy, sd = _perturbed_moe_learner(path)
    engine = start(path)
    prompts = _prompts(3, seed=7)
    sampled = [GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    engine.update_weights(sd, version=1)
    res = engine.generate(sampled)
    assert all(r.weight_version == 1 for r in res)
    err = _max_logprob_error(policy, prompts, res)
    print(f"qwen3_moe update_weights: max |vLLM - learner| log-prob = {err:.2e}")
    assert err <= PARITY_TOL
    old_err = _max_logprob_error(HFPolicy.from_pretrained(path).eval(), prompts, res)
    print(f"qwen3_moe update_weights: max |vLLM - old weights| log-prob = {old_err:.2e}")
    assert old_err > 1e-2  # the update landed in vLLM


def test_vllm_qwen3_moe_two_bucket_stream_equals_update_weights(tmp_path, start):
    """A 2-bucket `update_weights_stream` of the learner's (fused-name) state_dict: sampled log-probs equal
    the learner's, greedy tokens equal those after `update_weights` of the same state_dict."""
    path = make_qwen3_moe(tmp_path / "moe")
    policy, sd = _perturbed_moe_learner(path)
    engine = start(path)
    prompts = _prompts(3, seed=8)
    sampled = [GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    greedy = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=10)) for p in prompts]
    names = list(sd)
    half = len(names) // 2  # buckets hold whole tensors (fused ones included), as rl/learner/shard_export.py
    buckets = [{k: sd[k] for k in names[:half]}, {k: sd[k] for k in names[half:]}]
    assert all(any(k.endswith("experts.down_proj") for k in b) for b in buckets)

    engine.update_weights_stream(names, iter(buckets), version=1)
    res = engine.generate(sampled)
    assert all(r.weight_version == 1 for r in res)
    err = _max_logprob_error(policy, prompts, res)
    print(f"qwen3_moe 2-bucket stream: max |vLLM - learner| log-prob = {err:.2e}")
    assert err <= PARITY_TOL
    old_err = _max_logprob_error(HFPolicy.from_pretrained(path).eval(), prompts, res)
    print(f"qwen3_moe 2-bucket stream: max |vLLM - old weights| log-prob = {old_err:.2e}")
    assert old_err > 1e-2  # the streamed update landed
    streamed = [r.token_ids for r in engine.generate(greedy)]

    engine.update_weights(sd, version=2)
    assert [r.token_ids for r in engine.generate(greedy)] == streamed
    res = engine.generate(sampled)
    err2 = _max_logprob_error(policy, prompts, res)
    print(f"qwen3_moe update_weights after the stream: max |vLLM - learner| log-prob = {err2:.2e}")
    assert err2 <= PARITY_TOL

    with pytest.raises(ValueError, match="missing=.*lm_head.weight"):
        engine.update_weights_stream([n for n in names if n != "lm_head.weight"], iter(buckets), version=3)


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_odyssey_train_on_an_hf_model_with_its_tokenizer_through_vllm(ray_session, tmp_path):
    """`odyssey train` with model.hf_path (a Llama that ships the ChatML tokenizer of
    tests/foreign_tokenizers.py) and rollout.engine=vllm: Ray rollout workers sample with vLLM's own Llama
    code, the learner trains on those episodes strictly on-policy, so its log-probs equal vLLM's (ratio 1,
    KL 0 within 1e-4) on the first step and after a weight sync on the second."""
    import io
    import json

    from rich.console import Console

    from rl.config import load_config
    from rl.train.loop import Trainer
    from tests.foreign_tokenizers import make_tokenizer

    require_vllm()
    tok = make_tokenizer("chatml", tmp_path / "llama")
    hf_dir = make_llama(tmp_path / "llama", vocab_size=len(tok))
    cfg = load_config("configs/quickstart.yaml", [
        f"logging.run_dir={tmp_path / 'run'}", f"model.hf_path={hf_dir}", "learner.steps=2",
        "rollout.engine=vllm", "rollout.num_workers=1", "rollout.episodes=8", "rollout.max_new_tokens=12",
        "rollout.concurrent_episodes=4", "orchestrator.max_staleness=0", "orchestrator.checkpoint_every=0",
        "orchestrator.eval_every=0", "logging.tensorboard=false",
        "rewards=[{name: 'tests.learner_fixtures:ascii_share'}]",
    ])
    Trainer(cfg, console=Console(file=io.StringIO(), width=200)).run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2], recs
    for r in recs:
        assert abs(r["learner/offpolicy_ratio_mean"] - 1.0) <= PARITY_TOL, r
        assert abs(r["learner/offpolicy_kl"]) <= PARITY_TOL, r
        assert r["learner/trained_trajectories"] > 0 and r["generated_tokens"] > 0
