"""LoRA on Odyssey's own model (`learner.lora`, rl/learner/lora_odyssey.py): parametrized weights W + s B A.

Oracles and tolerances (fp32 CPU, the `tiny` preset, adapters on every adaptable weight: KDA q/k/v/b/f/g/o,
MLA q/kv_a/k_b/v_b/g/o, the dense FFN and shared experts, LatentMoE's latent_down/up and its stacked expert
weights w_gate_up / w_down_experts with per-expert A, B):
- merged == adapted: the policy with adapters (A and B random, nonzero) and a plain model loaded with
  W + s B A computed here by hand give the same logits, max |diff| <= 1e-5, both through the no-grad path
  (KDA's fused CPU kernels, which read the weights directly; checked to run) and the autograd path; and
  TorchEngine's prefill and decode (fused kernels, cached concatenated weights) sample the same tokens with
  log-probs within 1e-5 on either model;
- a learner step: only the adapters are trainable, the base weights stay bit-identical, every adapter moves;
  activation checkpointing gives the same step;
- rollout parity: TorchEngine loaded with the synced (merged) weights samples with log-probs equal to the
  learner's adapted policy, <= 1e-4 (docs/architecture.md's parity bound);
- data parallelism (2 gloo ranks, DDP) and sequence chunking (learner.sequence_chunk_tokens): the adapters'
  gradients equal one unchunked rank's, rel <= 1e-5 (gradients, not the weights after AdamW's first step,
  which is +-lr per element and amplifies rounding in near-zero gradients);
- resume: the checkpoint holds the adapter only (and the balancer's router biases, buffers the frozen base
  does not pin); the resumed learner's next step equals the uninterrupted one;
- bad input: unknown targets, the LM head, dropout > 0, sharded or context-parallel learners and a critic
  copied from the adapted trunk are ConfigErrors naming the valid names or the fix.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from model.kda import KDAttention
from model.tokenizer import load_tokenizer, tokenizer_fingerprint
from rl.config import ConfigError, LoraSection, load_config
from rl.learner import Learner
from rl.learner.learner import ADAPTER_FILE, POLICY_DIR, master_policy
from rl.learner.lora import adapter_state_dict, apply_lora, has_lora, is_adapter_key, merged_state_dict
from rl.learner.lora_odyssey import EXPERT_PARAMS, target_names
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams
from rl.trajectory import Trajectory, TurnSpan
from tests.test_lora import assert_resume_equals_uninterrupted, worst_rollout_logprob_gap

torch.set_num_threads(1)

MERGE_TOL = 1e-5
PARITY_TOL = 1e-4
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj",
               "g_b_proj", "kv_a_proj", "k_b_proj", "v_b_proj", "g_proj", "gate_proj", "up_proj", "down_proj",
               "latent_down", "latent_up", "w_gate_up", "w_down_experts"]
LORA = ("learner.lora={rank: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj, kv_a_proj, "
        "latent_down, w_gate_up, w_down_experts], dropout: 0.0}")


def _write(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return path


def _cfg(tmp_path, *extra: str):
    return load_config(_write(tmp_path), ["model.preset=tiny", "learner.group_size=2", "rollout.episodes=4",
                                          "learner.lr=1e-2", LORA, *extra])


def _randomise_adapters(policy: torch.nn.Module, seed: int = 0) -> None:
    """Nonzero A and B (B starts at zero), so every adapter changes the forward."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _hand_merged(policy: torch.nn.Module, scaling: float) -> dict[str, torch.Tensor]:
    """The oracle's weights: every `<m>.parametrizations.<p>.original` W replaced by W + scaling * B A,
    written out per expert for stacked weights (B_e A_e), under the plain model's name."""
    sd = policy.state_dict()
    out = {}
    for k, v in sd.items():
        if is_adapter_key(k):
            continue
        if k.endswith(".original"):
            owner, p = k.removesuffix(".original").split(".parametrizations.")
            a, b = sd[f"{owner}.parametrizations.{p}.0.lora_A"], sd[f"{owner}.parametrizations.{p}.0.lora_B"]
            if v.dim() == 3:
                delta = torch.stack([b[e] @ a[e] for e in range(v.shape[0])])
            else:
                delta = b @ a
            k, v = f"{owner}.{p}", v + scaling * delta
        out[k] = v
    return out


