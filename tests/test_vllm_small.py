"""VllmEngine parity on the `small` preset (fp32): a few short sequences, the same oracles as
tests/test_vllm_engine.py (trainer forward for log-probs and routing, TorchEngine for greedy decoding).
The small preset has q-LoRA in MLA (q_lora_rank 256), latent width 128 (the attention head size vLLM
sees), 64 experts top-4 and 12 layers (9 KDA, 3 MLA)."""

from __future__ import annotations

import pytest
import torch

from rl.rollout.engine import GenerationRequest, TorchEngine
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

LOGPROB_TOL = 1e-4
ROUTING_MIN = 0.999


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    path = tmp_path_factory.mktemp("vllm_small")
    model = save_policy("small", path, seed=1)
    eng = VllmEngine(str(path), max_model_len=512, max_num_seqs=4)
    yield model, eng
    eng.shutdown()


def test_small_logprob_routing_and_greedy_parity(setup):
    model, eng = setup
    prompts = [prompt(1, 9, vocab=32768), prompt(2, 40, vocab=32768)]
    sampled = eng.generate([GenerationRequest(p, SamplingParams(max_new_tokens=24)) for p in prompts])
    worst, agree = 0.0, 1.0
    for p, res in zip(prompts, sampled):
        lp, routed = trainer_view(model, p + res.token_ids, len(p))
        worst = max(worst, (lp - torch.tensor(res.logprobs)).abs().max().item())
        agree = min(agree, routing_agreement(engine_routing(res), routed))
    print(f"\nsmall fp32: logprob max|diff| {worst:.2e}, routing agreement {agree:.5f}")
    assert worst <= LOGPROB_TOL and agree >= ROUTING_MIN
    greedy = GenerationRequest(prompts[0], SamplingParams(temperature=0, max_new_tokens=64))
    ours = eng.generate([greedy])[0]
    ref = TorchEngine(model).generate([greedy])[0]
    assert ours.token_ids == ref.token_ids and len(ours.token_ids) == 64


def test_small_session_continuation_equals_fresh_prefill(setup):
    _, eng = setup
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    first, second = prompt(3, 30, vocab=32768), prompt(4, 20, vocab=32768)
    t1 = eng.generate([GenerationRequest(first, sp)])[0]
    t2 = eng.generate([GenerationRequest(second, sp, t1.session)])[0]
    fresh = eng.generate([GenerationRequest(first + t1.token_ids + second, sp)])[0]
    assert t2.token_ids == fresh.token_ids
    assert (t2.routed_experts == fresh.routed_experts).all()
