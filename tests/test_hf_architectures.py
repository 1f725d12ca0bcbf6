"""Every decoder-only causal LM family of the installed transformers that is cheap to build at tiny size,
through Odyssey's HF policy (model/hf_policy.py) and config validation (rl/config/checks.py): the HF
support table of docs/hf.md is this file's EXPECTED.

For each architecture a small random checkpoint (2 layers, hidden 64, fp32) is saved, then either
- it loads, and the learner's packed log-probs (three sequences in one row, transformers' own attention
  kwargs or not) equal HF's own eager forward of each sequence alone (<= 1e-5), also with a shared prefix
  and through activation checkpointing's recomputation (gradients <= 1e-5); or
- it is refused with an error that names the problem: when the config loads (`odyssey train` never
  starts), or when the policy loads (the load-time packing probe or the head check).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.hf_policy import HFPolicy
from model.tokenizer import load_tokenizer

V = len(load_tokenizer())  # checkpoints without tokenizer files run with Odyssey's tokenizer
PACKED_TOL = 1e-5
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)

DROP = object()  # an override that removes a TINY key the config class does not take

#: model_type (or a name for a variant) -> (model_type, config overrides, expected outcome). Outcomes:
#: "ok" (packed == per sequence), ("config", needle) refused by load_config, ("load", needle) refused by
#: HFPolicy.from_pretrained.
EXPECTED: dict[str, tuple[str, dict, object]] = {
    "llama": ("llama", {}, "ok"),
    "mistral": ("mistral", {"sliding_window": None}, "ok"),
    "mistral (sliding window)": ("mistral", {"sliding_window": 64}, ("config", "sliding_window=64")),
    "mixtral": ("mixtral", {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}, "ok"),
    "qwen2": ("qwen2", {}, "ok"),
    "qwen2 (use_sliding_window)": ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
                                             "max_window_layers": 0}, ("config", "sliding_attention")),
    "qwen3": ("qwen3", {}, "ok"),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
                  "ok"),
    "gemma": ("gemma", {}, "ok"),
    "gemma2": ("gemma2", {}, ("config", "sliding_attention")),
    "gemma3_text": ("gemma3_text", {}, ("config", "sliding_attention")),
    "phi": ("phi", {}, ("load", "lm_head has a bias")),
    "phi3": ("phi3", {}, "ok"),
    "phi3 (sliding window)": ("phi3", {"sliding_window": 64}, ("config", "sliding_window=64")),
    "stablelm": ("stablelm", {}, "ok"),
    "nemotron": ("nemotron", {}, "ok"),
    "olmo": ("olmo", {}, "ok"),
    "olmo2": ("olmo2", {}, "ok"),
    "granite": ("granite", {}, "ok"),
    "cohere": ("cohere", {}, ("load", "logit_scale")),
    "starcoder2": ("starcoder2", {}, "ok"),
    "smollm3": ("smollm3", {}, "ok"),
    "glm": ("glm", {}, "ok"),
    "helium": ("helium", {}, "ok"),
    "gpt_neox": ("gpt_neox", {}, ("load", "`model` trunk and an `lm_head`")),
    "gptj": ("gptj", {"rotary_dim": 8}, ("load", "`model` trunk and an `lm_head`")),
    "falcon": ("falcon", {"head_dim": DROP}, ("load", "`model` trunk and an `lm_head`")),
    "falcon (alibi)": ("falcon", {"head_dim": DROP, "alibi": True}, ("config", "ALiBi")),
}


def _checkpoint(name: str, path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, _ = EXPECTED[name]
    torch.manual_seed(0)
    kwargs = {k: v for k, v in {**TINY, **extra}.items() if v is not DROP}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


def _reference_logprobs(path: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle: the checkpoint in plain transformers (eager attention, no code of ours), one sequence at a
    time; log p(seq[t+1] | seq[:t+1]) per position, the last one against token 0."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    out = []
    for s in seqs:
        lp = torch.log_softmax(ref(input_ids=s[None]).logits[0].float(), -1)
        out.append(lp.gather(-1, torch.roll(s, -1)[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("name", list(EXPECTED))
def test_architecture_packs_exactly_or_is_refused(name, tmp_path):
    from rl.config import ConfigError, load_config

    path = _checkpoint(name, tmp_path / "ckpt")
    outcome = EXPECTED[name][2]
    (tmp_path / "c.yaml").write_text("env: {id: arith}\n")
    if isinstance(outcome, tuple) and outcome[0] == "config":
        with pytest.raises(ConfigError, match=f"model.hf_path={path}.*{outcome[1]}"):
            load_config(tmp_path / "c.yaml", [f"model.hf_path={path}"])
        return
    load_config(tmp_path / "c.yaml", [f"model.hf_path={path}"])  # validation passes
    if isinstance(outcome, tuple):
        with pytest.raises(ValueError, match=outcome[1]):
            HFPolicy.from_pretrained(path)
        return
    policy = HFPolicy.from_pretrained(path).eval()
    lens = [9, 1, 14, 6]
    ids = torch.randint(0, V, (sum(lens),), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    seqs = [ids[a:b] for a, b in zip(cu[:-1], cu[1:])]
    with torch.no_grad():
        got = policy.token_logprobs(ids, torch.cat([torch.roll(s, -1) for s in seqs]), cu)
    want = torch.cat(_reference_logprobs(path, seqs))
    err = (got - want).abs().max().item()
    assert err <= PACKED_TOL, (name, err)
    # the same tokens as one sequence differ: the check above would catch a leak across sequences
    with torch.no_grad():
        whole = policy.token_logprobs(ids, torch.cat([torch.roll(s, -1) for s in seqs]))
    assert (whole[lens[0]:] - want[lens[0]:]).abs().max().item() > 1e-3
    if policy.packed_attention:  # a shared prefix: sequence 3 continues sequence 1
        prefix_of = torch.tensor([-1, -1, 0, -1])
        with torch.no_grad():
            h = policy.packed_hidden(ids, cu, prefix_of)
        lp = torch.log_softmax(policy.head_logits(h).float(), -1)
        cont = torch.cat([seqs[0], seqs[2]])
        (ref,) = _reference_logprobs(path, [cont])
        mine = lp[cu[2]:cu[3] - 1].gather(-1, seqs[2][1:, None]).squeeze(-1)
        assert (mine - ref[lens[0]:-1]).abs().max().item() <= PACKED_TOL, name


@pytest.mark.parametrize("name", ["stablelm", "nemotron", "llama"])
def test_recomputation_under_activation_checkpointing_keeps_the_boundaries(name, tmp_path):
    """StableLM and Nemotron do not pass transformers' varlen kwargs to attention: the recomputed layers of
    the backward must still see the packed boundaries (gradients == the plain backward's, <= 1e-5), and a
    checkpointing enabled behind HFPolicy's back is refused instead of recomputing across sequences."""
    path = _checkpoint(name, tmp_path / "ckpt")
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    grads = []
    for ckpt in (False, True):
        policy = HFPolicy.from_pretrained(path).train()
        if ckpt:
            policy.gradient_checkpointing_enable()
        policy.token_logprobs(ids, torch.roll(ids, -1), cu).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).abs().max().item() <= PACKED_TOL, n
    policy = HFPolicy.from_pretrained(path).train()
    policy.hf.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="HFPolicy.gradient_checkpointing_enable"):
        policy.token_logprobs(ids, torch.roll(ids, -1), cu)


