"""The sharded learner (learner.sharding=fsdp, rl/learner/fsdp.py) on a real Ray cluster: N FSDP2 ranks equal
one unsharded rank on the same global batches, after 1 and after 3 policy steps (weights, loss, grad norm),
a resume from a checkpoint equals the uninterrupted run, and each rank holds about 1/N of the parameter,
gradient and AdamW bytes. For Odyssey's model (MoE with the quantile balancer's router biases and routing
replay) and for an HF Llama; with learner.lora on the HF Llama, 2 ranks equal an unsharded LoRA learner
(adapters, untouched base, merged weight sync, resume).

The backend is gloo on CPU; ODYSSEY_TEST_BACKEND=nccl (tests/dist_backend.py, bench/gpu_sharding.sh) runs the
same tests with one GPU per rank; a test with more ranks than GPUs is skipped, saying so.
"""

from __future__ import annotations

import pytest
import torch

from rl.learner import Learner
from tests.dist_backend import GPUS_PER_RANK, require_ranks
from tests.learner_fixtures import ragged_batch, small_config

# fp32: FSDP reduce-scatters every micro-batch's gradient (the single rank sums them in one buffer), so the
# sums run in another order; Adam's normalised update carries that into the weights, most where a gradient is
# near zero (rarely hit embedding rows of the HF Llama's 4096-token vocabulary). Measured (weights, rel to how
# far they moved): Odyssey <= 6.7e-6, HF Llama <= 1.2e-4 (4 ranks, 3 steps). A fault (a missing reduction, a
# wrong scale, a stale shard) moves them by > 1e-2.
REL = {"odyssey": 1e-4, "hf": 5e-4}
METRIC_REL = 1e-5
# the grad norm is summed from each rank's shard of per-micro-batch reduce-scattered fp32 gradients (measured
# <= 1.5e-6 rel on Odyssey's model, 1.3e-5 on the HF Llama)
GRAD_NORM_REL = 1e-4
BYTES_REL = 0.10  # per-rank bytes within 10% of the unsharded total / N (FSDP pads dim 0 to N rows)


def _flat(sd: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([sd[k].reshape(-1).double() for k in keys])


def _group(cfg):
    from rl.learner.group import LearnerGroup

    require_ranks(cfg.learner.num_ranks)
    return LearnerGroup(cfg, torch_threads=1, num_gpus=GPUS_PER_RANK)


def _run(cfg, batches: list, tmp_path):
    """One unsharded rank and an FSDP LearnerGroup on the same batches, the group checkpointed after the first
    and resumed in a fresh group for the rest. Returns per step (single state, single metrics, group state,
    group metrics), the resumed group's final state, (single bytes, per-rank bytes)."""
    single = Learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"num_ranks": 1, "sharding": "none"})}))
    init = {k: v.clone() for k, v in single.policy.state_dict().items()}
    steps = []
    group = _group(cfg)
    try:
        g_init = group.state_dict()
        for j, b in enumerate(batches):
            m1 = single.step(b)
            m2 = group.step(b)
            sd1 = {k: v.detach().clone() for k, v in single.policy.state_dict().items()}
            steps.append((sd1, m1, group.state_dict(), m2))
            if j == 0:
                group.save(tmp_path / "ckpt")
        sharded_bytes = group.memory_bytes()
    finally:
        group.shutdown()
    resumed = _group(cfg)
    try:
        resumed.load(tmp_path / "ckpt")
        for b in batches[1:]:
            resumed.step(b)
        final = resumed.state_dict()
    finally:
        resumed.shutdown()
    return init, g_init, steps, final, (single.memory_bytes(), sharded_bytes)


def _check(init, g_init, steps, final, memory, n_ranks: int, metric_keys, model: str) -> None:
    """The oracle (module docstring) with the tolerances above; model: "odyssey" | "hf" (REL's key)."""
    keys = list(init)
    assert set(g_init) == set(keys)
    assert torch.equal(_flat(g_init, keys), _flat(init, keys).to(_flat(g_init, keys).dtype))
    a0 = _flat(init, keys)
    for i, (sd1, m1, sd2, m2) in enumerate(steps):
        if i not in (0, len(steps) - 1):
            continue
        a, b = _flat(sd1, keys), _flat(sd2, keys)
        moved = float((a - a0).norm())
        assert moved > 0
        rel = float((b - a).norm()) / moved
        print(f"step {i + 1}: weights rel {rel:.2e}, loss rel {abs(m2['loss'] / m1['loss'] - 1):.2e}, "
              f"grad_norm rel {abs(m2['grad_norm'] / m1['grad_norm'] - 1):.2e}")
        assert rel <= REL[model], (i, rel)
        for k in keys:
            if k.endswith("e_score_correction_bias"):  # the balancer saw the whole step on every rank
                assert torch.allclose(sd1[k], sd2[k], atol=1e-6), k
        for key in metric_keys:
            tol = GRAD_NORM_REL if key == "grad_norm" else METRIC_REL
            assert m2[key] == pytest.approx(m1[key], rel=tol, abs=1e-9), (i, key)
    last = steps[-1][2]  # the resumed group continued exactly where the uninterrupted one went
    assert float((_flat(final, keys) - _flat(last, keys)).norm()) <= 1e-6 * float(_flat(last, keys).norm())
    single, per_rank = memory
    print(f"bytes: unsharded {single}, per rank {per_rank}")
    assert len(per_rank) == n_ranks
    for part in ("params", "grads", "optimizer"):
        for r, m in enumerate(per_rank):
            assert m[part] == pytest.approx(single[part] / n_ranks, rel=BYTES_REL), (part, r, m, single)


