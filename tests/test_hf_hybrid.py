"""Hybrid HF models (KDA linear attention + MLA / DSA, MoE) in the learner: model/hf_linear_attention.py.

Small random `kimi_linear` (KDA with the unbounded gate, MLA, MoE) and `glm5_next` (KDA with the lower-bound
gate, DSA indexed attention with a shared top-k layer, hyper-connections, MoE) checkpoints are built here;
nothing is downloaded. The oracle is transformers' own implementation, unpatched, eager attention, with its
torch reference kernels (`transformers_reference_kernels`: fla's Triton kernels do not run on CPU), run on one
sequence at a time. Tolerances (fp32), measured values in docs/hf.md "Hybrid models":
- packed learner log-probs (HFPolicy.token_logprobs over a packed row) == per-sequence HF: rel <= 1e-5;
- packed gradients of every parameter == per-sequence HF gradients: rel <= 1e-5 (with and without
  activation checkpointing, whose recomputation must see the packing too);
- without the patch, transformers' packed forward leaks state: the first sequence is right, later ones are
  off by > 1e-2 (what the patch fixes);
- config load refuses other hybrids (Gated DeltaNet, Mamba, ...) and KDA hybrids for rollout, naming why.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model.hf_linear_attention import patch_linear_attention, transformers_reference_kernels
from model.hf_policy import HFPolicy, positions_from_cu_seqlens
from model.tokenizer import load_tokenizer
from rl.config import ConfigError, load_config

TOL = 1e-5
V = len(load_tokenizer())
LENS = [7, 1, 19, 3, 70]  # shorter than the conv window, one token, longer than a 64-token chunk


def make_kimi_linear(path, seed: int = 0) -> str:
    """4 layers [KDA, KDA, MLA, KDA], the first FFN dense and the rest MoE (4 experts, top-2, 1 shared)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=16,
        linear_num_heads=2, layer_types=["linear_attention", "linear_attention", "full_attention",
                                         "linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=1024)
    KimiLinearForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def make_glm5_next(path, seed: int = 0) -> str:
    """4 layers [KDA, DSA (own indexer), DSA (shared top-k), KDA], hyper-connections (2 streams), the last FFN
    MoE; a 1-block vision tower (unused: text-only calls). index_topk 8 over pools of 4: sparse at T = 70."""
    from transformers.models.glm5_next import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_local_experts=4,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0, v_head_dim=16,
        qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2, index_kpool=4,
        linear_head_dim=16, linear_num_heads=2, hc_mult=2, pad_token_id=None, max_position_embeddings=1024,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"])
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                  projection_intermediate_size=32)
    Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).save_pretrained(
        str(path))
    return str(path)


MAKERS = {"kimi_linear": make_kimi_linear, "glm5_next": make_glm5_next}


@pytest.fixture(scope="module", params=list(MAKERS))
def hybrid(request, tmp_path_factory) -> tuple[str, str]:
    """(model_type, checkpoint directory)."""
    return request.param, MAKERS[request.param](tmp_path_factory.mktemp(request.param))


def reference(model_type: str, path: str) -> torch.nn.Module:
    """The oracle model: the checkpoint in plain transformers (no code of ours), eager attention."""
    from transformers import AutoModelForCausalLM
    from transformers.models.glm5_next import Glm5NextForConditionalGeneration

    cls = Glm5NextForConditionalGeneration if model_type == "glm5_next" else AutoModelForCausalLM
    return cls.from_pretrained(path, attn_implementation="eager")


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (sum(LENS),), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *np.cumsum(LENS)], dtype=torch.int32)
    return ids, torch.roll(ids, -1), cu


def _per_sequence_logprobs(model_type: str, ref: torch.nn.Module, ids: torch.Tensor, tg: torch.Tensor,
                           cu: torch.Tensor) -> torch.Tensor:
    """The oracle: HF's own forward on each sequence alone -> log p(tg[t]) [T] fp32."""
    with transformers_reference_kernels(model_type):
        logits = torch.cat([ref(input_ids=ids[None, a:b], use_cache=False).logits[0]
                            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    return torch.log_softmax(logits.float(), -1).gather(-1, tg[:, None]).squeeze(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_patch_swaps_the_kda_layers_only_for_kda_hybrids(hybrid):
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path)
    kda = [m for m in policy.modules() if type(m).__name__.startswith("Packed") and hasattr(m, "forget_gate")]
    assert len(kda) == {"kimi_linear": 3, "glm5_next": 2}[model_type]
    assert policy.hf.config.model_type == model_type
    assert patch_linear_attention(policy.hf) == 0  # idempotent: already patched
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                                         num_key_value_heads=1, intermediate_size=32, vocab_size=64))
    assert patch_linear_attention(llama) == 0
    assert all(not type(m).__name__.startswith("Packed") for m in llama.modules())