def test_a_packed_call_of_another_shape_is_refused_not_attended_across():
    """packed_sdpa inside a packed forward never falls back to causal attention over the whole row: an
    attention call whose length is not the packed row's raises, naming the problem."""
    from model.hf_policy import _Packing, _packing_scope, packed_sdpa

    q = torch.randn(1, 4, 10, 16)
    with _packing_scope(_Packing(torch.tensor([0, 6, 12], dtype=torch.int32), None, 12)):
        with pytest.raises(ValueError, match="inside a packed forward of 12 tokens"):
            packed_sdpa(torch.nn.Identity(), q, q, q, None)
        with pytest.raises(ValueError, match="soft-capping, sinks or a sliding window"):
            packed_sdpa(torch.nn.Identity(), q, q, q, None, softcap=30.0)
    with _packing_scope(_Packing(torch.tensor([0, 6, 10], dtype=torch.int32), None, 10)):
        out, _ = packed_sdpa(torch.nn.Identity(), q, q, q, None)
    s = q[:, :, 6:]
    a = torch.nn.functional.scaled_dot_product_attention(s, s, s, is_causal=True)
    assert torch.allclose(out[:, 6:], a.transpose(1, 2), atol=1e-6)


def test_the_load_time_probe_refuses_a_model_whose_packing_leaks(tmp_path, monkeypatch):
    """An architecture whose attention ignores the boundaries (simulated: packed_sdpa replaced by plain
    causal SDPA over the row, what StableLM got before) is refused when the policy loads, naming it."""
    import model.hf_policy as hp

    path = _checkpoint("llama", tmp_path / "ckpt")

    def leaky(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        o = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                             enable_gqa=key.shape[1] != query.shape[1])
        return o.transpose(1, 2).contiguous(), None

    monkeypatch.setattr(hp, "_PACKING_VERIFIED", {})
    from transformers import AttentionInterface

    real = hp.packed_sdpa
    monkeypatch.setattr(hp, "packed_sdpa", leaky)  # HFPolicy registers hp.packed_sdpa with transformers
    try:
        with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'.*do not reproduce the "
                                             r"per-sequence forward.*docs/hf.md"):
            HFPolicy.from_pretrained(path)
    finally:
        AttentionInterface.register(hp.PACKED_ATTENTION, real)
