"""LoRA (`learner.lora`, rl/learner/lora.py): only adapter weights train, the engines get merged weights.

Oracles and tolerances (fp32 CPU):
- merged == unmerged: the policy with its adapters (peft's LoRA layers) and a plain policy loaded with the
  merged weights give the same logits, max |diff| <= 1e-5 (the adapters are nonzero: they move the logits);
- one learner step: base weights bit-identical, adapters moved; its loss equals the hand-written GRPO
  objective at ratio 1 (-(1/N) sum of advantage x ratio) and the adapters' gradients equal those of a
  separate peft model (`peft.get_peft_model` on the plain transformers checkpoint, the same adapter
  weights) through transformers' own per-sequence forward, relative error <= 1e-5;
- rollout parity: TorchEngine loaded with the synced (merged) weights samples with log-probs equal to the
  learner's policy with adapters, <= 1e-4 (the trainer/inference parity bound of docs/architecture.md);
- the adapters' initial weights come from learner.seed; activation checkpointing gives the same step;
- resume: a checkpoint stores the adapter only; a learner loaded from it holds the same adapter and optimizer
  state, and its next step equals the uninterrupted learner's exactly;
- bad input (load_config, before anything starts): a target module the model lacks, an adapter on the LM
  head: a ConfigError naming the fix; Odyssey's model takes the same section (tests/test_lora_odyssey.py),
  dropout > 0 refused there;
- the real SmolLM2-135M-Instruct checkpoint: one learner step with LoRA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.hf_policy import HFPolicy
from model.tokenizer import load_tokenizer, policy_tokenizer, tokenizer_fingerprint
from rl.config import ConfigError, load_config
from rl.learner import Learner
from rl.learner.learner import ADAPTER_FILE, POLICY_DIR
from rl.learner.lora import adapter_state_dict, apply_lora, is_adapter_key, merged_state_dict
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams
from rl.trajectory import Trajectory, TurnSpan
from tests.test_hf_policy import _trajectories as hf_trajectories
from tests.test_hf_policy import make_llama

MERGE_TOL = 1e-5
GRAD_RTOL = 1e-5
PARITY_TOL = 1e-4
LORA = "learner.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj], dropout: 0.0}"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("llama"))


def _cfg(tmp_path, hf_dir: str, *extra: str):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return load_config(path, [f"model.hf_path={hf_dir}", "learner.group_size=2", "rollout.episodes=4",
                              "learner.lr=1e-2", LORA, *extra])


def _lora(rank: int = 4, alpha: float = 8.0, targets=("q_proj", "v_proj", "down_proj")):
    from rl.config import LoraSection

    return LoraSection(rank=rank, alpha=alpha, target_modules=list(targets), dropout=0.0)


def _randomise_adapters(policy: torch.nn.Module, seed: int = 0) -> None:
    """Nonzero lora_B (peft starts it at zero), so the adapters change the forward."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _trajectories(engine: TorchEngine, vocab: int, fp: str, n_groups: int = 2,
                  group_size: int = 2) -> list[Trajectory]:
    """test_hf_policy's scored single-turn rollouts, on prompts drawn from this model's vocabulary."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, vocab, int(rng.integers(3, 14))).tolist() for _ in range(n_groups)]
    return hf_trajectories(engine, n_groups, group_size, prompts=prompts, fp=fp)


def _llama_trajectories(llama_dir: str) -> list[Trajectory]:
    return _trajectories(TorchEngine(HFPolicy.from_pretrained(llama_dir)), len(load_tokenizer()),
                         tokenizer_fingerprint(load_tokenizer()))


# ---- merge ------------------------------------------------------------------------------------------


@torch.no_grad()
def test_merged_weights_give_the_unmerged_forward(llama_dir):
    policy = apply_lora(HFPolicy.from_pretrained(llama_dir), _lora()).eval()
    _randomise_adapters(policy)
    plain = HFPolicy.from_pretrained(llama_dir).eval()
    merged = merged_state_dict(policy)
    assert set(merged) == set(plain.state_dict())  # the engines' names, no adapter keys
    ids = torch.randint(10, 500, (23,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    base = plain.head_logits(plain.packed_hidden(ids, cu))
    plain.load_state_dict(merged, strict=True)
    want = policy.head_logits(policy.packed_hidden(ids, cu))
    got = plain.head_logits(plain.packed_hidden(ids, cu))
    assert (want - base).abs().max() > 1e-2  # the adapters matter
    err = float((got - want).abs().max())
    assert err <= MERGE_TOL, err


def test_only_adapters_are_trainable_and_lm_head_is_untouched(llama_dir):
    policy = apply_lora(HFPolicy.from_pretrained(llama_dir), _lora())
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    # 2 layers x 3 targets x (A, B)
    assert len(trainable) == 12 and len(adapter_state_dict(policy)) == 12
    assert not any("lm_head" in n or "embed_tokens" in n for n in trainable)


# ---- the learner step ---------------------------------------------------------------------------------


def _reference_grads(llama_dir: str, adapters: dict[str, torch.Tensor], trajs, learner: Learner):
    """The oracle: peft's get_peft_model on the plain transformers model with the learner's adapter weights,
    transformers' own forward per sequence, the PPO objective at ratio 1 written out: loss = -(1/N) sum over
    scored tokens of advantage * p / p.detach() (value -mean advantage, gradient -(1/N) sum A grad log p).
    Returns (loss, {adapter key: grad})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lc = learner.lc.lora
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ref = get_peft_model(hf, LoraConfig(r=lc.rank, lora_alpha=lc.alpha, target_modules=lc.target_modules,
                                        lora_dropout=0.0))
    params = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters() if p.requires_grad}
    assert set(params) == set(adapters)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(adapters[k])
    samples = learner.prepare(trajs).samples
    n_scored = sum(len(s.scored) for s in samples)
    loss = torch.zeros((), dtype=torch.float64)
    for s in samples:
        logits = ref(input_ids=torch.from_numpy(s.input_ids)[None]).logits[0].double()
        lp = torch.log_softmax(logits, -1)[torch.from_numpy(s.scored), torch.from_numpy(s.targets)]
        ratio = torch.exp(lp - lp.detach())  # 1, with the gradient of log p
        loss = loss - (torch.from_numpy(s.advantages) * ratio).sum() / n_scored
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in params.items()}