@pytest.mark.ray
@pytest.mark.parametrize("n_ranks", [2, 4])
def test_fsdp_ranks_equal_one_rank_on_odyssey(ray_session, tmp_path, n_ranks):
    """Odyssey's MoE policy (quantile balancer, routing replay), two minibatches per step; the second batch
    leaves some ranks without a sample in a minibatch (they run zero-weighted passes)."""
    cfg = small_config(num_ranks=n_ranks, sharding="fsdp", num_minibatches=2, micro_batch_tokens=80, lr=1e-3)
    batches = [ragged_batch(seed=11), ragged_batch(seed=12, n_groups=1, group_size=3), ragged_batch(seed=13)]
    out = _run(cfg, batches, tmp_path)
    _check(*out, n_ranks, ("loss", "grad_norm", "tokens", "learner/tokens_scored", "learner/entropy",
                           "moe/load_cv_mean"), "odyssey")


@pytest.mark.ray
@pytest.mark.parametrize("n_ranks", [2, 4])
def test_fsdp_ranks_equal_one_rank_on_an_hf_model(ray_session, tmp_path, n_ranks):
    """A random HF Llama (model.hf_path): its decoder layers are the FSDP units."""
    from rl.config import RunConfig
    from tests.test_hf_policy import make_llama

    hf_dir = make_llama(tmp_path / "llama", vocab_size=4096)  # the fixtures' token ids reach 4095
    cfg = RunConfig.model_validate({
        "model": {"hf_path": hf_dir},
        "learner": {"group_size": 4, "num_ranks": n_ranks, "sharding": "fsdp", "num_minibatches": 2,
                    "micro_batch_tokens": 80, "lr": 1e-3}})
    batches = [ragged_batch(seed=s, routed=False) for s in (11, 13)]
    batches.insert(1, ragged_batch(seed=12, n_groups=1, group_size=3, routed=False))
    out = _run(cfg, batches, tmp_path)
    _check(*out, n_ranks, ("loss", "grad_norm", "tokens", "learner/tokens_scored"), "hf")


def test_sharding_config_problems_name_what_exists():
    """ep / fsdp+ep with a rank count that does not divide the experts or on a model without MoE layers are
    refused naming the fix; fsdp+ep with context parallelism and every sharding with sequence chunking are
    accepted."""
    from rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["learner.sharding=fsdp+ep", "learner.num_ranks=3"])
    assert "learner.num_ranks (3) must divide n_routed_experts (16)" in str(e.value)
    assert "[1, 2, 4, 8, 16]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["learner.sharding=ep", "learner.num_ranks=2",
                                          "model.overrides={num_hidden_layers: 2, first_k_dense: 2}"])
    assert "learner.sharding=ep needs MoE layers, and this model has none" in str(e.value)
    # context parallelism combines with every sharding (tests/test_sharded_context_parallel.py)
    cfg = load_config("configs/tiny.yaml", ["learner.sharding=fsdp+ep", "learner.num_ranks=4",
                                            "learner.context_parallel=2"])
    assert cfg.learner.context_parallel == 2
    cfg = load_config("configs/tiny.yaml", ["learner.sharding=fsdp+ep", "learner.num_ranks=4"])
    assert cfg.learner.sharding == "fsdp+ep"
    # every sharding runs with sequence chunking (tests/test_fsdp_chunks.py)
    for sharding in ("fsdp", "ep", "fsdp+ep"):
        cfg = load_config("configs/tiny.yaml", [f"learner.sharding={sharding}", "learner.num_ranks=2",
                                                "learner.sequence_chunk_tokens=1024"])
        assert cfg.learner.sequence_chunk_tokens == 1024
    cfg = load_config("configs/tiny.yaml", ["learner.sharding=fsdp", "learner.num_ranks=2"])
    assert cfg.learner.sharding == "fsdp" and cfg.learner.fsdp_param_dtype == "auto"


