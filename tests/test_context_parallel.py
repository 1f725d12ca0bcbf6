"""Context parallelism (model/context_parallel.py, learner.context_parallel): the oracle is one rank running
the whole packed batch. R real processes (torch.distributed, gloo) each run their shard; the loss is built
from the gathered per-token results and the parameter gradients are summed over ranks. Log-probs, entropy
and every parameter's gradient equal the single-rank forward + backward (rel <= 1e-5, fp32, routing replay
on) at 2 and 3 ranks: one sequence spanning every shard (the KDA state composed over two hops), packed
sequences cut across shard boundaries, and shards shorter than the short conv (its inputs walked back over
several ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from model import context_parallel
from model.context_parallel import context_parallel_forward, gather_shards, plan_shards, shard_bounds
from model.sequence_chunks import Window
from rl.learner.forward import head_logprobs
from tests.test_sequence_chunks import REL, _assert_close, _grads, _inputs, _model, _unchunked


def test_plan_shards_hand_example():
    # sequences 6, 1 (packed [0,6) [6,7)) over 3 ranks: bounds 0, 2, 4, 7
    assert plan_shards([6, 0, 1], 3) == [
        Window(0, 2, (2,), False, True),
        Window(2, 4, (2,), True, True),
        Window(4, 7, (2, 1), True, False),
    ]
    with pytest.raises(ValueError, match="needs >= 3 tokens"):
        plan_shards([1, 1], 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(1, 5))
def test_plan_shards_properties(lens, R):
    L = sum(lens)
    if L < R:
        return
    shards = plan_shards(lens, R)
    assert [(s.start, s.end) for s in shards] == list(zip(shard_bounds(L, R)[:-1], shard_bounds(L, R)[1:]))
    assert all(sum(s.lens) == s.end - s.start and min(s.lens) > 0 for s in shards)
    glued = []
    for s in shards:
        ps = list(s.lens)
        if s.carry_in:
            glued[-1] += ps.pop(0)
        glued += ps
    assert glued == [n for n in lens if n]
    assert all(a.carry_out == b.carry_in for a, b in zip(shards, shards[1:]))
    assert not shards[0].carry_in and not shards[-1].carry_out


def _rank(rank: int, world: int, init: str, lens: list[int], seed: int, out: str,
          checkpoint_layers: bool = False) -> None:
    """One rank's shard forward + backward (every layer checkpointed with `checkpoint_layers`); rank 0 saves
    the gathered log-probs, entropies, all-reduced gradients and routes."""
    torch.set_num_threads(1)
    context_parallel.PREFIX_BLOCK = 200  # MLA prefix + shard: several blocks of 200 rows
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        model = _model()
        ids, cu, targets, replay, weights = _inputs(lens, seed)
        h, shard, routed = context_parallel_forward(model.model, ids, cu, replay, group, return_routed=True,
                                                    checkpoint_layers=checkpoint_layers)
        lp, ent = head_logprobs(h, targets[shard.start:shard.end], model.lm_head.weight)
        counts = [s.end - s.start for s in plan_shards(lens, world)]
        lp_all = torch.cat(gather_shards(lp, counts, group))
        ent_all = torch.cat(gather_shards(ent, counts, group))
        ((lp_all.double() * weights).sum() + ent_all.double().sum() * 1e-2).backward()
        grads = _grads(model)
        for name in sorted(grads):
            dist.all_reduce(grads[name], group=group)
        routed_all = torch.cat(gather_shards(routed, counts, group))
        if rank == 0:
            torch.save({"lp": lp_all.detach(), "ent": ent_all.detach(), "g": grads, "routed": routed_all},
                       out)
    finally:
        dist.destroy_process_group()


def _context_parallel(tmp_path, world: int, lens: list[int], seed: int, checkpoint_layers: bool = False):
    out = str(tmp_path / "rank0.pt")
    init = str(tmp_path / "rendezvous")
    mp.start_processes(_rank, args=(world, init, lens, seed, out, checkpoint_layers), nprocs=world,
                       start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize(
    "world,lens",
    [
        (2, [1500]),  # one sequence across both ranks
        (3, [1500]),  # ... across three: shard 2's KDA state composes shards 0 and 1
        (2, [700, 1, 45, 300, 2, 513]),  # packed sequences cut across the boundary
        (3, [6, 1]),  # shards of 2 tokens < W-1 = 3: the conv inputs walk back over two ranks
    ],
)
def test_context_parallel_forward_backward_equals_one_rank(tmp_path, world, lens):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = _model()
    args = _inputs(lens, seed=world + len(lens))
    ref = _unchunked(model, *args)
    got = _context_parallel(tmp_path, world, lens, world + len(lens))
    _assert_close(ref, (got["lp"], got["ent"], got["g"]))
    with torch.no_grad():  # routing replay on: the shard's routed experts are the replayed ones
        assert torch.equal(got["routed"], args[3])
    assert REL == 1e-5


def test_context_parallel_config_problems_name_the_fix():
    from rl.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError)) as e:
        load_config("configs/tiny.yaml", ["learner.context_parallel=2", "learner.num_ranks=3",
                                          "learner.sequence_chunk_tokens=1024"])
    msg = str(e.value)
    assert "learner.num_ranks (3) must be a multiple of learner.context_parallel (2)" in msg
    assert "sequence_chunk_tokens and learner.context_parallel > 1 do not combine yet" in msg
    cfg = load_config("configs/tiny.yaml", ["learner.context_parallel=2", "learner.num_ranks=2"])
    assert cfg.learner.context_parallel == 2


def test_context_parallel_learner_needs_a_group():
    from rl.learner import Learner
    from tests.learner_fixtures import small_config

    with pytest.raises(ValueError, match="learner.num_ranks is 2 but this process runs 1 rank"):
        Learner(small_config(num_ranks=2, context_parallel=2))


# ---------------------------------------------------------------------------------- images (issue 31)
def _image_inputs(lens: list[int], world: int, seed: int):
    """_inputs plus image blocks (model/vision.py layout, tiny's patch size 8): one straddling every shard
    boundary, one inside a shard. Returns (ids, cu, targets, replay, weights, ImagePatches)."""
    from model.vision import ImagePatches, image_token_ids

    ids, cu, targets, replay, weights = _inputs(lens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    L = int(cu[-1])
    bounds = shard_bounds(L, world)[1:-1]
    starts = [b - 7 for b in bounds] + [20]  # a 3x4 block is 17 tokens: each boundary cuts one
    images = []
    for s in starts:
        block = image_token_ids(3, 4)
        ids[s : s + len(block)] = torch.tensor(block)
        images.append(torch.randint(0, 256, (3, 24, 32), generator=g, dtype=torch.uint8))
    return ids, cu, targets, replay, weights, ImagePatches.from_images(images, starts, 8)


def _rank_images(rank: int, world: int, init: str, lens: list[int], seed: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        model = _model()
        ids, cu, targets, replay, weights, images = _image_inputs(lens, world, seed)
        h, shard, _ = context_parallel_forward(model.model, ids, cu, replay, group, images=images)
        lp, ent = head_logprobs(h, targets[shard.start : shard.end], model.lm_head.weight)
        counts = [s.end - s.start for s in plan_shards(lens, world)]
        lp_all = torch.cat(gather_shards(lp, counts, group))
        ent_all = torch.cat(gather_shards(ent, counts, group))
        ((lp_all.double() * weights).sum() + ent_all.double().sum() * 1e-2).backward()
        grads = _grads(model)
        for name in sorted(grads):
            dist.all_reduce(grads[name], group=group)
        if rank == 0:
            torch.save({"lp": lp_all.detach(), "ent": ent_all.detach(), "g": grads}, out)
    finally:
        dist.destroy_process_group()


def test_context_parallel_with_images_cut_by_shards_equals_one_rank(tmp_path):
    """Images whose blocks straddle the shard boundary: each rank embeds its shard's patches; log-probs,
    entropy and every gradient (the patch embedding's included) equal one rank (rel <= 1e-5, fp32)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world, lens, seed = 2, [700, 1, 45, 300, 2, 513], 77
    model = _model()
    ids, cu, targets, replay, weights, images = _image_inputs(lens, world, seed)
    model.zero_grad(set_to_none=True)
    h, _, _, _ = model.model(ids, cu, None, replay, False, images)
    lp, ent = head_logprobs(h, targets, model.lm_head.weight)
    ((lp.double() * weights).sum() + ent.double().sum() * 1e-2).backward()
    ref = (lp.detach(), ent.detach(), _grads(model))
    assert "model.vision.weight" in ref[2]
    out, init = str(tmp_path / "rank0.pt"), str(tmp_path / "rendezvous")
    mp.start_processes(_rank_images, args=(world, init, lens, seed, out), nprocs=world, start_method="spawn")
    got = torch.load(out)
    _assert_close(ref, (got["lp"], got["ent"], got["g"]))
