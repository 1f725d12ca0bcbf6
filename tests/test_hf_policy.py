"""Any HF causal LM as the policy (model/hf_policy.py) through the learner and TorchEngine.

Small random Llama / Qwen3 / Qwen3-MoE checkpoints are created here (nothing is downloaded), with the
shipped tokenizer's vocabulary. Oracles, all fp32:
- packed forward == one HF forward per sequence (<= 1e-5): no cross-sequence attention, positions per
  sequence;
- cached decode (batched, rows of different lengths) == a full HF forward on each whole sequence (<= 1e-5);
- TorchEngine greedy == HF `generate` greedy, token for token;
- TorchEngine rollout log-probs == the learner's token_logprobs on the stored tokens (<= 1e-4), also on a
  session continued over two turns;
- a learner step from TorchEngine rollouts sees ratio 1 (learner log-probs == rollout log-probs in a real
  packed micro-batch, <= 1e-4) and changes the weights; the new weights load into TorchEngine by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model.hf_policy import HFPackedCache, HFPolicy, positions_from_cu_seqlens
from model.tokenizer import load_tokenizer, tokenizer_fingerprint
from rl.config import ConfigError, load_config
from rl.rollout.engine import GenerationRequest, Session, TorchEngine
from rl.rollout.sampling import SamplingParams
from rl.trajectory import Trajectory, TurnSpan

PACKED_TOL = 1e-5
PARITY_TOL = 1e-4
V = len(load_tokenizer())


def _save(model: torch.nn.Module, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def make_llama(path, seed: int = 0, vocab_size: int = V) -> str:
    """A 2-layer random Llama (head_dim 32: vLLM's CPU attention needs >= 32) saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=vocab_size, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return _save(LlamaForCausalLM(cfg), path)


def make_qwen3(path, seed: int = 1) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, vocab_size=V, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    return _save(Qwen3ForCausalLM(cfg), path)


def make_qwen3_moe(path, seed: int = 2) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, vocab_size=V, max_position_embeddings=1024)
    return _save(Qwen3MoeForCausalLM(cfg), path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def any_dir(request, tmp_path_factory, llama_dir) -> str:
    if request.param == "llama":
        return llama_dir
    make = {"qwen3": make_qwen3, "qwen3_moe": make_qwen3_moe}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def reference(path: str) -> torch.nn.Module:
    """The oracle model: the checkpoint in plain transformers, eager attention (no code of ours)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _per_sequence_logits(ref: torch.nn.Module, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The oracle: HF's own forward, one sequence at a time."""
    return torch.cat([ref(input_ids=ids[None, a:b]).logits[0] for a, b in zip(cu[:-1], cu[1:])])


def test_positions_restart_at_every_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@torch.no_grad()
def test_packed_forward_equals_per_sequence(any_dir):
    """Llama, Qwen3 (tied head), Qwen3-MoE: packed logits == per-sequence HF forward (fp32, <= 1e-5)."""
    policy = HFPolicy.from_pretrained(any_dir).eval()
    g = torch.Generator().manual_seed(0)
    lens = [7, 1, 19, 4]
    ids = torch.randint(0, V, (sum(lens),), generator=g)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    assert policy.packed_attention  # the per-sequence SDPA path, not a [T, T] mask
    packed = policy(ids, cu)
    ref = _per_sequence_logits(reference(any_dir), ids, cu)
    err = (packed - ref).abs().max().item()
    assert err <= PACKED_TOL, err
    # and packing is really needed: the same tokens as one sequence give other logits after the first one
    whole = policy(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
    assert (whole[lens[0]:] - ref[lens[0]:]).abs().max().item() > 1e-3


def test_packed_gradients_with_and_without_activation_checkpointing(llama_dir):
    """The backward's recomputation (transformers' checkpointing) runs the same packed attention: gradients
    equal the plain backward's (<= 1e-5), and packed gradients equal per-sequence ones on the eager oracle."""
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 9, 30, 40], dtype=torch.int32)
    tg = torch.roll(ids, -1)
    grads = []
    for ckpt in (False, True):
        policy = HFPolicy.from_pretrained(llama_dir).train()
        if ckpt:
            policy.gradient_checkpointing_enable()
        policy.token_logprobs(ids, tg, cu).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    ref = reference(llama_dir)
    lp = torch.log_softmax(_per_sequence_logits(ref, ids, cu), -1).gather(-1, tg[:, None]).sum()
    lp.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).abs().max().item() <= PACKED_TOL, n
        assert (grads[0][n] - want[n]).abs().max().item() <= PACKED_TOL, n