def test_a_learner_step_trains_only_the_adapters_as_peft_would(llama_dir, tmp_path):
    cfg = _cfg(tmp_path, llama_dir, "learner.tis_cap=null", "learner.grad_clip=1e6")
    learner = Learner(cfg)
    _randomise_adapters(learner.policy)  # nonzero B: every adapter weight gets a gradient
    trajs = _llama_trajectories(llama_dir)
    base = {k: v.clone() for k, v in learner.policy.state_dict().items() if not is_adapter_key(k)}
    adapters = adapter_state_dict(learner.policy)
    assert {id(p) for p in learner.params} == {id(p) for n, p in learner.policy.named_parameters()
                                               if is_adapter_key(n)}
    m = learner.step(trajs)
    ref_loss, ref_grads = _reference_grads(llama_dir, adapters, trajs, learner)
    assert abs(m["loss"] - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss)), (m["loss"], ref_loss)
    own = dict(learner.policy.named_parameters())
    for k, g in ref_grads.items():
        rel = float((own[k].grad - g).norm() / g.norm())
        assert rel <= GRAD_RTOL, (k, rel)
    after = learner.policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base is bit-identical
    assert all(not torch.equal(after[k], v) for k, v in adapters.items())  # every adapter moved


def test_adapters_are_seeded_and_activation_checkpointing_gives_the_same_step(llama_dir, tmp_path):
    """The adapters' initial weights come from learner.seed (every process draws the same, the global RNG
    untouched); recomputing activations in the backward gives the same step exactly."""
    trajs = _llama_trajectories(llama_dir)
    a = Learner(_cfg(tmp_path, llama_dir))
    torch.rand(3)  # the global RNG moved: the adapters do not depend on it
    b = Learner(_cfg(tmp_path, llama_dir, "learner.activation_checkpointing=true"))
    c = Learner(_cfg(tmp_path, llama_dir, "learner.seed=1"))
    first = adapter_state_dict(a.policy)
    assert all(torch.equal(v, adapter_state_dict(b.policy)[k]) for k, v in first.items())
    assert any(not torch.equal(v, adapter_state_dict(c.policy)[k]) for k, v in first.items())
    assert b.policy.hf.is_gradient_checkpointing
    ma, mb = a.step(trajs), b.step(trajs)
    assert ma["grad_norm"] == mb["grad_norm"] > 0 and ma["loss"] == mb["loss"]
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def test_rollout_logprobs_with_synced_weights_equal_the_learners(llama_dir, tmp_path):
    learner = Learner(_cfg(tmp_path, llama_dir))
    trajs = _llama_trajectories(llama_dir)
    learner.step(trajs)
    learner.step(trajs)  # step 1 moves B off zero, step 2 every adapter weight
    engine = TorchEngine(HFPolicy.from_pretrained(llama_dir))
    base = engine.generate([GenerationRequest(trajs[0].tokens.tolist()[:5], SamplingParams(max_new_tokens=6,
                                                                                           seed=1))])[0]
    engine.update_weights(learner.state_dict(), version=1)  # merged weights under the base names
    reqs = [GenerationRequest(t.tokens.tolist()[:5], SamplingParams(max_new_tokens=6, seed=1)) for t in trajs]
    policy = learner.policy.eval()
    worst = worst_rollout_logprob_gap(engine, reqs, policy)
    assert worst <= PARITY_TOL, worst
    # the adapters changed what the engine computes (same prompt and seed as before the sync)
    first = engine.generate(reqs[:1])[0]
    assert first.token_ids != base.token_ids or max(
        abs(a - b) for a, b in zip(first.logprobs, base.logprobs)) > 1e-3


