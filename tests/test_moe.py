"""LatentMoE: dispatch vs dense-loop oracle, router weights, routing replay, bias state, baselines, metrics.

Whole-model MoE tests (tiny preset) live at the end of this file."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import model.moe as moe_mod
from model import fused_cpu
from model.config import OdysseyConfig
from model.expert_load import ExpertLoadTracker
from model.moe import LatentMoE, dense_reference_forward

D, N, K = 32, 8, 2


def make_moe(balancing: str = "quantile", seed: int = 0, **kw) -> LatentMoE:
    torch.manual_seed(seed)
    fields = dict(
        hidden_size=D,
        n_routed_experts=N,
        num_experts_per_tok=K,
        moe_latent_dim=16,
        moe_intermediate_size=24,
        n_shared_experts=1,
        shared_expert_intermediate_size=20,
        balancing=balancing,
        initializer_range=0.2,
    )
    fields.update(kw)
    return LatentMoE(OdysseyConfig(**fields), layer_idx=1)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def random_replay(T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("padded", [True, False])
def test_dispatch_matches_dense_loop_forward_and_backward(replay: bool, padded: bool, monkeypatch):
    """fp32, tolerance atol 1e-5 / rtol 1e-5 on outputs and on every parameter and input gradient; both
    dispatch forms: all experts as one zero-padded batched block, and one matmul pair per expert segment."""
    monkeypatch.setattr(moe_mod, "_PADDED_WASTE", 1e9 if padded else 0.0)
    moe = make_moe()
    moe.bias.copy_(torch.randn(N) * 0.1)  # a non-zero b must route identically in both paths
    x = torch.randn(96, D, requires_grad=True)
    rep = random_replay(96) if replay else None
    ct = torch.randn(96, D)

    y, idx = moe(x, rep)
    (y * ct).sum().backward()
    g_fast, gx_fast = grads(moe), x.grad.clone()
    moe.zero_grad()
    x.grad = None
    y_ref, idx_ref = dense_reference_forward(moe, x, rep)
    (y_ref * ct).sum().backward()
    g_ref = grads(moe)

    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx_fast, x.grad, atol=1e-5, rtol=1e-5)
    assert g_fast.keys() == g_ref.keys() and "router.weight" in g_fast and "w_gate_up" in g_fast
    for name in g_ref:
        torch.testing.assert_close(g_fast[name], g_ref[name], atol=1e-5, rtol=1e-5, msg=name)


class _CountingKernels:
    """Wraps the fused CPU kernels and counts moe_small calls (to check which path ran)."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, 0

    def moe_small(self, *args):
        self.calls += 1
        return self.kernels.moe_small(*args)

    def __getattr__(self, name):
        return getattr(self.kernels, name)


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("replay", [False, True])
def test_fused_small_batch_forward_matches_dense_loop(T, replay, monkeypatch):
    """Without autograd a few tokens (<= 4 pairs per expert) take `forward_small`: one matmul for router,
    W_down and the shared expert, ONE fused call for routing, experts, latent norm and shared activation
    (model/fused_cpu.cpp `moe_small`), one matmul for W_up and the shared W_down. Equal to the dense-loop
    oracle, atol 1e-6 (fp32), same experts, and to the torch path (kernels off); the fused call is really
    taken, and not with autograd or for larger batches."""
    kernels = fused_cpu.load()
    assert kernels is not None, "model/fused_cpu.cpp did not build"
    counting = _CountingKernels(kernels)
    monkeypatch.setattr(fused_cpu, "load", lambda: counting if fused_cpu.enabled() else None)
    moe = make_moe(seed=T)
    moe.bias.copy_(torch.randn(N) * 0.1)
    x = torch.randn(T, D)
    rep = random_replay(T, seed=T) if replay else None
    with torch.no_grad():
        y, idx = moe(x, rep)
        assert counting.calls == 1
        y_ref, idx_ref = dense_reference_forward(moe, x, rep)
        monkeypatch.setenv("ODYSSEY_FUSED_CPU_KERNEL", "0")
        y_torch, _ = moe(x, rep)
        monkeypatch.delenv("ODYSSEY_FUSED_CPU_KERNEL")
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, y_torch, atol=1e-6, rtol=1e-5)
    if not replay:  # the routing kernel: the router's scores, experts (in its order) and weights
        s, i, p = kernels.moe_route(x @ moe.router.weight.t(), moe.bias, torch.empty(0, dtype=torch.long), K,
                                    2.5)
        s_ref, i_ref, p_ref = moe.router(x)
        torch.testing.assert_close(s, s_ref, atol=1e-7, rtol=1e-6)
        assert torch.equal(i, i_ref)
        torch.testing.assert_close(p, p_ref * 2.5, atol=1e-7, rtol=1e-6)
    moe(x.requires_grad_(), rep)[0].sum().backward()  # autograd: the torch dispatch
    with torch.no_grad():
        moe(torch.randn(5 * N, D))  # 10 pairs per expert: the torch dispatch
    assert counting.calls == 1