@torch.no_grad()
def test_token_logprobs_equal_log_softmax_of_hf_logits(llama_dir):
    policy = HFPolicy.from_pretrained(llama_dir).eval()
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    tg = torch.roll(ids, -1)
    lp = policy.token_logprobs(ids, tg, cu)
    ref = torch.log_softmax(_per_sequence_logits(reference(llama_dir), ids, cu), -1)
    ref = ref.gather(-1, tg[:, None]).squeeze(-1)
    assert (lp - ref).abs().max().item() <= PACKED_TOL


@torch.no_grad()
def test_cached_decode_equals_full_forward(any_dir):
    """Prefill 3 rows of different lengths packed, then 3 batched decode steps (right-padded rows): each
    step's logits == HF's full forward on the whole sequence so far (<= 1e-5); the input cache is
    unchanged."""
    policy = HFPolicy.from_pretrained(any_dir).eval()
    oracle = reference(any_dir)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 2)]
    cu = torch.tensor([0, 5, 16, 18], dtype=torch.int32)
    logits, cache = policy.packed_logits(torch.tensor(sum(seqs, [])), cu, policy.empty_cache(3))
    for a, b, s in zip(cu[:-1], cu[1:], seqs):
        ref = oracle(input_ids=torch.tensor([s])).logits[0]
        assert (logits[a:b] - ref).abs().max().item() <= PACKED_TOL
    for _ in range(3):
        new = torch.randint(0, V, (3,), generator=g)
        before = cache.lengths
        logits, nxt = policy.packed_logits(new, torch.arange(4, dtype=torch.int32), cache)
        assert cache.lengths == before  # not mutated
        cache = nxt
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            ref = oracle(input_ids=torch.tensor([s])).logits[0, -1]
            assert (logits[i] - ref).abs().max().item() <= PACKED_TOL
    assert cache.lengths == [len(s) for s in seqs]
    assert isinstance(cache, HFPackedCache)


@torch.no_grad()
def test_batched_decode_appends_in_place_but_never_into_another_branch(llama_dir):
    """Decode steps append into one KV buffer in place; a second step from the same cache (a branch) copies
    instead, so neither branch sees the other's token, and the first branch continues correctly after the
    second wrote (logits == HF's full forward, <= 1e-5)."""
    policy = HFPolicy.from_pretrained(llama_dir).eval()
    oracle = reference(llama_dir)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (4, 9)]
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    _, cache = policy.packed_logits(torch.tensor(sum(seqs, [])), cu, policy.empty_cache(2))
    step = torch.arange(3, dtype=torch.int32)
    _, c1 = policy.packed_logits(torch.tensor([7, 8]), step, cache)
    buf = c1.batch.buffers[0]
    _, a = policy.packed_logits(torch.tensor([11, 12]), step, c1)
    assert a.batch.buffers[0] is buf  # appended in place
    lb, b = policy.packed_logits(torch.tensor([21, 22]), step, c1)  # a branch from c1: copies
    assert b.batch.buffers[0] is not buf
    la2, _ = policy.packed_logits(torch.tensor([31, 32]), step, a)
    for i, s in enumerate(seqs):
        want_b = oracle(input_ids=torch.tensor([s + [7 + i, 21 + i]])).logits[0, -1]
        want_a = oracle(input_ids=torch.tensor([s + [7 + i, 11 + i, 31 + i]])).logits[0, -1]
        assert (lb[i] - want_b).abs().max().item() <= PACKED_TOL
        assert (la2[i] - want_a).abs().max().item() <= PACKED_TOL
    assert c1.lengths == [5, 10] and a.lengths == [6, 11]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, V, int(rng.integers(3, 14))).tolist() for _ in range(n)]


@torch.no_grad()
def test_torch_engine_greedy_equals_hf_generate(llama_dir):
    policy = HFPolicy.from_pretrained(llama_dir)
    engine = TorchEngine(policy, max_batch_size=4, prefill_chunk_size=8)
    prompts = _prompts(3)
    results = engine.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=10))
                               for p in prompts])
    for p, r in zip(prompts, results):
        out = policy.hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=10, min_new_tokens=10)
        assert r.token_ids == out[0, len(p):].tolist()
        assert r.routed_experts is None and r.prompt_routed_experts is None