def worst_rollout_logprob_gap(engine: TorchEngine, reqs: list[GenerationRequest], policy) -> float:
    """Generate `reqs` with `engine` (synced to weight version 1); the largest |rollout log-prob - the
    learner policy's `token_logprobs`| over every generated token (each token must carry version 1)."""
    worst = 0.0
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor(list(req.prompt_ids) + res.token_ids)
        with torch.no_grad():
            want = policy.token_logprobs(ids[:-1], ids[1:])[len(req.prompt_ids) - 1:]
        worst = max(worst, float((torch.tensor(res.logprobs) - want).abs().max()))
        assert res.token_versions == [1] * len(res.token_ids)
    return worst


def test_resume_restores_the_adapter_and_the_next_step_equals_an_uninterrupted_run(llama_dir, tmp_path):
    cfg = _cfg(tmp_path, llama_dir)
    trajs = _llama_trajectories(llama_dir)
    a = Learner(cfg)
    a.step(trajs)
    ckpt = a.save(tmp_path / "ckpt")
    assert (ckpt / ADAPTER_FILE).is_file() and not (ckpt / POLICY_DIR).exists()  # the adapter, not the model
    assert_resume_equals_uninterrupted(a, ckpt, cfg, trajs, adapter_state_dict(a.policy))


def assert_resume_equals_uninterrupted(a: Learner, ckpt, cfg, trajs, saved: dict[str, torch.Tensor]) -> None:
    """`a` (one step taken, saved to `ckpt` with adapter state `saved`) steps on; a new Learner(cfg) loaded
    from `ckpt` holds `saved` exactly and its next step equals `a`'s: the same metrics (timings aside) and
    bit-identical weights."""
    next_a = a.step(trajs)
    b = Learner(cfg)
    b.load(ckpt)
    assert all(torch.equal(v, adapter_state_dict(b.policy)[k]) for k, v in saved.items())
    assert b.optimizer_steps == 1
    next_b = b.step(trajs)
    timing = ("learner/step_s", "learner/tokens_per_s")
    assert {k: v for k, v in next_a.items() if k not in timing} == {
        k: v for k, v in next_b.items() if k not in timing}
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())


def test_a_checkpoint_of_another_lora_config_or_evaluating_it_is_refused(llama_dir, tmp_path):
    a = Learner(_cfg(tmp_path, llama_dir))
    ckpt = a.save(tmp_path / "ckpt")
    other = Learner(_cfg(tmp_path, llama_dir, "learner.lora.rank=2"))
    with pytest.raises(ValueError, match="resume with the learner.lora it was written with"):
        other.load(ckpt)
    from rl.train.eval import policy_dir

    with pytest.raises(ValueError, match="holds only its LoRA adapter"):  # odyssey eval without its config
        policy_dir(ckpt)
    with pytest.raises(ValueError, match="give the config the run was trained with"):
        policy_dir(ckpt, _cfg(tmp_path, llama_dir, "learner.lora.rank=2"))


