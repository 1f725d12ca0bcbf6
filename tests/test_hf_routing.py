"""Routing replay (R3) and expert metrics for Hugging Face MoE policies (model/hf_routing.py).

Small random Qwen3-MoE / Kimi Linear / Gated DeltaNet MoE hybrid (Qwen3-Next, Qwen3.5-MoE) checkpoints and
lone MoE blocks of other architectures are made here.
Oracles, all fp32:
- every supported router class: replaying the block's own free choice gives the free block output bit for
  bit, and the replayed weights of any forced set are the architecture's formula written out by hand
  (softmax over all experts then renormalised over the set; sigmoid over the set, renormalised, scaled;
  softmax over the set's logits);
- TorchEngine records [T, n_moe, k] routes for prompt and generated tokens, equal to the learner's free
  routing on the same weights;
- after a router change (random router weights for Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE top-1, a moved
  selection bias for Kimi Linear), free routing changes the log-probs while replayed routes give back the
  rollout's (<= 1e-4);
- packed replay == one replayed forward per sequence (<= 1e-5);
- the real learner step accepts HF MoE trajectories with routes: ratio 1 with replay after the router change,
  not without it (learner.routing_replay=false);
- expert-load and agreement metrics equal a hand count of the same routes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from model.hf_policy import HFPolicy
from model.hf_routing import HFRouting, find_routed_layers
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams
from rl.trajectory import Trajectory, TurnSpan
from tests.test_hf_policy import V, _cfg, _prompts, _save, make_qwen3_moe

PARITY_TOL = 1e-4
PACKED_TOL = 1e-5

torch.set_num_threads(1)


def make_qwen3_moe_top1(path, seed: int = 4) -> str:
    """Qwen3-MoE with top-1 routing (norm_topk_prob: the chosen expert's weight is 1 whatever the logits), so
    a router change moves the choice only and replay must give back the rollout's log-probs exactly."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=1, norm_topk_prob=True, vocab_size=V,
                         max_position_embeddings=1024)
    return _save(Qwen3MoeForCausalLM(cfg), path)


def make_gdn_moe_top1(path, model_type: str, seed: int = 0) -> str:
    """A Gated DeltaNet MoE hybrid with top-1 routing: layers [GDN, GDN, gated attention, GDN] as
    tests/test_hf_gated_delta.py, 4 experts + a gated shared expert (which no router change touches).
    qwen3_next: the first FFN dense (mlp_only_layers), MoE in layers 1-3, norm_topk_prob; qwen3_5_moe (its
    text-only causal LM): MoE in every layer, always renormalised. Top-1 renormalised: the chosen expert's
    weight is 1, so replay must give back the rollout's log-probs exactly."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from tests.test_hf_gated_delta import LAYERS

    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
                  layer_types=LAYERS, max_position_embeddings=1024)
    if model_type == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(intermediate_size=96, norm_topk_prob=True,
                                                     mlp_only_layers=[0], **common))
    else:
        assert model_type == "qwen3_5_moe"
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common))
    return _save(model, path)


#: model -> (MoE layer indices, top-k) of the checkpoints below
MOE_LAYOUT = {"top1": ([0, 1], 1), "top2": ([0, 1], 2), "qwen3_next_top1": ([1, 2, 3], 1),
              "qwen3_5_moe_top1": ([0, 1, 2, 3], 1)}


@pytest.fixture(scope="module")
def gdn_dirs(tmp_path_factory) -> dict[str, str]:
    """model name of MOE_LAYOUT -> Gated DeltaNet MoE checkpoint directory."""
    return {f"{t}_top1": make_gdn_moe_top1(tmp_path_factory.mktemp(t), t)
            for t in ("qwen3_next", "qwen3_5_moe")}


@pytest.fixture(scope="module")
def top1_dir(tmp_path_factory) -> str:
    return make_qwen3_moe_top1(tmp_path_factory.mktemp("top1"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_qwen3_moe(tmp_path_factory.mktemp("moe"))


def _rollouts(engine: TorchEngine, n_groups: int = 2, group_size: int = 2) -> list[Trajectory]:
    """TorchEngine rollouts as scored trajectories carrying the recorded routes [T, n_moe, k] (prompt then
    generated tokens), rewards by index parity."""
    from model.tokenizer import load_tokenizer, tokenizer_fingerprint

    fp = tokenizer_fingerprint(load_tokenizer())
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=8, seed=g * 10 + i))
            for g, p in enumerate(_prompts(n_groups, seed=3)) for i in range(group_size)]
    out = []
    for k, (req, res) in enumerate(zip(reqs, engine.generate(reqs))):
        P, G = len(req.prompt_ids), len(res.token_ids)
        routes = np.concatenate([res.prompt_routed_experts, res.routed_experts])
        assert routes.shape[0] == P + G
        lp = np.full(P + G, np.nan, np.float32)
        lp[P:] = res.logprobs
        out.append(Trajectory(
            tokens=np.array(list(req.prompt_ids) + res.token_ids, np.int32),
            loss_mask=np.r_[np.zeros(P), np.ones(G)].astype(np.uint8), rollout_logprobs=lp,
            routed_experts=routes, turns=[TurnSpan("prompt", 0, P), TurnSpan("assistant", P, P + G)],
            rewards={"total": float(k % 2)}, turn_rewards=[0.0],
            metadata={"group_id": f"g{k // group_size}", "tokenizer": fp}, terminated=True))
    return out


def _packed(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The learner's view: inputs tokens[:-1] of each trajectory packed [T], targets [T], cu [N+1], replay
    routes[:-1] [T, n_moe, k]."""
    ids = torch.cat([torch.from_numpy(t.tokens[:-1].astype(np.int64)) for t in trajs])
    tgt = torch.cat([torch.from_numpy(t.tokens[1:].astype(np.int64)) for t in trajs])
    lens = [len(t.tokens) - 1 for t in trajs]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    rep = torch.cat([torch.from_numpy(t.routed_experts[:-1].astype(np.int64)) for t in trajs])
    return ids, tgt, cu, rep