def test_batched_leading_dims_and_empty_input():
    moe = make_moe()
    x = torch.randn(3, 5, D)
    y, idx = moe(x)
    y2, idx2 = moe(x.reshape(15, D))
    assert y.shape == (3, 5, D) and idx.shape == (3, 5, K)
    torch.testing.assert_close(y.reshape(15, D), y2, atol=0, rtol=0)
    y0, idx0 = moe(torch.randn(0, D))
    assert y0.shape == (0, D) and idx0.shape == (0, K)


def test_weights_are_renormalised_unbiased_scores_and_ignore_bias():
    """p = rsf * s_T / sum_T s (exact), and p over a fixed set does not depend on b."""
    moe = make_moe(routed_scaling_factor=2.5)
    x = torch.randn(40, D)
    s, idx, p = moe.router(x)
    ref = s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(p, ref, atol=0, rtol=0)
    moe.bias.copy_(torch.randn(N))  # big bias: changes the choice
    s2, idx2, p2 = moe.router(x)
    assert not torch.equal(idx, idx2)
    torch.testing.assert_close(p2, s2.gather(1, idx2) / s2.gather(1, idx2).sum(-1, keepdim=True) * 2.5)
    _, _, p_same_set = moe.router(x, idx)  # same set as before, new bias: identical weights
    torch.testing.assert_close(p_same_set, p, atol=0, rtol=0)
    # the selection itself is topk(s + b)
    assert torch.equal(idx2, (s2 + moe.bias).topk(K, dim=-1).indices)


def test_replay_of_own_choice_equals_free_forward():
    moe = make_moe()
    x = torch.randn(64, D)
    y, idx = moe(x)
    y_rep, idx_rep = moe(x, idx.to(torch.int16))  # the rollout engine stores narrow ints
    assert torch.equal(idx, idx_rep)
    torch.testing.assert_close(y_rep, y, atol=0, rtol=0)


def test_forced_experts_are_exactly_used_per_token_and_router_gets_gradient():
    moe = make_moe()
    T = 12
    x = torch.randn(T, D)
    free_idx = moe(x)[1]
    rep = random_replay(T, seed=3)
    assert not torch.equal(rep.sort(-1).values, free_idx.sort(-1).values)
    y, idx = moe(x, rep)
    assert torch.equal(idx, rep)
    (y**2).sum().backward()
    g = moe.router.weight.grad
    assert g is not None and g.abs().sum() > 0
    # gradient reaches only the router rows of the forced experts
    used = torch.zeros(N, dtype=torch.bool)
    used[rep.unique()] = True
    assert (g[used].abs().sum(-1) > 0).all() and (g[~used] == 0).all()

    with torch.no_grad():
        y_det = moe(x, rep)[0]
        for i in range(T):  # poison every expert except token i's forced ones: output stays the same
            poisoned = make_moe()
            poisoned.load_state_dict(moe.state_dict())
            others = torch.ones(N, dtype=torch.bool)
            others[rep[i]] = False
            poisoned.w_gate_up[others] = float("nan")
            poisoned.w_down_experts[others] = float("nan")
            y_i, idx_i = poisoned(x[i : i + 1], rep[i : i + 1])
            assert torch.equal(idx_i[0], rep[i])
            torch.testing.assert_close(y_i[0], y_det[i], atol=1e-6, rtol=1e-6)


