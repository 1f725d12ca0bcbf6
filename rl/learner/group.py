"""`LearnerGroup`: data-parallel learning on N Ray actors joined by torch.distributed.

    group = LearnerGroup(cfg)                 # cfg.learner.num_ranks actors (inside ray.init / a Ray job)
    metrics = group.step(trajectories)        # same contract as Learner.step
    engine.update_weights(group.state_dict(), version)
    group.save(dir); group.load(dir); group.shutdown()

Each actor (`LearnerRank`) builds a `Learner` after joining one process group (gloo on CPU, nccl on CUDA;
rank 0 publishes the rendezvous address). The Learner wraps its trainable module in
DistributedDataParallel, which broadcasts rank 0's weights at construction, so every rank starts equal.

A step: the driver prepares the batch once (validation, selection and group advantages need whole groups;
rl/learner/batch.py) and plans it (rl/learner/sharding.py): minibatches, each split across ranks by token
count. Each rank gets only its own samples and runs `Learner.update`: gradients are averaged over ranks once
per optimizer step (the loss normalisers are global, so the result is the single-rank update on the whole
batch), the MoE balancer's statistics and the expert-load counts are all-reduced, and the metrics are
summed over ranks. Rank 0's metrics are returned.

Context parallelism (learner.context_parallel = R > 1): ranks r // R form a group that splits each of its
micro-batches into R contiguous shards (model/context_parallel.py); the groups are the data-parallel units,
so the plan has num_ranks / R shares and every rank of a group gets its group's.

Placement: the ranks start in one Ray placement group (rl/placement.py `learner_placement_group`:
a bundle of the rank's resources each, PACK), checked and reserved before any rank starts, removed by
`shutdown`.

Sharding (learner.sharding=fsdp, ep, fsdp+ep): the ranks shard the model with FSDP2 instead of DDP, split the
MoE experts over the ranks, or both (rl/learner/fsdp.py, model/expert_parallel.py), over all num_ranks ranks
also with context parallelism (the CP groups inside them; tests/test_sharded_context_parallel.py); the plan
is the same, and `state_dict` / `save` call every rank (the gather is collective) and return rank 0's.
`weights_ref` (the engines' weight sync) streams the weights instead under every sharded layout, one bucket
gathered at a time.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rl.learner.batch import ModelFacts, Sample, prepare_batch
from rl.learner.shard_export import DEFAULT_BUCKET_BYTES
from rl.learner.sharding import RankPlan, plan_step
from rl.trajectory import Trajectory


class LearnerRank:
    """One data-parallel rank (a Ray actor): joins the process group, then holds a Learner."""

    def __init__(self, cfg, rank: int, world_size: int, torch_threads: int | None = None) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.torch_threads = torch_threads
        self.learner = None

    def rendezvous(self) -> tuple[str, int]:
        """(address, free port) of this actor's node, for rank 0 to host the process group."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, address: str, port: int) -> ModelFacts:
        """Join the process group and build the Learner (collective: every rank calls it together)."""
        import torch
        import torch.distributed as dist

        from rl.learner.learner import Learner

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
        dist.init_process_group(
            backend, init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size
        )
        self.learner = Learner(self.cfg)
        return self.learner.facts

    def update(self, samples: list[Sample], plan: RankPlan, metrics: dict[str, float]) -> dict[str, float]:
        return self.learner.update(samples, plan, metrics)

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, Any]]:
        """The policy's weights for the engines bucket by bucket as each is gathered, then a summary (a Ray
        streaming generator; rl/learner/shard_export.py `yield_weight_buckets`). Collective under FSDP."""
        from rl.learner.shard_export import yield_weight_buckets

        yield from yield_weight_buckets(self.learner.weight_buckets(bucket_bytes))

    def save(self, path: str) -> str:
        return str(self.learner.save(path))

    def load(self, path: str) -> None:
        self.learner.load(path)

    def memory_bytes(self) -> dict[str, int]:
        return self.learner.memory_bytes()

    def counters(self) -> tuple[int, int]:
        return self.learner.policy_steps, self.learner.optimizer_steps

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerGroup:
    """`cfg.learner.num_ranks` LearnerRank actors. num_cpus / num_gpus: Ray resources per rank;
    torch_threads: intra-op threads per rank (None: torch's default)."""

    def __init__(
        self, cfg, *, num_cpus: float = 1, num_gpus: float = 0, torch_threads: int | None = None
    ) -> None:
        import ray

        self.cfg = cfg
        self.world_size = cfg.learner.num_ranks
        self._start(ray.remote(LearnerRank), {"CPU": num_cpus, "GPU": num_gpus}, torch_threads)

    def _start(self, actor: Any, resources: dict[str, float], torch_threads: int | None,
               **options: Any) -> None:
        """Start world_size `actor` ranks (a ray.remote class) with `resources` each, in one placement group
        (rl/placement.py: bundles of `resources`, PACK, checked and reserved before any rank starts),
        rank r in bundle r; join them in a process group and build their Learners."""
        import ray

        from rl.placement import (
            actor_options,
            check_learner_placement,
            in_placement_group,
            learner_placement_group,
        )

        check_learner_placement(self.cfg, whole_run=False)
        self.placement_group = learner_placement_group(resources, self.world_size)
        opts = {**actor_options(resources), **options}
        self.ranks = [actor.options(**opts, **in_placement_group(self.placement_group, r))
                      .remote(self.cfg, r, self.world_size, torch_threads) for r in range(self.world_size)]
        address, port = ray.get(self.ranks[0].rendezvous.remote())
        facts = ray.get([r.setup.remote(address, port) for r in self.ranks])
        self.facts: ModelFacts = facts[0]
        self.policy_steps = 0

    @property
    def gathering(self) -> list:
        """The ranks a weight gather calls: all of them when sharded (the gather is collective; rank 0
        answers), else rank 0 alone (every rank holds the same weights)."""
        return self.ranks if self.cfg.learner.sharding != "none" else self.ranks[:1]

    def state_dict_ref(self) -> Any:
        """ObjectRef of rank 0's `state_dict()` (the other ranks, under FSDP, take part in the gather)."""
        return [r.state_dict.remote() for r in self.gathering][0]

    def weights_ref(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Any:
        """ObjectRef of the weights for the rollout engines (rl/train/weight_sync.py): under any sharded
        layout (fsdp, ep, fsdp+ep: the expert weights are DTensors even where DDP holds the rest), of a
        WeightBuckets manifest (every rank gathers one bucket at a time and rank 0 streams each to the object
        store; rl/learner/shard_export.py), which blocks until the gather is done; otherwise of rank 0's
        `state_dict()`, as `state_dict_ref`."""
        import ray

        from rl.learner.shard_export import collect_weight_buckets

        if self.cfg.learner.sharding == "none":
            return self.state_dict_ref()
        streams = [r.weight_buckets.options(num_returns="streaming").remote(bucket_bytes) for r in self.ranks]
        return ray.put(collect_weight_buckets(streams, bucket_bytes))

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One data-parallel policy step (module docstring); the metrics of Learner.step."""
        import ray

        lc = self.cfg.learner
        batch = prepare_batch(trajectories, self.facts, lc)
        R = lc.context_parallel  # the ranks of a context-parallel group share one plan
        plans = plan_step(batch.samples, lc.num_minibatches, self.world_size // R,
                          lc.seed + self.policy_steps, batch.extra_tokens, batch.extra_episodes)
        by_index = {s.index: s for s in batch.samples}
        refs = [
            rank.update.remote([by_index[i] for i in plans[r // R].sample_indices()], plans[r // R],
                               batch.metrics)
            for r, rank in enumerate(self.ranks)
        ]
        metrics = ray.get(refs)[0]
        self.policy_steps += 1
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's policy weights (every rank holds the same) for the rollout engines."""
        import ray

        return ray.get(self.state_dict_ref())

    def save(self, path: str | Path) -> Path:
        import ray

        return Path(ray.get([r.save.remote(str(path)) for r in self.gathering])[0])

    def memory_bytes(self) -> list[dict[str, int]]:
        """Per rank: the bytes it holds of parameters, gradients and AdamW state (Learner.memory_bytes)."""
        import ray

        return ray.get([r.memory_bytes.remote() for r in self.ranks])

    def load(self, path: str | Path) -> None:
        import ray

        ray.get([r.load.remote(str(path)) for r in self.ranks])
        self.policy_steps = ray.get(self.ranks[0].counters.remote())[0]

    def shutdown(self) -> None:
        """Leave the process group and end the actors."""
        import ray

        try:
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=60)
        finally:
            for r in self.ranks:
                ray.kill(r)
            self.ranks = []
            pg, self.placement_group = getattr(self, "placement_group", None), None
            if pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)


__all__ = ["LearnerGroup", "LearnerRank"]