@torch.no_grad()
def test_torch_engine_logprobs_equal_token_logprobs(any_dir):
    """Sampled rollouts (T = 1), two turns on one session: every log-prob == token_logprobs on the whole
    conversation (fp32, <= 1e-4)."""
    policy = HFPolicy.from_pretrained(any_dir)
    engine = TorchEngine(policy, max_batch_size=2, prefill_chunk_size=16)
    prompts = _prompts(3, seed=1)
    first = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=9, seed=i))
                             for i, p in enumerate(prompts)])
    obs = [[11, 12, 13], [14], [15, 16]]
    second = engine.generate([
        GenerationRequest(o, SamplingParams(max_new_tokens=6, seed=10 + i), session=r.session)
        for i, (o, r) in enumerate(zip(obs, first))
    ])
    for p, r1, o, r2 in zip(prompts, first, obs, second):
        ids = p + r1.token_ids + o + r2.token_ids
        t = torch.tensor(ids)
        lp = policy.token_logprobs(t[:-1], t[1:])
        P1, P2 = len(p), len(p) + len(r1.token_ids) + len(o)
        got = torch.tensor(r1.logprobs + r2.logprobs)
        want = torch.cat([lp[P1 - 1:P1 - 1 + len(r1.token_ids)], lp[P2 - 1:]])
        assert (got - want).abs().max().item() <= PARITY_TOL
        assert r2.session.num_tokens == len(ids)


def _trajectories(engine: TorchEngine, n_groups: int = 2, group_size: int = 2,
                  prompts: list[list[int]] | None = None, fp: str | None = None) -> list[Trajectory]:
    """Real TorchEngine rollouts as scored single-turn trajectories (reward: index parity). prompts: one per
    group (default: Odyssey-vocabulary prompts); fp: the recorded tokenizer fingerprint (default: Odyssey)."""
    fp = fp or tokenizer_fingerprint(load_tokenizer())
    prompts = prompts or _prompts(n_groups, seed=3)
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=8, seed=g * 10 + i))
            for g, p in enumerate(prompts) for i in range(group_size)]
    out = []
    for k, (req, res) in enumerate(zip(reqs, engine.generate(reqs))):
        P, G = len(req.prompt_ids), len(res.token_ids)
        tokens = np.array(list(req.prompt_ids) + res.token_ids, np.int32)
        mask = np.r_[np.zeros(P), np.ones(G)].astype(np.uint8)
        lp = np.full(P + G, np.nan, np.float32)
        lp[P:] = res.logprobs
        out.append(Trajectory(tokens=tokens, loss_mask=mask, rollout_logprobs=lp, routed_experts=None,
                              turns=[TurnSpan("prompt", 0, P), TurnSpan("assistant", P, P + G)],
                              rewards={"total": float(k % 2)}, turn_rewards=[0.0],
                              metadata={"group_id": f"g{k // group_size}", "tokenizer": fp}, terminated=True))
    return out


def _cfg(tmp_path, hf_dir: str, *extra: str):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return load_config(path, [f"model.hf_path={hf_dir}", "learner.group_size=2", "rollout.episodes=4",
                              "learner.lr=1e-3", *extra])


def test_learner_step_on_rollouts_then_weight_sync(llama_dir, tmp_path):
    """Learner on an HF Llama: ratio 1 on TorchEngine's own rollouts (learner log-probs == rollout
    log-probs in packed micro-batches, <= 1e-4), the weights move, and load into TorchEngine by name."""
    from rl.learner import Learner

    learner = Learner(_cfg(tmp_path, llama_dir))
    assert isinstance(learner.policy, HFPolicy)
    engine = TorchEngine(HFPolicy.from_pretrained(llama_dir))
    trajs = _trajectories(engine)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    m = learner.step(trajs)
    assert abs(m["learner/offpolicy_ratio_mean"] - 1.0) <= PARITY_TOL, m
    assert abs(m["learner/offpolicy_kl"]) <= PARITY_TOL, m
    assert m["learner/micro_batches"] >= 1 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert not any(k.startswith("moe/") for k in m)
    sd = learner.state_dict()
    assert set(sd) == set(before)
    moved = [k for k in sd if not torch.equal(sd[k], before[k])]
    assert "lm_head.weight" in moved and any(".self_attn." in k for k in moved)
    engine.update_weights(sd, version=1)
    t = torch.tensor(trajs[0].tokens.astype(np.int64))
    with torch.no_grad():
        want = learner.policy.eval().token_logprobs(t[:-1], t[1:])
        res = engine.generate([GenerationRequest(t.tolist()[:-1], SamplingParams(max_new_tokens=0),
                                                 forced_ids=t.tolist()[-1:])])[0]
    assert abs(res.logprobs[0] - float(want[-1])) <= PARITY_TOL
    assert res.token_versions == [1]