def test_replay_input_errors_are_clear():
    moe = make_moe()
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"shape \[T, k\]"):
        moe(x, torch.zeros(4, K + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        moe(x, torch.full((4, K), N, dtype=torch.long))
    with pytest.raises(ValueError, match="repeats an expert"):
        moe(x, torch.zeros(4, K, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        moe(x, torch.zeros(4, K))
    with pytest.raises(ValueError, match="balancing"):
        LatentMoE(
            type(
                "C",
                (),
                dict(
                    hidden_size=D,
                    n_routed_experts=N,
                    num_experts_per_tok=K,
                    moe_latent_dim=8,
                    moe_intermediate_size=8,
                    balancing="magic",
                ),
            )()
        )


def test_bias_in_state_dict_fp32_and_frozen_in_eval():
    moe = make_moe()
    assert "router.e_score_correction_bias" in moe.state_dict()
    assert "router.e_score_correction_bias" not in dict(moe.named_parameters())
    x = torch.randn(64, D) + 1.0
    moe.eval()
    moe(x)
    moe.update_bias()
    assert torch.equal(moe.bias, torch.zeros(N)), "eval forwards/updates must not move b"
    moe.train()
    moe(x)
    assert torch.equal(moe.bias, torch.zeros(N)), "b changes only in update_bias()"
    moe.update_bias()
    assert moe.bias.abs().sum() > 0 and abs(float(moe.bias.mean())) < 1e-6
    restored = make_moe(seed=5)
    restored.load_state_dict(moe.state_dict())
    assert torch.equal(restored.bias, moe.bias)
    assert moe.to(torch.bfloat16).bias.dtype == torch.float32


def test_new_bias_applies_from_next_step():
    """The forward after update_bias() routes with topk(s + b_new); micro-batches of one step pool."""
    moe = make_moe()
    x = torch.randn(128, D) + 0.5
    idx_before = moe(x[:64])[1]
    moe(x[64:])
    moe.update_bias()
    s = moe.router.scores(x)
    idx_after = moe(x)[1]
    assert torch.equal(idx_after, (s + moe.bias).topk(K, dim=-1).indices)
    assert not torch.equal(idx_after[:64], idx_before)
    one_batch = make_moe()
    one_batch(x)
    one_batch.update_bias()
    torch.testing.assert_close(one_batch.bias, moe.bias, atol=1e-7, rtol=0)


def test_bias_sign_rule():
    """b_j += gamma * sign(mean_load - load_j) from the router's own choices, applied after the step."""
    gamma = 0.01
    moe = make_moe("bias_sign", bias_update_speed=gamma)
    x = torch.randn(200, D)
    idx = moe(x)[1]
    load = torch.bincount(idx.flatten(), minlength=N).double()
    moe.update_bias()
    torch.testing.assert_close(moe.bias, (gamma * torch.sign(load.mean() - load)).float())
    assert moe.aux_loss is None
    # repeated steps on a skewed batch reduce the imbalance
    moe = make_moe("bias_sign", bias_update_speed=0.02)
    x = torch.randn(512, D) + torch.randn(D)
    ratio = []
    for _ in range(60):
        with torch.no_grad():
            moe(x)
        ratio.append(moe.load_metrics()["max_mean_load"])
        moe.update_bias()
    assert ratio[-1] < ratio[0] - 0.3 and ratio[-1] < 1.3, ratio


def test_aux_loss_formula_gradient_and_effect():
    """L = coef * sum_j f_j P_j, f_j = n/(kT) load_j, P_j = mean_i s_ij / sum_l s_il; SGD on L balances."""
    coef = 0.05
    moe = make_moe("aux_loss", aux_loss_coef=coef)
    x = torch.randn(300, D) + torch.randn(D)
    y, idx = moe(x)
    s = moe.router.scores(x)
    f = torch.bincount(idx.flatten(), minlength=N).float() * N / (K * 300)
    P = (s / s.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(moe.aux_loss, coef * (f * P).sum())
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    moe.update_bias()
    assert torch.equal(moe.bias, torch.zeros(N)), "aux_loss never touches b"
    opt = torch.optim.SGD(moe.router.parameters(), lr=20.0)
    first = None
    for _ in range(80):
        opt.zero_grad()
        moe(x)
        first = first or moe.load_metrics()["max_mean_load"]
        moe.aux_loss.backward()
        opt.step()
        moe.update_bias()
    moe(x)
    assert moe.load_metrics()["max_mean_load"] < first - 0.2
    quantile = make_moe()
    quantile(x)
    assert quantile.aux_loss is None


def test_load_metrics_values_and_dead_window():
    """Hand-checked metrics on forced routing: loads [4, 2, 2, 0, 0, 0, 0, 0] (x2 for k=2)."""
    moe = make_moe()
    moe.load_tracker = ExpertLoadTracker(N, K, window=3)  # config: moe_load_window (default 100)
    assert moe.load_metrics() == {}
    rep = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 2]])
    moe(torch.randn(4, D), rep)
    m = moe.load_metrics()
    load = torch.tensor([4, 2, 2, 0, 0, 0, 0, 0], dtype=torch.float64)
    assert m["tokens_per_expert"] == load.long().tolist() and m["tokens"] == 4
    assert m["max_mean_load"] == pytest.approx(4 / 1.0)
    assert m["load_cv"] == pytest.approx(float(load.std(unbiased=False) / load.mean()))
    frac = torch.tensor([0.5, 0.25, 0.25])
    assert m["load_entropy"] == pytest.approx(float(-(frac * frac.log()).sum()) / math.log(N))
    assert 0 < m["weight_entropy"] <= math.log(K) + 1e-6
    assert m["dead_experts"] == [3, 4, 5, 6, 7] and m["n_dead_experts"] == 5
    moe.update_bias()  # closes the step: metrics stay those of the last closed step
    assert moe.load_metrics()["tokens_per_expert"] == m["tokens_per_expert"]
    for _ in range(2):  # two steps that use experts 3, 4: window = [step 1, step 2, step 3]
        moe(torch.randn(1, D), torch.tensor([[3, 4]]))
        moe.update_bias()
    assert moe.load_metrics()["dead_experts"] == [5, 6, 7]
    moe(torch.randn(1, D), torch.tensor([[3, 4]]))  # step 1 leaves the 3-step window:
    moe.update_bias()  # experts 0, 1, 2 are now dead
    assert moe.load_metrics()["dead_experts"] == [0, 1, 2, 5, 6, 7]


# ---- whole model (tiny preset) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from model.modeling import OdysseyForCausalLM

    torch.manual_seed(0)
    model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (40,))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    return model, ids, cu


def test_tiny_preset_has_latent_moe_in_all_layers_but_the_first(tiny):
    model, _, _ = tiny
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, LatentMoE)
    assert all(isinstance(layer.mlp, LatentMoE) for layer in layers[1:])
    assert model.moe_layer_indices == list(range(1, len(layers)))


