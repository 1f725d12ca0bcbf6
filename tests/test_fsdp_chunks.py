"""The sharded learner with sequence chunking (learner.sharding=fsdp, fsdp+ep, ep with
learner.sequence_chunk_tokens): 2 real gloo ranks (spawned by torch.multiprocessing) equal one unsharded rank
with the same chunking.

Oracle: the unsharded single-rank learner (tests/test_sequence_chunks.py checks its chunked forward and
gradients against the unchunked model). The batch has ragged lengths (3 to 70 tokens) cut into windows of
16 tokens, so the ranks' micro-batches run different numbers of windows (recorded and asserted): the rank
with fewer runs zero-weighted idle windows (model/sequence_chunks.py `idle_window`), and its micro-batch
counts are padded too (the second batch leaves a rank without samples in a minibatch).

Tolerances: those of tests/test_learner_fsdp.py (fp32; FSDP reduce-scatters every micro-batch's gradient,
so the sums run in another order): weights rel to how far they moved <= 1e-4, loss <= 1e-5 rel, grad norm
<= 1e-4 rel; the router biases (quantile balancer, fed by every rank's tokens, never by idle windows) within
1e-6. A missing or doubled window, an idle window that records MoE statistics or adds to the gradient moves
them by far more.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_backend import init_rank, require_ranks, train_share

CHUNK = 16
WEIGHT_REL = 1e-4
METRIC_REL = 1e-5
GRAD_NORM_REL = 1e-4
METRICS = ("loss", "grad_norm")
LENGTHS = [70, 5, 40, 12, 66, 3, 30, 50]
SHARDINGS = ("fsdp", "fsdp+ep", "ep")


def _cfg(world: int, sharding: str):
    from tests.learner_fixtures import small_config

    return small_config(num_ranks=world, sharding=sharding, num_minibatches=2, micro_batch_tokens=80, lr=1e-3,
                        sequence_chunk_tokens=CHUNK)


def _batches():
    from tests.learner_fixtures import ragged_batch

    return [ragged_batch(seed=21, lengths=LENGTHS), ragged_batch(seed=22, n_groups=1, group_size=3)]


def _rank(rank: int, world: int, init: str, out: str, shardings: list[str]) -> None:
    """Per sharding: build the learner, train each batch on this rank's plan share (what a LearnerGroup rank
    does), recording per forward (this rank's windows, the windows it ran)."""
    init_rank(rank, world, init)
    try:
        from rl.learner import Learner
        from rl.learner.forward import TrainModule

        seen: list[tuple[int, int]] = []
        orig = TrainModule._windows_to_run

        def record(self, mb, device):
            n = orig(self, mb, device)
            seen.append((self.chunks(mb), n))
            return n

        TrainModule._windows_to_run = record
        results = {}
        for sharding in shardings:
            seen.clear()
            learner = Learner(_cfg(world, sharding))
            metrics = train_share(learner, _batches(), world, rank)
            results[sharding] = {"sd": learner.state_dict(), "metrics": metrics, "windows": list(seen)}
            del learner
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _flat(sd: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([sd[k].reshape(-1).double() for k in keys])


@pytest.mark.slow
def test_sharded_learner_with_sequence_chunks_equals_one_unsharded_rank(tmp_path):
    """2 ranks with 16-token windows under fsdp, fsdp+ep and ep == 1 unsharded rank with 16-token windows,
    after each of two batches (module docstring for the tolerances); the ranks ran different window counts
    and every forward ran the most of any rank."""
    from rl.learner import Learner

    world = 2
    require_ranks(world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    mp.start_processes(_rank, args=(world, str(tmp_path / "rendezvous"), str(tmp_path), list(SHARDINGS)),
                       nprocs=world, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    single = Learner(_cfg(1, "none"))
    init = {k: v.clone() for k, v in single.policy.state_dict().items()}
    want = [single.step(b) for b in _batches()]
    sd1 = single.state_dict()
    keys = list(init)
    moved = float((_flat(sd1, keys) - _flat(init, keys)).norm())
    assert moved > 0
    for sharding in SHARDINGS:
        windows = [r[sharding]["windows"] for r in ranks]
        for w in windows:
            assert [n for _, n in w] == [n for _, n in windows[0]], sharding
            assert all(own <= n for own, n in w), sharding
        padded = sum(n - own for w in windows for own, n in w if n > 1)
        assert padded > 0 and any(n > 2 for _, n in windows[0]), (sharding, windows[0])
        got = ranks[0][sharding]
        assert set(got["sd"]) == set(keys)
        rel = float((_flat(got["sd"], keys) - _flat(sd1, keys)).norm()) / moved
        print(f"{sharding} x{world} chunks of {CHUNK}: weights rel {rel:.2e}, idle windows {padded}, loss "
              f"{got['metrics'][-1]['loss']:.6f} vs {want[-1]['loss']:.6f}")
        assert rel <= WEIGHT_REL, (sharding, rel)
        for k in keys:
            if k.endswith("e_score_correction_bias"):
                torch.testing.assert_close(got["sd"][k], sd1[k], atol=1e-6, rtol=0, msg=f"{sharding} {k}")
        for step, (m2, m1) in enumerate(zip(got["metrics"], want)):
            for key in METRICS:
                tol = GRAD_NORM_REL if key == "grad_norm" else METRIC_REL
                assert m2[key] == pytest.approx(m1[key], rel=tol, abs=1e-9), (sharding, step, key)