# LoRA under FSDP (rl/learner/lora.py): only the adapters train, so their step is compared (rel to how far
# they moved; measured below) and the base weights must not move at all
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "dropout": 0.0}
LORA_REL = 1e-5


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], a0: dict[str, torch.Tensor]) -> float:
    keys = list(a0)
    assert set(a) == set(b) == set(keys)
    return float((_flat(b, keys) - _flat(a, keys)).norm()) / float((_flat(a, keys) - _flat(a0, keys)).norm())


@pytest.mark.ray
def test_lora_under_fsdp_equals_unsharded_lora(ray_session, tmp_path):
    """learner.lora with learner.sharding=fsdp on 2 ranks (frozen base and trainable adapters in the same
    decoder-layer units) against one unsharded LoRA learner, two steps on the HF Llama: after each step the
    adapters (the checkpoint's, gathered whole from the shards) equal the unsharded ones within LORA_REL of
    how far they moved; the base weights are bit for bit the initial ones (every non-adapter entry of the
    synced weights, and each merged weight is exactly its initial base plus s B A of the saved adapters); the
    synced merged weights (`state_dict` and the `weights_ref` bucket stream, several buckets) equal the
    unsharded learner's; a group resumed from the step-1 checkpoint ends where the uninterrupted one did."""
    import ray
    from safetensors.torch import load_file

    from rl.config import RunConfig
    from rl.learner.learner import ADAPTER_FILE
    from rl.learner.lora import adapter_state_dict
    from tests.test_hf_policy import make_llama

    hf_dir = make_llama(tmp_path / "llama", vocab_size=4096)
    cfg = RunConfig.model_validate({
        "model": {"hf_path": hf_dir},
        "learner": {"group_size": 4, "num_ranks": 2, "sharding": "fsdp", "micro_batch_tokens": 80, "lr": 1e-3,
                    "lora": LORA}})
    single = Learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"num_ranks": 1, "sharding": "none"})}))
    base0 = single.state_dict()  # B = 0: the merged weights are the base
    a0 = adapter_state_dict(single.policy)
    scaling = LORA["alpha"] / LORA["rank"]
    batches = [ragged_batch(seed=s, routed=False) for s in (11, 13)]
    group = _group(cfg)
    try:
        assert all(torch.equal(v, base0[k]) for k, v in group.state_dict().items())
        for j, b in enumerate(batches):
            m1, m2 = single.step(b), group.step(b)
            group.save(tmp_path / f"ckpt{j}")
            got = load_file(str(tmp_path / f"ckpt{j}" / ADAPTER_FILE))
            want = adapter_state_dict(single.policy)
            rel = _rel(want, got, a0)
            synced, want_synced = group.state_dict(), single.state_dict()
            buckets = ray.get(group.weights_ref(bucket_bytes=64 << 10))
            streamed = {k: v for bucket in buckets.stream() for k, v in bucket.items()}
            assert len(buckets.refs) > 1 and buckets.names == list(want_synced)
            print(f"step {j + 1}: adapters rel {rel:.2e}, loss {m2['loss']:.6f} vs {m1['loss']:.6f}")
            assert rel <= LORA_REL, (j, rel)
            assert m2["loss"] == pytest.approx(m1["loss"], rel=METRIC_REL)
            assert list(synced) == list(want_synced) == list(base0)
            for k, v in synced.items():
                assert torch.equal(streamed[k], v), k
                owner = k.removesuffix(".weight")
                if f"{owner}.lora_A.default.weight" not in got:  # not a LoRA layer: the base, untouched
                    assert torch.equal(v, base0[k]), k
                    continue
                a, b_ = got[f"{owner}.lora_A.default.weight"], got[f"{owner}.lora_B.default.weight"]
                assert torch.equal(v, base0[k] + (b_ @ a) * scaling), k  # base unchanged, merged as peft
                moved = float((want_synced[k] - base0[k]).norm())
                assert moved > 0 and float((v - want_synced[k]).norm()) <= LORA_REL * moved, k
        final = group.state_dict()
    finally:
        group.shutdown()
    resumed = _group(cfg)
    try:
        resumed.load(tmp_path / "ckpt0")
        resumed.step(batches[1])
        again = resumed.state_dict()
        resumed.save(tmp_path / "ckpt_resumed")
    finally:
        resumed.shutdown()
    keys = list(final)
    assert float((_flat(again, keys) - _flat(final, keys)).norm()) <= 1e-6 * float(_flat(final, keys).norm())
    last, redo = (load_file(str(tmp_path / d / ADAPTER_FILE)) for d in ("ckpt1", "ckpt_resumed"))
    assert _rel(last, redo, a0) <= 1e-6