def test_model_replay_of_routed_experts_gives_identical_logits(tiny):
    model, ids, cu = tiny
    with torch.no_grad():
        out = model(ids, cu_seqlens=cu, return_routed_experts=True)
        k = model.config.num_experts_per_tok
        assert out.routed_experts.shape == (40, len(model.moe_layer_indices), k)
        stored = out.routed_experts.to(torch.int32)  # Trajectory stores them as narrow ints (uint16 in numpy)
        rep = model(ids, cu_seqlens=cu, replay_experts=stored, return_routed_experts=True)
    assert torch.equal(rep.routed_experts, out.routed_experts)
    torch.testing.assert_close(rep.logits, out.logits, atol=0, rtol=0)


def test_model_forced_replay_uses_exactly_those_experts(tiny):
    """Force experts (3, 7) everywhere, then poison every other expert of every MoE layer with NaN:
    logits stay finite and equal (tolerance 0) to the unpoisoned forced run."""
    model, ids, cu = tiny
    n_moe, k = len(model.moe_layer_indices), model.config.num_experts_per_tok
    forced = torch.tensor([3, 7]).expand(40, n_moe, k).contiguous()
    poisoned = copy.deepcopy(model)
    keep = torch.zeros(model.config.n_routed_experts, dtype=torch.bool)
    keep[[3, 7]] = True
    with torch.no_grad():
        for moe in poisoned.moe_layers():
            moe.w_gate_up[~keep] = float("nan")
            moe.w_down_experts[~keep] = float("nan")
        want = model(ids, cu_seqlens=cu, replay_experts=forced, return_routed_experts=True)
        got = poisoned(ids, cu_seqlens=cu, replay_experts=forced)
    assert torch.equal(want.routed_experts, forced)
    assert torch.isfinite(got.logits).all()
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)