def _plain_and_adapted(targets: list[str]) -> tuple[torch.nn.Module, torch.nn.Module, LoraSection]:
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    torch.manual_seed(0)
    plain = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    adapted = OdysseyForCausalLM(plain.config).eval()
    adapted.load_state_dict(plain.state_dict())
    lora = LoraSection(rank=4, alpha=8.0, target_modules=targets, dropout=0.0)
    apply_lora(adapted, lora)
    _randomise_adapters(adapted)
    return plain, adapted, lora


def _trajectories(engine: TorchEngine, n_groups: int = 2, group_size: int = 2) -> list[Trajectory]:
    """Real TorchEngine rollouts as scored single-turn trajectories with their routed experts (reward:
    index parity)."""
    fp = tokenizer_fingerprint(load_tokenizer())
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 4000, int(rng.integers(4, 12))).tolist() for _ in range(n_groups)]
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=6, seed=g * 10 + i))
            for g, p in enumerate(prompts) for i in range(group_size)]
    out = []
    for k, (req, res) in enumerate(zip(reqs, engine.generate(reqs))):
        P, G = len(req.prompt_ids), len(res.token_ids)
        lp = np.full(P + G, np.nan, np.float32)
        lp[P:] = res.logprobs
        out.append(Trajectory(
            tokens=np.array(list(req.prompt_ids) + res.token_ids, np.int32),
            loss_mask=np.r_[np.zeros(P), np.ones(G)].astype(np.uint8), rollout_logprobs=lp,
            routed_experts=np.concatenate([res.prompt_routed_experts, res.routed_experts]),
            turns=[TurnSpan("prompt", 0, P), TurnSpan("assistant", P, P + G)],
            rewards={"total": float(k % 2)}, turn_rewards=[0.0],
            metadata={"group_id": f"g{k // group_size}", "tokenizer": fp}, terminated=True))
    return out


@pytest.fixture(scope="module")
def trajs(tmp_path_factory):
    """Rollouts of the base model the learner starts from (model.preset=tiny, learner.seed=0)."""
    cfg = _cfg(tmp_path_factory.mktemp("cfg"))
    return _trajectories(TorchEngine(master_policy(cfg)))


# ---- merge (the oracle) ---------------------------------------------------------------------------------


def test_every_adaptable_weight_is_a_target():
    plain, _, _ = _plain_and_adapted(["q_proj"])
    assert target_names(plain) == sorted(ALL_TARGETS)


