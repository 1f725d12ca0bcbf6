"""Expert parallelism (model/expert_parallel.py; learner.sharding=ep / fsdp+ep): the oracle is one process
with every expert. N real processes (torch.distributed, gloo, spawned by torch.multiprocessing) each hold E/N
experts and their own share of the tokens; the tokens travel to the experts' ranks by all_to_all and back.

Layer level (a LatentMoE with 8 experts, top-2, one shared expert): EP=2 and EP=4 equal EP=1 on the forward
(outputs, routing), on the backward (input gradients; the replicated parameters' gradients summed over ranks;
the expert weights' gradients, gathered from their shards), with and without routing replay, on uneven shares
(one rank with no token at all); the quantile balancer's new bias and the expert-load metrics equal the single
process's; each rank stores 1/N of the expert bytes. Learner level: a whole learner step (fp32, the SMALL
3-MoE-layer policy of tests/learner_fixtures.py, two minibatches, routing replay) with learner.sharding=ep and
fsdp+ep on 2 and 4 ranks (and fsdp+ep with activation checkpointing on 2) equals the unsharded learner:
weights, loss, grad norm, router biases, moe/ metrics. In the same ranks: the bucketed weight sync
(`Learner.weight_buckets`, what `LearnerGroup.weights_ref` streams for every sharded layout) concatenates to
the full gather bit for bit, and a fresh learner loaded from the checkpoint written after step 1 ends step 2
exactly where the uninterrupted learner did.

Backend: gloo on CPU; ODYSSEY_TEST_BACKEND=nccl runs the same code on cuda:rank (tests/dist_backend.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from model.expert_parallel import expert_parameters, shard_experts
from tests.dist_backend import init_rank, require_ranks
from tests.test_moe import N, grads, make_moe, random_replay

T_ALL = 96
# tokens per rank (sums to T_ALL): uneven, and at 4 ranks one rank routes nothing at all
SHARES = {2: [40, 56], 4: [30, 0, 25, 41]}
# fp32: the same matmuls per expert segment, only grouped differently; sums of gradients over ranks differ in
# order (measured rel <= 3e-7); a lost or doubled pair moves a value by > 1e-2
REL = 1e-5


def _init(rank: int, world: int, init: str) -> torch.device:
    return init_rank(rank, world, init)


def _inputs(device: torch.device | str = "cpu"):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T_ALL, 32, generator=g)
    ct = torch.randn(T_ALL, 32, generator=g)
    return x.to(device), ct.to(device), random_replay(T_ALL, seed=5).to(device)


def _layer_rank(rank: int, world: int, init: str, out: str) -> None:
    device = _init(rank, world, init)
    try:
        results = {}
        for replay in (False, True):
            moe = make_moe().to(device)
            moe.bias.copy_(torch.linspace(-0.05, 0.05, N))
            shard_experts(moe, mean_grads=False)
            x_all, ct_all, rep_all = _inputs(device)
            a = sum(SHARES[world][:rank])
            b = a + SHARES[world][rank]
            x = x_all[a:b].clone().requires_grad_(True)
            y, idx = moe(x, rep_all[a:b] if replay else None)
            (y * ct_all[a:b]).sum().backward()
            g = {}
            for name, p in sorted(moe.named_parameters()):
                if isinstance(p.grad, DTensor):  # an expert weight: gather every rank's shard
                    g[name] = p.grad.full_tensor()
                else:  # replicated: each rank has its tokens' part
                    g[name] = p.grad.clone()
                    dist.all_reduce(g[name])
            nbytes = sum(w.to_local().numel() * w.to_local().element_size() for w in expert_parameters(moe))
            moe.update_bias()
            results[replay] = {"y": y.detach().cpu(), "idx": idx.cpu(), "dx": x.grad.cpu(),
                               "g": {k: v.cpu() for k, v in g.items()}, "bias": moe.bias.cpu(),
                               "metrics": moe.load_metrics(), "bytes": nbytes}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, tmp_path, *args) -> list[dict]:
    require_ranks(world)
    init = str(tmp_path / "rendezvous")
    mp.start_processes(fn, args=(world, init, str(tmp_path), *args), nprocs=world, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got.double() - want.double()).norm())
    scale = max(float(want.double().norm()), 1e-12)
    assert err <= REL * scale, f"{what}: rel {err / scale:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_equals_one_process(tmp_path, world):
    """Free routing and routing replay (one spawn runs both)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawned = _spawn(_layer_rank, world, tmp_path)
    for replay in (False, True):
        ranks = [r[replay] for r in spawned]
        moe = make_moe()
        moe.bias.copy_(torch.linspace(-0.05, 0.05, N))
        x_all, ct_all, rep_all = _inputs()
        x = x_all.clone().requires_grad_(True)
        y, idx = moe(x, rep_all if replay else None)
        (y * ct_all).sum().backward()
        want = grads(moe)
        moe.update_bias()
        if replay:
            assert torch.equal(idx, rep_all)
        assert torch.equal(torch.cat([r["idx"] for r in ranks]), idx)
        _close(torch.cat([r["y"] for r in ranks]), y.detach(), "outputs")
        _close(torch.cat([r["dx"] for r in ranks]), x.grad, "input gradients")
        for r in ranks:
            assert set(r["g"]) == set(want)
            for name in want:
                _close(r["g"][name], want[name], f"grad {name}")
            # every rank set the single process's bias; load metrics describe the whole step on every rank
            torch.testing.assert_close(r["bias"], moe.bias, atol=1e-6, rtol=0)
            got, ref = dict(r["metrics"]), moe.load_metrics()
            for key in ("tokens_per_expert", "dead_experts"):
                assert got.pop(key) == ref.pop(key), key
            assert got == pytest.approx(ref, rel=1e-6)
        full = sum(w.numel() * w.element_size() for w in (moe.w_gate_up, moe.w_down_experts))
        assert [r["bytes"] for r in ranks] == [full // world] * world


# the learner step: the same tolerances as tests/test_learner_fsdp.py (weights relative to how far they moved;
# fp32 gradient sums in another order, carried by Adam's normalised update)
WEIGHT_REL, METRIC_REL, GRAD_NORM_REL = 1e-4, 1e-5, 1e-4
EXPORT_BUCKET = 256 << 10  # 256 KiB weight-sync buckets on the SMALL policy: several, some tensors larger
METRICS = ("loss", "grad_norm", "tokens", "learner/tokens_scored", "learner/entropy", "moe/load_cv_mean",
           "moe/max_mean_load_max", "moe/load_entropy_min", "moe/weight_entropy_mean", "moe/bias_range_max",
           "learner/routing_agreement")


def _learner_cfg(world: int, variant: str):
    """variant: a learner.sharding, or "<sharding>/ac" for it with learner.activation_checkpointing (each
    layer's forward, MoE exchanges included, recomputed in the backward)."""
    from tests.learner_fixtures import small_config

    sharding, _, ac = variant.partition("/")
    return small_config(num_ranks=world, sharding=sharding, num_minibatches=2, micro_batch_tokens=80, lr=1e-3,
                        activation_checkpointing=ac == "ac")


def _batches():
    from tests.learner_fixtures import ragged_batch

    # the second leaves ranks without a sample in a minibatch: they run zero-weighted one-token passes
    return [ragged_batch(seed=11), ragged_batch(seed=12, n_groups=1, group_size=3)]


def _rank_update(learner, trajectories, rank: int, world: int) -> dict[str, float]:
    """What a LearnerGroup rank does in one step: prepare the batch, take this rank's plan share, update."""
    from rl.learner.sharding import plan_step

    lc = learner.lc
    batch = learner.prepare(trajectories)
    plan = plan_step(batch.samples, lc.num_minibatches, world, lc.seed + learner.policy_steps)[rank]
    mine = set(plan.sample_indices())
    return learner.update([s for s in batch.samples if s.index in mine], plan, batch.metrics)


def _learner_rank(rank: int, world: int, init: str, out: str, shardings: list[str]) -> None:
    """Every rank builds the learner, prepares each batch itself and trains on its plan share (what a
    LearnerGroup rank gets from the driver), checkpointing after the first step; then streams the weights in
    buckets and gathers them whole (both collective); then a fresh learner loads the checkpoint and runs the
    remaining steps (the resume)."""
    _init(rank, world, init)
    try:
        from rl.learner import Learner

        results = {}
        for sharding in shardings:
            cfg = _learner_cfg(world, sharding)
            learner = Learner(cfg)
            ckpt = f"{out}/ckpt-{sharding.replace('+', '_').replace('/', '_')}"
            metrics = []
            for j, trajectories in enumerate(_batches()):
                metrics.append(_rank_update(learner, trajectories, rank, world))
                if j == 0:
                    learner.save(ckpt)  # collective gather; rank 0 writes
            buckets = list(learner.weight_buckets(EXPORT_BUCKET))
            experts = sum(w.to_local().numel() * w.to_local().element_size()
                          for w in expert_parameters(learner.module))
            results[sharding] = {"sd": learner.state_dict(), "metrics": metrics, "expert_bytes": experts,
                                 "bytes": learner.memory_bytes(), "buckets": buckets}
            results[sharding]["steps"] = (learner.policy_steps, learner.optimizer_steps)
            del learner
            resumed = Learner(cfg)
            resumed.load(ckpt)  # every rank reads the whole checkpoint (rank 0 wrote it before step 2's
            # collectives, which every rank has passed)
            for trajectories in _batches()[1:]:
                _rank_update(resumed, trajectories, rank, world)
            results[sharding]["resumed"] = resumed.state_dict()
            results[sharding]["resumed_steps"] = (resumed.policy_steps, resumed.optimizer_steps)
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _flat(sd: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([sd[k].reshape(-1).double() for k in keys])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_learner_step_equals_one_rank(tmp_path, world):
    """learner.sharding=ep (DDP + experts split) and fsdp+ep (FSDP2 + experts split) on `world` gloo ranks
    equal the unsharded learner after each of two policy steps (two minibatches each, routing replay):
    weights, loss, grad norm, the router biases and the moe/ load metrics; each rank holds 1/N of the
    expert bytes (and under fsdp+ep about 1/N of everything). Also (module docstring): fsdp+ep with
    activation checkpointing (2 ranks), the bucketed weight sync against the full gather, and the resume from
    the step-1 checkpoint (weights within 1e-6 rel of the uninterrupted run's; measured bit-equal)."""
    from rl.learner import Learner

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # activation checkpointing recomputes every MoE forward (3 all_to_all each) inside the backward: once,
    # on 2 ranks, under the layout the k3 plan uses
    shardings = ["ep", "fsdp+ep"] + (["fsdp+ep/ac"] if world == 2 else [])
    ranks = _spawn(_learner_rank, world, tmp_path, shardings)
    single = Learner(_learner_cfg(1, "none"))
    init = {k: v.clone() for k, v in single.policy.state_dict().items()}
    want = [single.step(b) for b in _batches()]
    sd1 = single.state_dict()
    keys = list(init)
    moved = float((_flat(sd1, keys) - _flat(init, keys)).norm())
    assert moved > 0
    n_expert_bytes = sum(w.numel() * w.element_size() for m in single.policy.moe_layers()
                         for w in (m.w_gate_up, m.w_down_experts))
    single_bytes = single.memory_bytes()
    for sharding in shardings:
        got = ranks[0][sharding]
        assert set(got["sd"]) == set(keys)
        rel = float((_flat(got["sd"], keys) - _flat(sd1, keys)).norm()) / moved
        print(f"{sharding} x{world}: weights rel {rel:.2e}, loss {got['metrics'][-1]['loss']:.6f} vs "
              f"{want[-1]['loss']:.6f}")
        assert rel <= WEIGHT_REL, (sharding, rel)
        for k in keys:
            if k.endswith("e_score_correction_bias"):  # the balancer saw every rank's tokens
                torch.testing.assert_close(got["sd"][k], sd1[k], atol=1e-6, rtol=0, msg=k)
        for step, (m2, m1) in enumerate(zip(got["metrics"], want)):
            for key in METRICS:
                tol = GRAD_NORM_REL if key == "grad_norm" else METRIC_REL
                assert m2[key] == pytest.approx(m1[key], rel=tol, abs=1e-9), (sharding, step, key)
        # weight sync: the buckets concatenate to the full gather, key for key, in order, bit for bit; only
        # rank 0 got tensors
        buckets = got["buckets"]
        assert [k for b in buckets for k in b] == list(got["sd"]) and len(buckets) > 2
        for b in buckets:
            assert sum(t.numel() * t.element_size() for t in b.values()) <= EXPORT_BUCKET or len(b) == 1
            for k, t in b.items():
                assert t.dtype == got["sd"][k].dtype and torch.equal(t, got["sd"][k]), (sharding, k)
        assert all(r[sharding]["buckets"] == [{}] * len(buckets) for r in ranks[1:])  # one yield a bucket
        # resume: a fresh learner loaded from the step-1 checkpoint continues exactly as the uninterrupted run
        assert got["resumed_steps"] == got["steps"] and got["steps"][0] == len(want)
        res = _flat(got["resumed"], keys)
        apart = float((res - _flat(got["sd"], keys)).norm())
        print(f"{sharding} x{world}: {len(buckets)} buckets == full gather; resume apart {apart:.2e}")
        assert apart <= 1e-6 * float(res.norm()), (sharding, apart)
        for r in ranks:
            assert r[sharding]["expert_bytes"] == n_expert_bytes // world
        if sharding == "ep":  # the dense part whole on every rank, the experts split
            want_params = single_bytes["params"] - n_expert_bytes + n_expert_bytes // world
            assert all(r[sharding]["bytes"]["params"] == want_params for r in ranks)
        else:
            for r in ranks:
                per_rank = r[sharding]["bytes"]["params"]
                assert per_rank == pytest.approx(single_bytes["params"] / world, rel=0.1)