def test_lora_combines_with_fsdp_but_not_expert_parallelism(tmp_path):
    """learner.lora loads with learner.sharding=fsdp; with ep / fsdp+ep (Odyssey's LatentMoE, which LoRA's HF
    policies lack) it is refused naming learner.sharding=fsdp as the fix."""
    from rl.config import ConfigError, load_config
    from tests.test_hf_policy import make_llama

    hf_dir = make_llama(tmp_path / "llama", vocab_size=4096)
    lora = "learner.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj], dropout: 0.0}"
    cfg = load_config("configs/tiny.yaml", [f"model.hf_path={hf_dir}", "learner.sharding=fsdp",
                                            "learner.num_ranks=2", lora])
    assert cfg.learner.sharding == "fsdp" and cfg.learner.lora.rank == 4
    for sharding in ("ep", "fsdp+ep"):
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny.yaml", [f"model.hf_path={hf_dir}", f"learner.sharding={sharding}",
                                              "learner.num_ranks=2", lora])
        msg = str(e.value)  # an HF policy is refused expert parallelism first; the lora refusal stays too
        assert f"learner.sharding={sharding}" in msg and "set learner.sharding=fsdp" in msg, msg


@pytest.mark.ray
def test_fsdp_bf16_parameters_move_the_step(ray_session, tmp_path):
    """learner.fsdp_param_dtype=bfloat16 (fp32 reduce): the units compute in bf16 after the all-gather, so
    the step differs from the fp32 one (rel > 1e-3) but stays near it (rel < 0.2); bfloat16 reduction too
    moves the loss again. Master weights stay fp32."""
    from rl.config import RunConfig
    from tests.test_hf_policy import make_llama

    hf_dir = make_llama(tmp_path / "llama", vocab_size=4096)
    base = {"group_size": 4, "num_ranks": 2, "sharding": "fsdp", "micro_batch_tokens": 80, "lr": 1e-3}
    batch = ragged_batch(seed=11, routed=False)
    out = {}
    for name, dtypes in (("fp32", {}), ("bf16", {"fsdp_param_dtype": "bfloat16"}),
                         ("bf16_reduce", {"fsdp_param_dtype": "bfloat16", "fsdp_reduce_dtype": "bfloat16"})):
        cfg = RunConfig.model_validate({"model": {"hf_path": hf_dir}, "learner": {**base, **dtypes}})
        group = _group(cfg)
        try:
            init = group.state_dict()
            m = group.step(batch)
            out[name] = (init, m, group.state_dict())
        finally:
            group.shutdown()
    init, m32, sd32 = out["fp32"]
    _, m16, sd16 = out["bf16"]
    keys = list(init)
    assert all(v.dtype == torch.float32 for v in sd16.values())
    moved = float((_flat(sd32, keys) - _flat(init, keys)).norm())
    rel = float((_flat(sd16, keys) - _flat(sd32, keys)).norm()) / moved
    print(f"bf16 params: weights rel {rel:.2e}, loss {m16['loss']:.6f} vs {m32['loss']:.6f}")
    assert 1e-3 < rel < 0.2
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05) and m16["loss"] != m32["loss"]
    assert out["bf16_reduce"][1]["grad_norm"] != m16["grad_norm"]


def test_optimizer_state_load_keeps_stateless_parameters_stateless_and_refuses_a_mismatch(tmp_path):
    """`load_full_optimizer_state_dict` (a one-rank gloo group in this process, torch's full-state-dict path):
    a parameter that never got a gradient (no AdamW state, as DDP leaves an unused vision patch embedding
    under ep) stays without state after the load, the others get the saved moments exactly; a checkpoint whose
    names match no parameter is refused naming the problem."""
    import torch.distributed as dist
    from torch import nn

    from rl.learner.fsdp import full_optimizer_state_dict, load_full_optimizer_state_dict

    def build():
        return nn.ModuleDict({"a": nn.Linear(3, 2), "unused": nn.Linear(2, 2)})

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = build()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m["a"](torch.randn(4, 3)).sum().backward()
        opt.step()
        saved = full_optimizer_state_dict(m, opt)
        assert sorted(saved["state"]) == ["a.bias", "a.weight"]
        m2 = build()
        opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
        load_full_optimizer_state_dict(m2, opt2, saved)
        assert set(opt2.state) == {m2["a"].weight, m2["a"].bias}  # "unused" stays stateless
        for name in ("weight", "bias"):
            want, got = opt.state[getattr(m["a"], name)], opt2.state[getattr(m2["a"], name)]
            assert all(torch.equal(got[k], want[k]) for k in want)
        renamed = {**saved, "state": {f"x.{k}": v for k, v in saved["state"].items()}}
        m3 = build()
        with pytest.raises(ValueError, match=r"does not match this learner's parameters \(not loaded: "):
            load_full_optimizer_state_dict(m3, torch.optim.AdamW(m3.parameters()), renamed)
    finally:
        dist.destroy_process_group()