def _generated_logprob_error(policy: HFPolicy, trajs: list[Trajectory], replay: bool) -> float:
    """max |learner log-prob - rollout log-prob| over the generated tokens, one packed forward."""
    ids, tgt, cu, rep = _packed(trajs)
    with torch.no_grad():
        h, _ = policy.packed_hidden_routed(ids, cu, replay_experts=rep if replay else None)
        lp = torch.log_softmax(policy.head_logits(h).float(), -1).gather(-1, tgt[:, None])[:, 0]
    want = torch.cat([torch.from_numpy(t.rollout_logprobs[1:]) for t in trajs])
    gen = torch.isfinite(want)
    return float((lp[gen] - want[gen].double()).abs().max())


def _perturb_routers(policy: HFPolicy, seed: int = 7) -> None:
    """A router update: new random router weights of the same scale (the rest of the model unchanged)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in policy.moe_layers():
            w = layer.router.weight
            w.copy_(torch.randn(w.shape, generator=g) * float(w.std()) * 3)


def _changed_fraction(policy: HFPolicy, trajs: list[Trajectory]) -> float:
    ids, _, cu, rep = _packed(trajs)
    with torch.no_grad():
        _, free = policy.packed_hidden_routed(ids, cu, return_routed=True)
    return float((free.sort(-1).values != rep.sort(-1).values).any(-1).float().mean())


# ---- router formulas, block by block ---------------------------------------------------------------------
def _blocks() -> dict[str, tuple[nn.Module, float]]:
    """One lone MoE block per supported router class (random weights) and its routed_scaling_factor."""
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        KimiLinearConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    D, n, k = 32, 8, 2
    common = dict(hidden_size=D, moe_intermediate_size=16, num_experts_per_tok=k)
    shared = dict(shared_expert_intermediate_size=16)
    blocks = {
        "qwen3_moe": Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=n, norm_topk_prob=False, **common)),
        "qwen3_moe_norm": Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=n, norm_topk_prob=True,
                                                                **common)),
        "qwen3_next": Qwen3NextSparseMoeBlock(Qwen3NextConfig(num_experts=n, **shared, **common)),
        "qwen3_5_moe": Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(num_experts=n,
                                                                     shared_expert_intermediate_size=16,
                                                                     **common)),
        "olmoe": OlmoeSparseMoeBlock(OlmoeConfig(num_experts=n, intermediate_size=16, **common)),
        "mixtral": MixtralSparseMoeBlock(MixtralConfig(num_local_experts=n, intermediate_size=16, **common)),
        "kimi_linear": KimiLinearMoE(KimiLinearConfig(num_local_experts=n, n_group=2, topk_group=1,
                                                      **common)),
        "deepseek_v3": DeepseekV3MoE(DeepseekV3Config(n_routed_experts=n, n_group=2, topk_group=2,
                                                      intermediate_size=16, **common)),
        "gpt_oss": GptOssMLP(GptOssConfig(num_local_experts=n, intermediate_size=16, hidden_size=D,
                                          num_experts_per_tok=k)),
    }
    torch.manual_seed(0)
    out = {}
    for name, b in blocks.items():
        for p in b.parameters():
            nn.init.normal_(p, std=0.3)
        for buf_name, buf in b.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.1)
        out[name] = (b.eval(), float(getattr(getattr(b, "gate", None), "routed_scaling_factor", 1.0)))
    return out


def _hooked(block: nn.Module) -> HFRouting:
    """HFRouting over a lone block (find_routed_layers reads model.layers[i].mlp)."""
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])
    holder.model.layers[0].mlp = block
    layers = find_routed_layers(holder)
    assert [x.layer_idx for x in layers] == [0]
    return HFRouting(layers)


def _output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = block(x[None])
    return (y[0] if isinstance(y, tuple) else y)[0]


def _hand_weights(name: str, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each family's routing weights written out (docs/hf.md, Routing replay for HF MoE)."""
    chosen = logits.double().gather(1, idx)
    if name in ("qwen3_moe", "olmoe"):  # softmax over all experts, not renormalised (norm_topk_prob False)
        return (chosen.exp() / logits.double().exp().sum(-1, keepdim=True)).float()
    if name in ("qwen3_moe_norm", "qwen3_next", "qwen3_5_moe", "mixtral"):  # renormalised over the set
        return (chosen.exp() / chosen.exp().sum(-1, keepdim=True)).float()
    if name in ("kimi_linear", "deepseek_v3"):  # sigmoid scores over the set, renormalised, scaled
        s = torch.sigmoid(chosen)
        return (s / s.sum(-1, keepdim=True) * router.routed_scaling_factor).float()
    assert name == "gpt_oss"  # softmax of the set's own logits
    return (chosen.exp() / chosen.exp().sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_norm", "qwen3_next", "qwen3_5_moe", "olmoe",
                                  "mixtral", "kimi_linear", "deepseek_v3", "gpt_oss"])