def test_odyssey_eval_of_a_lora_checkpoint_plays_the_merged_policy(llama_dir, tmp_path):
    """policy_dir(checkpoint, cfg) of a learner.lora checkpoint: the config's model with the saved adapter
    merged, a plain checkpoint whose logits equal the adapted policy's (<= 1e-5); built once."""
    from rl.train.eval import policy_dir

    cfg = _cfg(tmp_path, llama_dir)
    a = Learner(cfg)
    _randomise_adapters(a.policy, seed=3)
    ckpt = a.save(tmp_path / "ckpt")
    merged = policy_dir(ckpt, cfg)
    assert merged.name == "merged_policy" and (merged / "config.json").is_file()
    loaded = HFPolicy.from_pretrained(merged).eval()
    ids = torch.randint(0, loaded.hf.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = a.policy.eval().hf(input_ids=ids).logits
        got = loaded.hf(input_ids=ids).logits
        base = HFPolicy.from_pretrained(llama_dir).eval().hf(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (base - want).abs().max().item() > 1e-3  # the adapters change the model: the merge carried them
    stamp = (merged / "COMPLETE").stat().st_mtime_ns
    assert policy_dir(ckpt, cfg) == merged and (merged / "COMPLETE").stat().st_mtime_ns == stamp


# ---- bad input ------------------------------------------------------------------------------------------


def test_a_target_module_the_model_lacks_is_a_config_error(llama_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, llama_dir, "learner.lora.target_modules=[q_proj, qkv_proj]")
    text = str(e.value)
    assert "'qkv_proj' names no Linear layer" in text and "q_proj" in text and "Use those names" in text
    assert "'q_proj'" not in text  # the valid one is not reported


def test_an_adapter_on_the_lm_head_is_a_config_error(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="the LM head and the embeddings take no adapter"):
        _cfg(tmp_path, llama_dir, "learner.lora.target_modules=[lm_head]")


def test_lora_on_odysseys_model_loads_and_its_dropout_is_a_config_error(tmp_path):
    """The same learner.lora section serves Odyssey's model (rl/learner/lora_odyssey.py; its tests:
    tests/test_lora_odyssey.py), except dropout, which an adapter on the weight cannot apply."""
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    cfg = load_config(path, [LORA])
    assert cfg.learner.lora.target_modules == ["q_proj", "v_proj", "down_proj"] and cfg.model.hf_path is None
    with pytest.raises(ConfigError, match=r"learner.lora.dropout=0.1.*set learner.lora.dropout=0"):
        load_config(path, [LORA, "learner.lora.dropout=0.1"])


def test_apply_lora_parametrizes_odysseys_model_and_refuses_other_modules():
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    policy = apply_lora(OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")), _lora())
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) and ".parametrizations." in n for n in trainable)
    with pytest.raises(ValueError, match="Hugging Face policies .* and Odyssey's model"):
        apply_lora(torch.nn.Linear(4, 4), _lora())


# ---- the real model ------------------------------------------------------------------------------------


def test_one_lora_learner_step_on_smollm2(tmp_path):
    """The real SmolLM2-135M-Instruct (model/embedded.py) with adapters on every attention and MLP
    projection: one step on a small batch trains the adapters only and syncs weights of the base names."""
    cfg = load_config(_write(tmp_path), [
        "model.hf_path=smollm2-135m-instruct", "learner.group_size=2", "learner.lr=1e-3",
        "learner.lora={rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj]}"])
    tok = policy_tokenizer(cfg.model.hf_path)
    learner = Learner(cfg, tokenizer=tok)
    rng = np.random.default_rng(0)
    fp = tokenizer_fingerprint(tok)
    trajs = []
    for k in range(4):
        P, G = 12, 8
        lp = np.full(P + G, np.nan, np.float32)
        lp[P:] = -3.0
        trajs.append(Trajectory(
            tokens=rng.integers(10, len(tok), P + G).astype(np.int32),
            loss_mask=np.r_[np.zeros(P), np.ones(G)].astype(np.uint8), rollout_logprobs=lp,
            routed_experts=None, turns=[TurnSpan("prompt", 0, P), TurnSpan("assistant", P, P + G)],
            rewards={"total": float(k % 2)}, turn_rewards=[0.0],
            metadata={"group_id": f"g{k // 2}", "tokenizer": fp}, terminated=True))
    head = learner.policy.lm_head.weight.detach().clone()
    q = learner.policy.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    adapters = adapter_state_dict(learner.policy)
    m = learner.step(trajs)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert torch.equal(learner.policy.lm_head.weight, head)
    assert torch.equal(learner.policy.model.layers[0].self_attn.q_proj.base_layer.weight, q)
    moved = [k for k, v in adapter_state_dict(learner.policy).items() if not torch.equal(v, adapters[k])]
    assert len(moved) == 30 * 7  # every layer's lora_B (A's gradient is zero while B is)
    n_lora = sum(p.numel() for p in learner.params)
    assert n_lora == sum(p.numel() for n, p in learner.policy.named_parameters() if is_adapter_key(n))
    sd = learner.state_dict()
    assert not any("lora_" in k or "base_layer" in k for k in sd)
    assert "model.layers.0.self_attn.q_proj.weight" in sd


def _write(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return path
