"""`odyssey plan` (rl/plan/): the per-rank state bytes against a real learner's, the activation formula
against the bytes autograd really saves (tiny, small and configs the formula's fit never saw), FSDP2's
chunking, and the k3 plan end to end (CLI, JSON). The multi-rank measured comparison (1, 2, 4 gloo ranks) is
bench/scale.py; the placement group is tests/test_learner_placement.py."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import OdysseyConfig
from rl.plan.activations import forward_bytes, window_bytes
from rl.plan.saved import balanced_replay, measure_saved_bytes
from rl.plan.state import chunk_rows, meta_policy, model_shapes, rank_state

# measured: tiny 0.2-1.3 %, small 0.4-4.2 %, unseen random configs <= 2.2 % (the fit's own worst residual)
ACT_REL = 0.06


def test_chunk_rows_is_torch_chunk():
    """FSDP2 shards dim 0 as torch.chunk does: every (rows, ranks) up to 13 x 9 against torch.chunk."""
    for rows in range(0, 14):
        for n in range(1, 10):
            ref = [c.shape[0] for c in torch.arange(rows).chunk(n)] if rows else []
            ref += [0] * (n - len(ref))
            assert [chunk_rows(rows, n, r) for r in range(n)] == ref, (rows, n)


def test_sharded_state_adds_up_and_ep_keeps_the_total():
    """Over the ranks the shards hold every parameter once, with and without expert parallelism."""
    cfg = OdysseyConfig.from_preset("tiny")
    shapes = model_shapes(meta_policy(cfg))
    numel = sum(p.numel() for p in meta_policy(cfg).parameters())
    one = rank_state(cfg, 1, shapes=shapes)
    assert one.params == 4 * numel and one.grads == one.params
    assert one.optimizer == 8 * numel + 4 * len(shapes.params)
    for W, ep in ((2, 1), (4, 1), (4, 2), (4, 4), (8, 8)):
        total = sum(rank_state(cfg, W, ep, rank=r, shapes=shapes).params for r in range(W))
        assert total == 4 * numel, (W, ep)
    with pytest.raises(ValueError, match="must divide the 16 routed experts"):
        rank_state(cfg, 6, ep=6, shapes=shapes)


def test_unsharded_prediction_equals_a_real_learner():
    """One real Learner (tiny, GRPO) after a step: its parameter, gradient and AdamW bytes equal the
    meta-model prediction (the multi-rank FSDP runs: bench/scale.py)."""
    from rl.config import RunConfig
    from rl.learner import Learner
    from tests.learner_fixtures import ragged_batch

    # text only: an unsharded learner's unused vision parameters get no gradient and no AdamW state (FSDP
    # reduce-scatters zeros for them, so every FSDP rank holds them: bench/scale.py runs the vision tower too)
    cfg = RunConfig.model_validate({"model": {"overrides": {"vision_patch_size": 0}},
                                    "learner": {"group_size": 4, "micro_batch_tokens": 80,
                                                "routing_replay": False}})
    learner = Learner(cfg)
    learner.step(ragged_batch(seed=3, routed=False))
    measured = learner.memory_bytes()
    predicted = rank_state(OdysseyConfig.from_preset("tiny", vision_patch_size=0), 1, param_bytes=4)
    print("measured", measured, "predicted", predicted.to_dict())
    for part in ("params", "grads", "optimizer"):
        assert measured[part] == getattr(predicted, part), part


@pytest.mark.parametrize("name,tokens", [("tiny", 128), ("tiny", 320), ("small", 128)])
def test_activation_formula_matches_saved_bytes_of_presets(name, tokens):
    cfg = OdysseyConfig.from_preset(name, vision_patch_size=0)
    m = measure_saved_bytes(cfg, tokens, torch.bfloat16)
    measured = sum(sum(p.values()) for p in m.per_layer)
    predicted = forward_bytes(cfg, tokens)
    print(f"{name} T={tokens}: measured {measured}, predicted {predicted}, ratio {predicted / measured:.4f}")
    assert predicted == pytest.approx(measured, rel=ACT_REL)


@pytest.mark.parametrize("seed", [101, 202])
def test_activation_formula_on_configs_the_fit_never_saw(seed):
    """Random shapes from other ranges than the fit's (wider heads, more layers, block size 4)."""
    g = torch.Generator().manual_seed(seed)

    def pick(*xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    cfg = OdysseyConfig.from_preset(
        "tiny", hidden_size=pick(80, 112, 144), kda_num_heads=pick(2, 5), kda_head_dim=pick(40, 56),
        mla_num_heads=pick(3, 6), mla_head_dim=pick(40, 56), mla_kv_lora_rank=pick(48, 80),
        mla_q_lora_rank=pick(0, 64), n_routed_experts=pick(8, 16), num_experts_per_tok=pick(2, 4),
        moe_latent_dim=pick(48, 80), moe_intermediate_size=pick(48, 80), n_shared_experts=pick(1, 2),
        shared_expert_intermediate_size=pick(96, 160), intermediate_size=pick(192, 320), vocab_size=512,
        vision_patch_size=0, num_hidden_layers=6, attn_res_block_size=4)
    m = measure_saved_bytes(cfg, 192, torch.bfloat16)
    measured = sum(sum(p.values()) for p in m.per_layer)
    predicted = forward_bytes(cfg, 192)
    print(f"seed {seed}: measured {measured}, predicted {predicted}, ratio {predicted / measured:.4f}")
    assert predicted == pytest.approx(measured, rel=ACT_REL)


def test_balanced_replay_loads_every_expert_equally():
    cfg = OdysseyConfig.from_preset("tiny")
    r = balanced_replay(cfg, 64)
    assert r.shape == (64, len(cfg.moe_layer_indices), cfg.num_experts_per_tok)
    counts = torch.bincount(r[:, 0].reshape(-1), minlength=cfg.n_routed_experts)
    assert (counts == 64 * cfg.num_experts_per_tok // cfg.n_routed_experts).all()
    assert all(len(set(row.tolist())) == cfg.num_experts_per_tok for row in r[:, 0])


def test_window_bytes_grow_with_the_trajectory_only_where_they_should():
    """Doubling the trajectory at a fixed window doubles the MLA latents and prefix K/V and adds KDA states,
    leaves one layer's window activations unchanged."""
    cfg = OdysseyConfig.from_preset("small")
    a, b = window_bytes(cfg, 1 << 16, 4096), window_bytes(cfg, 1 << 17, 4096)
    assert a.layer == b.layer and a.stream == b.stream and a.head == b.head
    assert b.mla_prefix == 2 * a.mla_prefix
    assert b.carried > 2 * a.carried * 0.99


def test_k3_plan_json(capsys):
    """The k3 plan from the CLI: JSON with the learner's per-rank breakdown under the GPU's usable memory, at
    192K-token trajectories (1M: tests/test_plan_context_parallel.py). With the MLA prefix attended in
    blocks, context parallelism (512 ranks, cp 256) needs fewer ranks than windows (896)."""
    from rl.plan.cli import cli_main

    argv = ["--preset", "k3", "--gpu", "h200", "--gpus", "2048", "--context", "196608", "--json"]
    assert cli_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    lr, ro = plan["learner"], plan["rollout"]
    assert 2.7e12 < plan["model"]["total_params"] < 2.9e12
    assert 1.0e11 < plan["model"]["active_params"] < 1.1e11
    assert lr["fits"] and lr["total"] <= plan["cluster"]["usable_bytes"]
    assert lr["total"] == lr["params"] + lr["grads"] + lr["optimizer"] + lr["gather"] + lr["activations"]
    assert lr["ranks"] % lr["cp"] == 0 and lr["ranks"] % lr["ep"] == 0 and 896 % lr["ep"] == 0
    assert (lr["ranks"], lr["ep"], lr["cp"], lr["layout"]) == (512, 128, 256, "checkpointed context-parallel "
                                                                "shards")
    assert ro["fits"] and ro["weights"] + ro["cache_per_sequence"] <= plan["cluster"]["usable_bytes"]
    # 6 * active * tokens is most of the learner's FLOPs
    assert plan["step"]["train_flops"] > 6 * plan["model"]["active_params"] * plan["step"]["tokens"]


def test_bad_input_is_named():
    from rl.plan import Workload
    from rl.plan.cli import cli_main

    with pytest.raises(ValueError, match="multiple of group_size"):
        Workload(episodes=10, group_size=4)
    assert cli_main(["--preset", "tiny", "--ep", "3"]) == 2