def test_adapted_forward_equals_the_merged_plain_forward_fused_and_autograd(monkeypatch):
    from model import fused_cpu

    plain, adapted, lora = _plain_and_adapted(ALL_TARGETS)
    assert has_lora(adapted)
    merged = _hand_merged(adapted, lora.alpha / lora.rank)
    assert set(merged) == set(plain.state_dict())
    got = merged_state_dict(adapted)
    assert set(got) == set(merged)
    assert max(float((got[k] - v).abs().max()) for k, v in merged.items()) <= 1e-6
    # every target kind was adapted (stacked experts included) and its adapter moves the weight
    moved = {k.removesuffix(".weight").rsplit(".", 1)[-1]
             for k, v in merged.items() if not torch.equal(v, plain.state_dict()[k])}
    assert moved == set(ALL_TARGETS) and set(EXPERT_PARAMS) <= moved

    ids = torch.randint(10, 4000, (1, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = plain(input_ids=ids).logits[0]
    plain.load_state_dict(merged, strict=True)

    fused_runs = []
    real = KDAttention.forward_fused

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        fused_runs.append(out is not None)
        return out

    monkeypatch.setattr(KDAttention, "forward_fused", spy)
    with torch.no_grad():  # the fused CPU path: KDA reads [W_q; W_k; W_v] etc. directly
        want = plain(input_ids=ids).logits[0]
        fused_runs.clear()
        got_fused = adapted(input_ids=ids).logits[0]
    if fused_cpu.load() is None:
        pytest.skip("the fused CPU kernels did not build here (model/fused_cpu.py): the direct-read path is "
                    "not exercised")
    assert fused_runs and all(fused_runs), fused_runs  # every KDA layer ran its fused kernel
    got_grad = adapted(input_ids=ids).logits[0]  # autograd on: the torch path (cat of q/k/v, bmm experts)
    assert got_grad.requires_grad
    assert float((want - base).abs().max()) > 1e-2  # the adapters matter
    err_fused = float((got_fused - want).abs().max())
    err_grad = float((got_grad.detach() - want).abs().max())
    assert err_fused <= MERGE_TOL, err_fused
    assert err_grad <= MERGE_TOL, err_grad


def test_engine_prefill_and_decode_on_adapted_weights_equal_the_merged_model():
    """TorchEngine's fused prefill/decode kernels and its cached concatenated weights read the adapted weights
    (W + s B A) exactly as a plain model holding them."""
    plain, adapted, lora = _plain_and_adapted(ALL_TARGETS)
    plain.load_state_dict(_hand_merged(adapted, lora.alpha / lora.rank), strict=True)
    reqs = [GenerationRequest([5 + i, 77, 901, 13, 2000 + i], SamplingParams(max_new_tokens=6, seed=i))
            for i in range(2)]
    for a, b in zip(TorchEngine(adapted).generate(reqs), TorchEngine(plain).generate(reqs)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= MERGE_TOL
        assert np.array_equal(a.routed_experts, b.routed_experts)


def test_cached_no_grad_weight_follows_adapter_updates():
    """The no-grad reads' cached W' is rebuilt when an adapter changes (model/fused_weights.py keys its caches
    on the same storage/version counters): a second forward after an in-place update sees the new weights."""
    plain, adapted, lora = _plain_and_adapted(["q_proj", "w_gate_up"])
    ids = torch.randint(10, 4000, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted(input_ids=ids)
        for n, p in adapted.named_parameters():
            if n.endswith("lora_B"):
                p.mul_(-3.0)
        got = adapted(input_ids=ids).logits[0]
        plain.load_state_dict(_hand_merged(adapted, lora.alpha / lora.rank), strict=True)
        want = plain(input_ids=ids).logits[0]
    assert float((got - want).abs().max()) <= MERGE_TOL


def test_adapter_gradients_are_the_chain_rule_through_the_merged_weight():
    """d loss / dA = s B^T G and d loss / dB = s G A^T (per expert for stacked weights), G = d loss / dW' of
    a plain model holding W' = W + s B A, loss = the sum of token log-probs. Relative error <= 1e-5."""
    plain, adapted, lora = _plain_and_adapted(ALL_TARGETS)
    s = lora.alpha / lora.rank
    plain.load_state_dict(_hand_merged(adapted, s), strict=True)
    ids = torch.randint(10, 4000, (17,), generator=torch.Generator().manual_seed(4))
    adapted.token_logprobs(ids[:-1], ids[1:]).sum().backward()
    plain.token_logprobs(ids[:-1], ids[1:]).sum().backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    worst = 0.0
    for name, module in adapted.named_modules():
        for p, plist in getattr(module, "parametrizations", {}).items():
            delta = plist[0]
            g = grads[f"{name}.{p}"]  # [(E,) out, in]
            want_a = s * delta.lora_B.detach().transpose(-1, -2) @ g
            want_b = s * g @ delta.lora_A.detach().transpose(-1, -2)
            for got, want in ((delta.lora_A.grad, want_a), (delta.lora_B.grad, want_b)):
                worst = max(worst, float((got - want).norm() / want.norm()))
    assert worst <= 1e-5, worst


# ---- the learner ---------------------------------------------------------------------------------------


def test_a_learner_step_trains_only_the_adapters(tmp_path, trajs):
    """Base parameters bit-identical, every adapter moved; the balancer still moves the router biases (model
    buffers, not weights: rl/learner's aux-loss-free balancing) and routing replay still replays."""
    learner = Learner(_cfg(tmp_path, "learner.tis_cap=null"))
    assert learner.replay  # R3 on: the trajectories carry the rollout's routed experts
    trainable = [n for n, p in learner.policy.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert {id(p) for p in learner.params} == {id(p) for n, p in learner.policy.named_parameters()
                                               if is_adapter_key(n)}
    _randomise_adapters(learner.policy)  # nonzero B: every adapter weight gets a gradient
    base = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if not is_adapter_key(n)}
    biases = {n: b.clone() for n, b in learner.policy.named_buffers()
              if n.endswith("e_score_correction_bias")}
    adapters = {k: v for k, v in adapter_state_dict(learner.policy).items() if is_adapter_key(k)}
    m = learner.step(trajs)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    after = dict(learner.policy.named_parameters())
    changed = sorted(k for k, v in base.items() if not torch.equal(after[k], v))
    assert changed == [], changed  # the base is bit-identical
    assert all(not torch.equal(after[k], v) for k, v in adapters.items())  # every adapter moved
    now = dict(learner.policy.named_buffers())
    assert biases and any(not torch.equal(now[k], v) for k, v in biases.items())  # the balancer ran


def test_adapters_are_seeded_and_activation_checkpointing_gives_the_same_step(tmp_path, trajs):
    a = Learner(_cfg(tmp_path))
    torch.rand(3)  # the global RNG moved: the adapters do not depend on it
    b = Learner(_cfg(tmp_path, "learner.activation_checkpointing=true"))
    first = adapter_state_dict(a.policy)
    assert all(torch.equal(v, adapter_state_dict(b.policy)[k]) for k, v in first.items())
    assert all(not v.any() for k, v in first.items() if k.endswith("lora_B"))  # B starts at zero
    ma, mb = a.step(trajs), b.step(trajs)
    assert ma["grad_norm"] == mb["grad_norm"] > 0 and ma["loss"] == mb["loss"]
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def test_rollout_logprobs_with_synced_weights_equal_the_learners(tmp_path, trajs):
    cfg = _cfg(tmp_path)
    learner = Learner(cfg)
    learner.step(trajs)
    learner.step(trajs)  # step 1 moves B off zero, step 2 every adapter weight
    engine = TorchEngine(master_policy(cfg))
    prompts = [t.tokens.tolist()[:5] for t in trajs]
    base = engine.generate([GenerationRequest(prompts[0], SamplingParams(max_new_tokens=6, seed=1))])[0]
    synced = learner.state_dict()
    assert not any("lora_" in k or "parametrizations" in k for k in synced)  # the base model's names
    engine.update_weights(synced, version=1)
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=6, seed=1)) for p in prompts]
    policy = learner.policy.eval()
    worst = worst_rollout_logprob_gap(engine, reqs, policy)
    assert worst <= PARITY_TOL, worst
    first = engine.generate(reqs[:1])[0]  # the adapters changed what the engine computes
    assert first.token_ids != base.token_ids or max(
        abs(a - b) for a, b in zip(first.logprobs, base.logprobs)) > 1e-3


def test_resume_restores_the_adapter_and_the_next_step_equals_an_uninterrupted_run(tmp_path, trajs):
    cfg = _cfg(tmp_path)
    a = Learner(cfg)
    a.step(trajs)
    ckpt = a.save(tmp_path / "ckpt")
    assert (ckpt / ADAPTER_FILE).is_file() and not (ckpt / POLICY_DIR).exists()  # the adapter, not the model
    from safetensors.torch import load_file

    saved = adapter_state_dict(a.policy)  # the adapters and the balancer's router biases
    assert set(load_file(str(ckpt / ADAPTER_FILE))) == set(saved)
    assert {k for k in saved if not is_adapter_key(k)} == {
        n for n, _ in a.policy.named_buffers() if n.endswith("e_score_correction_bias")}
    assert_resume_equals_uninterrupted(a, ckpt, cfg, trajs, saved)


def _adapter_grads_and_biases(learner: Learner) -> dict[str, torch.Tensor]:
    """The adapters' gradients of the last optimizer step (all-reduced under DDP; they stay set until the next
    step's zero_grad) under `grad.<name>`, and the router biases the balancer moved."""
    out = {f"grad.{n}": p.grad.detach().clone() for n, p in learner.policy.named_parameters()
           if is_adapter_key(n)}
    out.update({n: b.detach().clone() for n, b in learner.policy.named_buffers()
                if n.endswith("e_score_correction_bias")})
    return out


def test_sequence_chunking_gives_the_same_adapter_gradients(tmp_path, trajs):
    """learner.sequence_chunk_tokens=8 (windows with carried KDA/MLA state, model/sequence_chunks.py) reads
    the adapted weights in every window: the adapters' gradients equal the unchunked step's, rel <= 1e-5."""
    a, b = Learner(_cfg(tmp_path)), Learner(_cfg(tmp_path, "learner.sequence_chunk_tokens=8"))
    for learner in (a, b):
        _randomise_adapters(learner.policy)
        learner.step(trajs)
    ga, gb = _adapter_grads_and_biases(a), _adapter_grads_and_biases(b)
    keys = sorted(k for k in ga if k.startswith("grad."))
    fa, fb = (torch.cat([g[k].reshape(-1) for k in keys]) for g in (ga, gb))
    rel = float((fa - fb).norm() / fa.norm())
    assert rel <= 1e-5, rel


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One data-parallel rank: LearnerGroup.step's work (prepare, plan, this rank's update) over gloo."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rl.learner.sharding import plan_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = torch.load(os.path.join(out_dir, "cfg.pt"), weights_only=False)
        trajs = torch.load(os.path.join(out_dir, "trajs.pt"), weights_only=False)
        learner = Learner(cfg)
        _randomise_adapters(learner.policy)  # nonzero B: A's gradients too
        batch = learner.prepare(trajs)
        plan = plan_step(batch.samples, cfg.learner.num_minibatches, world, cfg.learner.seed)[rank]
        by_index = {s.index: s for s in batch.samples}
        learner.update([by_index[i] for i in plan.sample_indices()], plan, batch.metrics)
        save_file(_adapter_grads_and_biases(learner), os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_equal_one_rank(tmp_path, trajs):
    """learner.num_ranks=2 (DDP over gloo, learner.sharding=none) on the batch split over the ranks: every
    rank's all-reduced adapter gradients equal one rank's on the whole batch (rel <= 1e-5; the weights after
    AdamW's first step are +-lr per element, which amplifies rounding in near-zero gradients, so the
    gradients are compared), and the balancer's router biases agree (atol 1e-6)."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    torch.save(_cfg(tmp_path, "learner.num_ranks=2"), tmp_path / "cfg.pt")
    torch.save(trajs, tmp_path / "trajs.pt")
    single = Learner(_cfg(tmp_path))
    _randomise_adapters(single.policy)
    single.step(trajs)
    want = _adapter_grads_and_biases(single)
    assert all(v.any() for k, v in want.items() if k.startswith("grad."))
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    grads = sorted(k for k in want if k.startswith("grad."))
    flat = lambda sd: torch.cat([sd[k].reshape(-1) for k in grads])  # noqa: E731
    assert float(flat(want).norm()) > 0
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert set(got) == set(want)
        rel = float((flat(got) - flat(want)).norm() / flat(want).norm())
        assert rel <= 1e-5, (rank, rel)
        for k in set(want) - set(grads):
            assert torch.allclose(got[k], want[k], atol=1e-6), k


# ---- bad input ------------------------------------------------------------------------------------------


def test_an_unknown_target_is_a_config_error_listing_the_valid_names(tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, "learner.lora.target_modules=[q_proj, qkv_proj, router]")
    text = str(e.value)
    assert "'qkv_proj' names no adaptable weight" in text and "'router' names no adaptable weight" in text
    assert "'q_proj'" not in text and "w_gate_up" in text and "kv_a_proj" in text
    assert "Use those names" in text


def test_an_adapter_on_the_lm_head_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="the LM head and the embedding take no adapter"):
        _cfg(tmp_path, "learner.lora.target_modules=[lm_head]")


@pytest.mark.parametrize("extra, fix", [
    (("learner.lora.dropout=0.1",), "set learner.lora.dropout=0"),
    (("learner.sharding=fsdp", "learner.num_ranks=2"), "Set learner.sharding=none"),
    (("learner.sharding=ep", "learner.num_ranks=2"), "Set learner.sharding=none"),
    (("learner.context_parallel=2", "learner.num_ranks=2"), "set learner.context_parallel=1"),
    (("learner.advantage=gae", "learner.value_model=critic"), "set learner.critic_preset"),
])
def test_refused_combinations_are_config_errors_naming_the_fix(tmp_path, extra, fix):
    with pytest.raises(ConfigError, match=fix):
        _cfg(tmp_path, *extra)


def test_apply_lora_refuses_dropout_and_unknown_targets_on_odysseys_model():
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    with torch.device("meta"):
        model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match="set learner.lora.dropout=0"):
        apply_lora(model, LoraSection(rank=2, alpha=4.0, target_modules=["q_proj"], dropout=0.1))
    with pytest.raises(ValueError, match="'lm_head' names no adaptable weight.*Use those names"):
        apply_lora(model, LoraSection(rank=2, alpha=4.0, target_modules=["lm_head"], dropout=0.0))