def test_packing_is_read_from_positions_or_varlen_kwargs():
    """The trunk's packing: sequence starts where position_ids restart at 0 (HFPolicy's sdpa call), or
    transformers' `cu_seq_lens_q` when given (its flash-attention call); none with a cache or B > 1."""
    from model.hf_linear_attention import _cu_from_call

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    pos = positions_from_cu_seqlens(cu)[None]
    assert _cu_from_call({"position_ids": pos}).tolist() == [0, 3, 4, 8]
    assert _cu_from_call({"position_ids": torch.arange(5)[None]}).tolist() == [0, 5]
    assert _cu_from_call({"position_ids": pos, "cu_seq_lens_q": torch.tensor([0, 8])}).tolist() == [0, 8]
    assert _cu_from_call({"position_ids": pos, "past_key_values": object()}) is None
    assert _cu_from_call({"position_ids": torch.arange(4).repeat(2, 1)}) is None


@torch.no_grad()
def test_packed_logprobs_equal_per_sequence_hf(hybrid):
    """HFPolicy.token_logprobs over one packed row (per-sequence state resets in the KDA layers' short convs
    and recurrences, per-sequence MLA / DSA) == transformers per sequence, rel <= 1e-5 (fp32)."""
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).eval()
    ids, tg, cu = _batch()
    got = policy.token_logprobs(ids, tg, cu)
    want = _per_sequence_logprobs(model_type, reference(model_type, path).eval(), ids, tg, cu)
    assert _rel(got, want) <= TOL, _rel(got, want)
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()


@torch.no_grad()
def test_without_the_patch_the_packed_forward_leaks_state(hybrid):
    """The bug the patch fixes: transformers' own packed forward (the call HFPolicy makes) runs the KDA state
    from one sequence into the next: the first sequence is right, the later ones are off."""
    model_type, path = hybrid
    ref = reference(model_type, path).eval()
    ids, tg, cu = _batch()
    want = _per_sequence_logprobs(model_type, ref, ids, tg, cu)
    with transformers_reference_kernels(model_type):
        h = ref.model(input_ids=ids[None], position_ids=positions_from_cu_seqlens(cu)[None],
                      use_cache=False).last_hidden_state[0]
    leaked = torch.log_softmax(ref.lm_head(h).float(), -1).gather(-1, tg[:, None]).squeeze(-1)
    first = int(cu[1])
    assert (leaked[:first] - want[:first]).abs().max().item() <= TOL
    assert (leaked[first:] - want[first:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_per_sequence_hf(hybrid, checkpointing):
    """d(sum of packed log-probs)/d(every parameter) == the per-sequence HF gradients, rel <= 1e-5 per
    parameter; with activation checkpointing the recomputation sees the same packing."""
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).train()
    if checkpointing:
        policy.gradient_checkpointing_enable()
    ids, tg, cu = _batch(1)
    policy.token_logprobs(ids, tg, cu).sum().backward()
    ref = reference(model_type, path).train()
    _per_sequence_logprobs(model_type, ref, ids, tg, cu).sum().backward()
    want = dict(ref.named_parameters())
    checked = 0
    for name, p in policy.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        w = want[name].grad if want[name].grad is not None else torch.zeros_like(p)
        if w.norm() == 0:
            assert g.norm().item() <= 1e-12, name
            continue
        assert _rel(g, w) <= TOL, (name, _rel(g, w))
        checked += 1
    kda_params = [n for n in want if ".forget_gate." in n or ".conv1d." in n]
    assert checked > 20 and all(want[n].grad is not None for n in kda_params)


def _cfg(tmp_path, saved: dict, *extra: str):
    d = tmp_path / str(saved["model_type"])
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(saved))
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return load_config(path, [f"model.hf_path={d}", "learner.group_size=2", "rollout.episodes=4", *extra])


@pytest.mark.parametrize("saved, needle", [
    ({"model_type": "qwen3_next", "vocab_size": V}, "'qwen3_next' is a hybrid with Gated DeltaNet"),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "vocab_size": V}},
     "'qwen3_5' is a hybrid with Gated DeltaNet"),
    ({"model_type": "nemotron_h", "vocab_size": V}, "'nemotron_h' is a hybrid with Mamba state-space"),
    ({"model_type": "my_hybrid", "vocab_size": V, "layer_types": ["full_attention", "mamba"]},
     "hybrid with layers of type mamba"),
])
def test_other_hybrids_are_refused_at_config_load(tmp_path, saved, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, saved)
    msg = str(e.value)
    assert needle in msg and "no per-sequence state resets" in msg and "kimi_linear and glm5_next" in msg


@pytest.mark.parametrize("engine", ["torch", "vllm"])
@pytest.mark.parametrize("model_type", list(MAKERS))
def test_kda_hybrids_are_refused_for_rollout_with_the_reason(tmp_path, model_type, engine):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, {"model_type": model_type, "vocab_size": V}, f"rollout.engine={engine}")
    msg = str(e.value)
    assert f"{model_type} (a KDA hybrid) trains in Odyssey's learner" in msg
    assert f"rollout.engine={engine} cannot generate with it yet" in msg