def test_learner_save_load_roundtrip_is_an_hf_checkpoint(llama_dir, tmp_path):
    from rl.learner import Learner

    cfg = _cfg(tmp_path, llama_dir)
    learner = Learner(cfg)
    learner.step(_trajectories(TorchEngine(HFPolicy.from_pretrained(llama_dir))))
    learner.save(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "policy" / "config.json").read_text())
    assert saved["model_type"] == "llama" and "odyssey" not in json.dumps(saved)  # loadable anywhere
    other = Learner(cfg)
    other.load(tmp_path / "ckpt")
    for k, v in learner.policy.state_dict().items():
        assert torch.equal(v, other.policy.state_dict()[k]), k
    assert other.optimizer_steps == learner.optimizer_steps == 1


def test_init_from_a_non_odyssey_checkpoint_loads_it_as_hf(llama_dir, tmp_path):
    from rl.policy import build_policy
    from rl.rollout.worker import WorkerSettings

    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    cfg = load_config(path, [f"model.init_from={llama_dir}"])
    policy = build_policy(WorkerSettings.from_config(cfg))
    assert isinstance(policy, HFPolicy)
    from safetensors import safe_open

    with safe_open(f"{llama_dir}/model.safetensors", "pt") as f:
        assert set(f.keys()) == set(policy.state_dict())


@pytest.mark.parametrize("extra, needle", [
    (["learner.sequence_chunk_tokens=64"], "learner.sequence_chunk_tokens needs Odyssey's model"),
    (["model.overrides={balancing: none}"], "model.overrides apply to Odyssey presets"),
    (["learner.advantage=gae", "learner.value_model=critic", "learner.critic_preset=tiny"],
     "remove learner.critic_preset"),
])
def test_odyssey_only_keys_are_refused_with_an_hf_model(llama_dir, tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, llama_dir, *extra)
    assert needle in str(e.value)


def test_hf_path_errors_name_the_problem(llama_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for value, needle in [(tmp_path / "nope", "is not a directory"),
                          (tmp_path / "empty", "holds no config.json")]:
        with pytest.raises(ConfigError) as e:
            _cfg(tmp_path, str(value))
        assert needle in str(e.value)
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, llama_dir, f"model.init_from={llama_dir}")
    assert "both set" in str(e.value)
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                        intermediate_size=32, vocab_size=100)
    LlamaForCausalLM(small).save_pretrained(str(tmp_path / "small"))
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, str(tmp_path / "small"))
    assert "vocab_size (100) is smaller than Odyssey's tokenizer" in str(e.value)


def test_routing_replay_is_off_for_a_dense_hf_model_and_on_for_an_hf_moe(llama_dir, tmp_path):
    """learner.routing_replay (default true) has nothing to replay in a dense HF model; an HF MoE replays its
    recorded routes (model/hf_routing.py, tests/test_hf_routing.py), silently in both cases."""
    import warnings

    from rl.learner import Learner

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = Learner(_cfg(tmp_path, llama_dir))
        moe = Learner(_cfg(tmp_path, make_qwen3_moe(tmp_path / "moe")))
    assert dense.replay is False and dense.facts.n_moe_layers == 0
    assert moe.replay is True and moe.facts.n_moe_layers == 2


def test_a_session_object_is_reused_unchanged_after_a_forward(llama_dir):
    """OdysseyCache's contract: a forward returns a new cache; continuing the same session twice gives
    the same log-probs (the first continuation did not append to the session's cache)."""
    policy = HFPolicy.from_pretrained(llama_dir)
    engine = TorchEngine(policy)
    r = engine.generate([GenerationRequest(_prompts(1)[0], SamplingParams(max_new_tokens=3, seed=0))])[0]
    sess: Session = r.session
    snapshot = Session(cache=sess.cache, next_logits=sess.next_logits, token_ids=list(sess.token_ids),
                       num_tokens=sess.num_tokens, weight_version=sess.weight_version)
    a = engine.generate([GenerationRequest([20, 21], SamplingParams(max_new_tokens=4, seed=5),
                                           session=sess)])[0]
    b = engine.generate([GenerationRequest([20, 21], SamplingParams(max_new_tokens=4, seed=5),
                                           session=snapshot)])[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_warmup_refuses_an_hf_model_with_the_fix(llama_dir, tmp_path):
    from rl.warmup import build_model

    with pytest.raises(ValueError, match="SFT warm-up runs on Odyssey's model only.*SFTTrainer"):
        build_model(_cfg(tmp_path, llama_dir))