def test_replayed_router_matches_the_architecture(name):
    """Replaying a block's own free choice is the free block (bit for bit); any forced set runs exactly those
    experts, weighted by the architecture's formula on the current logits (<= 1e-6)."""
    block, _ = _blocks()[name]
    routing = _hooked(block)
    router, T, k, n = routing.layers[0].router, 40, routing.top_k, routing.n_experts
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        free = _output(block, x)
        with routing.scope(record=True) as rec:
            _output(block, x)
        chosen = HFRouting.stack(rec)
        with routing.scope(replay=chosen):
            same = _output(block, x)
        assert torch.equal(same, free)
        forced = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(t))[:k]
                              for t in range(T)])[:, None]
        seen = {}
        h = router.register_forward_hook(lambda m, a, o: seen.update(logits=o[0], w=o[1], idx=o[2]))
        with routing.scope(replay=forced):
            replayed = _output(block, x)
        h.remove()
    assert torch.equal(seen["idx"], forced[:, 0])
    want = _hand_weights(name, router, seen["logits"], forced[:, 0])
    assert (seen["w"].float() - want).abs().max() <= 1e-6
    assert (replayed - free).abs().max() > 1e-3  # a different expert mix gives a different output


# ---- rollout recording and replay --------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["top2", "qwen3_next_top1", "qwen3_5_moe_top1"])
def test_engine_records_prompt_and_generated_routes_equal_to_free_routing(model, moe_dir, gdn_dirs):
    """Routes [T, n_moe, k] uint16 for every token; for the Gated DeltaNet hybrids TorchEngine's per-row
    recurrent + conv state and chunked prefill route exactly as the learner's packed forward."""
    policy = HFPolicy.from_pretrained(moe_dir if model == "top2" else gdn_dirs[model])
    layers, k = MOE_LAYOUT[model]
    assert policy.moe_layer_indices == layers
    assert (policy.n_routed_experts, policy.num_experts_per_tok) == (4, k)
    trajs = _rollouts(TorchEngine(policy, max_batch_size=4, prefill_chunk_size=8))
    for t in trajs:
        assert t.routed_experts.shape == (len(t.tokens), len(layers), k)
        assert t.routed_experts.dtype == np.uint16
    assert _changed_fraction(policy, trajs) == 0.0


