"""The torch.distributed backend and device of the sharding tests (tests/test_learner_fsdp.py,
test_expert_parallel.py, test_shard_export.py, test_learner_placement.py, test_train_sharded.py).

    from tests.dist_backend import BACKEND, init_rank, rank_device, require_ranks

gloo on CPU by default. ODYSSEY_TEST_BACKEND=nccl runs the same test code on CUDA with one GPU per rank
(bench/gpu_sharding.sh sets it): a spawned rank r uses cuda:r, a Ray learner rank gets one GPU (num_gpus=1).
A test needing more ranks than the machine has GPUs is skipped with the reason printed.
(ODYSSEY_LEARNER_BACKEND, the older name, is still read.)
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

BACKEND = os.environ.get("ODYSSEY_TEST_BACKEND", os.environ.get("ODYSSEY_LEARNER_BACKEND", "gloo"))
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"ODYSSEY_TEST_BACKEND={BACKEND!r}: use gloo (CPU, the default) or nccl (CUDA)")
GPUS_PER_RANK = 1 if BACKEND == "nccl" else 0


def require_ranks(n: int) -> None:
    """Skip (with the reason) when the backend is nccl and fewer than `n` GPUs are visible."""
    if BACKEND != "nccl":
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"ODYSSEY_TEST_BACKEND=nccl: {n} ranks need {n} GPUs (one per rank), this machine "
                    f"has {have}")


def rank_device(rank: int) -> torch.device:
    """The device spawned rank `rank` computes on: cpu (gloo) or cuda:rank (nccl, made the current device)."""
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_rank(rank: int, world: int, init_file: str, timeout_s: float = 90) -> torch.device:
    """Join a `world`-rank process group through `init_file` (file:// rendezvous) on BACKEND with one intra-op
    thread; returns the rank's device."""
    torch.set_num_threads(1)
    device = rank_device(rank)
    dist.init_process_group(BACKEND, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def train_share(learner, batches, groups: int, group: int) -> list[dict]:
    """What one rank of a multi-rank learner does with each batch of trajectories: prepare it, plan the
    step over `groups` data-parallel groups (rl/learner/sharding.py) and update on group `group`'s share.
    Returns each update's metrics."""
    from rl.learner.sharding import plan_step

    metrics = []
    for trajectories in batches:
        batch = learner.prepare(trajectories)
        plan = plan_step(batch.samples, learner.lc.num_minibatches, groups,
                         learner.lc.seed + learner.policy_steps)[group]
        mine = set(plan.sample_indices())
        metrics.append(learner.update([s for s in batch.samples if s.index in mine], plan, batch.metrics))
    return metrics


__all__ = ["BACKEND", "GPUS_PER_RANK", "init_rank", "rank_device", "require_ranks", "train_share"]