def test_model_replay_router_gradient_and_bias_updates_only_in_train_mode(tiny):
    model = copy.deepcopy(tiny[0])
    _, ids, cu = tiny
    n_moe, k = len(model.moe_layer_indices), model.config.num_experts_per_tok
    forced = torch.stack([torch.randperm(model.config.n_routed_experts)[:k] for _ in range(40 * n_moe)])
    forced = forced.reshape(40, n_moe, k)
    biases = [m.bias.clone() for m in model.moe_layers()]
    model(ids, cu_seqlens=cu)  # eval forward
    model.update_router_biases()
    assert all(torch.equal(m.bias, b) for m, b in zip(model.moe_layers(), biases))

    model.train()
    out = model(ids, cu_seqlens=cu, replay_experts=forced)
    out.logits.float().pow(2).mean().backward()
    for moe in model.moe_layers():
        assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert all(torch.equal(m.bias, b) for m, b in zip(model.moe_layers(), biases)), "not before the update"
    model.update_router_biases()
    assert all(not torch.equal(m.bias, b) for m, b in zip(model.moe_layers(), biases))
    assert all(abs(float(m.bias.mean())) < 1e-6 for m in model.moe_layers())


def test_model_expert_load_metrics_per_layer(tiny):
    model, ids, cu = tiny
    with torch.no_grad():
        model(ids, cu_seqlens=cu)
    metrics = model.expert_load_metrics()
    k = model.config.num_experts_per_tok
    for l in model.moe_layer_indices:
        counts = metrics[f"moe/layer{l}/tokens_per_expert"]
        assert len(counts) == model.config.n_routed_experts and sum(counts) >= 40 * k
        assert metrics[f"moe/layer{l}/max_mean_load"] >= 1.0
    assert metrics["moe/max_mean_load_max"] == max(
        metrics[f"moe/layer{l}/max_mean_load"] for l in model.moe_layer_indices
    )


def test_statistics_state_is_never_on_meta_after_from_pretrained(tmp_path):
    """Regression: from_pretrained builds modules under a meta-device context; the expert-load counts and the
    sign rule's counts are plain tensors (not buffers), so they stayed on meta and the first update_bias of
    a model loaded with model.init_from failed under torch.distributed (the learner's all_reduce)."""
    from model.balancing import SignStats
    from model.modeling import OdysseyForCausalLM

    cfg = OdysseyConfig.from_preset("tiny", num_hidden_layers=2, n_routed_experts=4)
    OdysseyForCausalLM(cfg).save_pretrained(tmp_path)
    loaded = OdysseyForCausalLM.from_pretrained(str(tmp_path))
    trackers = [m.load_tracker for m in loaded.modules() if isinstance(m, LatentMoE)]
    assert trackers and all(t._counts.device.type == "cpu" for t in trackers)
    with torch.device("meta"):
        stats = SignStats(4)
    assert stats.counts.device.type == "cpu"