@pytest.mark.parametrize("kind", ["qwen3_moe_top1", "kimi_linear", "qwen3_next_top1", "qwen3_5_moe_top1"])
def test_replay_restores_rollout_logprobs_after_a_router_change(kind, top1_dir, gdn_dirs, tmp_path):
    """A rollout, then the router changes (Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE top-1: new router weights;
    Kimi Linear: a moved selection bias, which chooses but never weighs): free routing gives other log-probs,
    replay the rollout's."""
    if kind == "kimi_linear":
        from tests.test_hf_hybrid import make_kimi_linear

        path = make_kimi_linear(tmp_path / "kimi")
    else:
        path = gdn_dirs.get(kind, top1_dir)
    trajs = _rollouts(TorchEngine(HFPolicy.from_pretrained(path), max_batch_size=4, prefill_chunk_size=8))
    learner_policy = HFPolicy.from_pretrained(path)
    assert _generated_logprob_error(learner_policy, trajs, replay=True) <= PARITY_TOL
    if kind == "kimi_linear":
        assert learner_policy.moe_layer_indices == [1, 2, 3]
        with torch.no_grad():
            for j, layer in enumerate(learner_policy.moe_layers()):
                layer.router.e_score_correction_bias.copy_(torch.tensor([1.0, -1.0, -1.0, 1.0]).roll(j))
    else:
        _perturb_routers(learner_policy)
    assert _changed_fraction(learner_policy, trajs) > 0.2
    assert _generated_logprob_error(learner_policy, trajs, replay=False) > 1e-2
    assert _generated_logprob_error(learner_policy, trajs, replay=True) <= PARITY_TOL


def test_packed_replay_equals_per_sequence_replay(moe_dir):
    """Forced random routes (not the free choice) on a packed row == each sequence alone with its rows."""
    policy = HFPolicy.from_pretrained(moe_dir).eval()
    lens = [9, 5, 12]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, V, (sum(lens),), generator=g)
    rep = torch.stack([torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2)])
                       for _ in range(sum(lens))])
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    with torch.no_grad():
        packed, _ = policy.packed_hidden_routed(ids, cu, replay_experts=rep)
        free = policy.packed_hidden(ids, cu)
        alone = torch.cat([policy.packed_hidden_routed(ids[a:b], torch.tensor([0, b - a], dtype=torch.int32),
                                                       replay_experts=rep[a:b])[0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert (packed - alone).abs().max() <= PACKED_TOL
    assert (packed - free).abs().max() > 1e-3  # the forced routes did change the forward


def test_replay_errors_name_the_problem(moe_dir):
    policy = HFPolicy.from_pretrained(moe_dir)
    ids, cu = torch.arange(10, 16), torch.tensor([0, 6], dtype=torch.int32)
    for rep, needle in [(torch.zeros(6, 2, 3, dtype=torch.long), r"\[T, n_moe_layers, k\] = \[6, 2, 2\]"),
                        (torch.full((6, 2, 2), 4), r"outside \[0, 4\)"),
                        (torch.zeros(6, 2, 2, dtype=torch.long), "repeats an expert"),
                        (torch.zeros(6, 2, 2), "integer tensor")]:
        with pytest.raises(ValueError, match=needle):
            policy.packed_hidden_routed(ids, cu, replay_experts=rep)


# ---- the real learner ------------------------------------------------------------------------------------
def _hand_load(counts: np.ndarray) -> dict[str, float]:
    load = counts.astype(np.float64)
    frac = load / load.sum()
    nz = frac[frac > 0]
    return {"max_mean_load": load.max() / load.mean(), "load_cv": load.std() / load.mean(),
            "n_dead_experts": float((counts == 0).sum()),
            "load_entropy": float(-(nz * np.log(nz)).sum() / math.log(len(counts)))}


@pytest.mark.parametrize("model, replay", [("top1", True), ("top1", False), ("top2", True),
                                           ("qwen3_next_top1", True), ("qwen3_next_top1", False),
                                           ("qwen3_5_moe_top1", True)],
                         ids=["top1-r3", "top1-free-routing", "top2-r3", "qwen3_next-r3",
                              "qwen3_next-free-routing", "qwen3_5_moe-r3"])
def test_learner_step_on_hf_moe_routes(model, replay, top1_dir, moe_dir, gdn_dirs, tmp_path):
    """The real learner step on HF MoE trajectories that carry routes (once refused: 'expected [T, 0, 0]'),
    after a router change. Top-1 (weights 1 whatever the logits): with replay the learner's log-probs are
    the rollout's (ratio 1, KL 0, <= 1e-4), without replay they differ. Routing agreement (replay: the
    learner's free choice vs the replayed one; free: learner vs rollout) and the expert-load metrics
    (replay: the replayed experts; free: the learner's own choice) equal a hand count."""
    from rl.learner import Learner

    path = {"top1": top1_dir, "top2": moe_dir, **gdn_dirs}[model]
    layers, k = MOE_LAYOUT[model]
    trajs = _rollouts(TorchEngine(HFPolicy.from_pretrained(path), max_batch_size=4, prefill_chunk_size=8))
    learner = Learner(_cfg(tmp_path, path, f"learner.routing_replay={str(replay).lower()}"))
    assert learner.replay is replay and learner.facts.top_k == k
    assert learner.facts.n_moe_layers == len(layers) and learner.policy.moe_layer_indices == layers
    _perturb_routers(learner.policy)
    ids, _, cu, rep = _packed(trajs)
    with torch.no_grad():
        # the routers' own choice inside the learner's forward (replayed: on the replayed layers' outputs)
        _, free = learner.policy.packed_hidden_routed(ids, cu, replay_experts=rep if replay else None,
                                                      return_routed=True)
    same = (free.sort(-1).values == rep.sort(-1).values).all(-1).double().mean(0).numpy()  # [n_moe]
    assert same.min() < 0.9
    m = learner.step(trajs)
    if replay:
        assert m["learner/replay_changed"] == pytest.approx(1.0 - same.mean(), abs=1e-12)
    else:
        assert "learner/replay_changed" not in m
    if k == 1:
        if replay:
            assert abs(m["learner/offpolicy_ratio_mean"] - 1.0) <= PARITY_TOL, m
            assert abs(m["learner/offpolicy_kl"]) <= PARITY_TOL, m
            assert m["learner/offpolicy_ratio_max"] <= 1.0 + PARITY_TOL, m
        else:
            # measured: top1 ratio mean 1.0014, max 1.023 (the replayed run above: within 1e-4 of 1)
            assert abs(m["learner/offpolicy_ratio_mean"] - 1.0) > 1e-3, m
            assert m["learner/offpolicy_ratio_max"] > 1.01, m
    for j, l in enumerate(learner.policy.moe_layer_indices):
        assert m[f"learner/routing_agreement/layer{l}"] == pytest.approx(same[j], abs=1e-12)
        ran = (rep if replay else free)[:, j].reshape(-1).numpy()
        counts = np.bincount(ran, minlength=4)  # 4 experts in every model
        tracked = learner.policy.moe_layers()[j].load_tracker.metrics()
        assert tracked["tokens_per_expert"] == counts.tolist() and tracked["tokens"] == len(ids)
        for key, want in _hand_load(counts).items():
            assert m[f"moe/layer{l}/{key}"] == pytest.approx(want, abs=1e-9), key
    assert m["moe/max_mean_load_max"] == pytest.approx(
        max(m[f"moe/layer{l}/max_mean_load"] for l in learner.policy.moe_layer_indices))
    assert m["grad_norm"] > 0 and np.isfinite(m["loss"])


def test_replay_with_activation_checkpointing_gives_the_same_gradients(moe_dir):
    """Checkpointed layers recompute with the same replayed experts: gradients == without checkpointing,
    and the router gets gradient through the replayed weights."""
    ids = torch.randint(10, V, (20,), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    rep = torch.stack([torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2)])
                       for _ in range(20)])
    grads = []
    for ckpt in (False, True):
        policy = HFPolicy.from_pretrained(moe_dir).train()
        if ckpt:
            policy.gradient_checkpointing_enable()
        h, _ = policy.packed_hidden_routed(ids, cu, replay_experts=rep)
        policy.head_logits(h).float().logsumexp(-1).sum().backward()
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
        load = policy.moe_layers()[0].load_tracker.metrics()
        assert load["tokens"] == 20  # the recomputation recorded nothing
    assert set(grads[0]) == set(grads[1])
    assert float(grads[0]["model.layers.0.mlp.gate.weight"].abs().sum()) > 0  # the router learns
    for k in grads[0]:
        assert (grads[0][k] - grads[1][k]).abs().max() <= 1e-5, k


def test_vllm_rollouts_of_an_hf_moe_need_routing_replay_off(moe_dir, tmp_path):
    """VllmEngine records no routes for an HF model: replay with it is a config error naming both fixes."""
    from rl.config import ConfigError

    with pytest.raises(ConfigError, match="set rollout.engine=torch, or learner.routing_replay=false"):
        _cfg(tmp_path, moe_dir, "rollout.engine=vllm")
    off = _cfg(tmp_path, moe_dir, "rollout.engine=vllm", "learner.routing_replay=false")
    assert off.rollout.engine == "vllm"


# ---- Kimi Linear into Odyssey's own model (model/kimi_import.py) -----------------------------------------
def test_kimi_linear_import_refuses_with_exactly_the_checkpoints_differences(tmp_path, moe_dir):
    """make_kimi_linear (3 KDA layers, 1 MLA with an 8-dim rope slot, 3 MoE layers, SiLU): five differences;
    the same config without the rope slot and with grouped routing: the rope line goes, a routing line
    comes."""
    import json

    from model.kimi_import import import_kimi_linear
    from tests.test_hf_hybrid import make_kimi_linear

    path = make_kimi_linear(tmp_path / "kimi")
    with pytest.raises(ValueError) as e:
        import_kimi_linear(path)
    lines = [ln[2:] for ln in str(e.value).splitlines() if ln.startswith("- ")]
    assert [ln.split(":")[0] for ln in lines] == ["KDA decay gate", "MLA rope slot", "MoE experts",
                                                  "FFN activation", "residual stream"]
    assert "3 KDA layers" in lines[0] and "qk_rope_head_dim=8" in lines[1] and "3 MoE layers" in lines[2]
    assert "5 difference(s)" in str(e.value) and f"model.hf_path={path}" in str(e.value)
    cfg = json.loads((tmp_path / "kimi" / "config.json").read_text())
    cfg.update(qk_rope_head_dim=0, n_group=2, topk_group=1)
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        import_kimi_linear(path)
    heads = [ln[2:].split(":")[0] for ln in str(e.value).splitlines() if ln.startswith("- ")]
    assert heads == ["KDA decay gate", "MoE experts", "MoE routing", "FFN activation", "residual stream"]
    with pytest.raises(ValueError, match="is a 'qwen3_moe' checkpoint, not 'kimi_linear'"):
        import_kimi_linear(moe_dir)
    with pytest.raises(ValueError, match="holds no config.json"):
        import_kimi_linear(tmp_path)
