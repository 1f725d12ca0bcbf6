"""Learner ranks in a Ray placement group (rl/placement.py, LearnerGroup._start): two FSDP ranks start
in one PACK group of orchestrator.learner_resources bundles, each in its own bundle, and run a learner step
whose result equals one unsharded rank's on the same batch; impossible requests are refused before any actor
starts, naming the key to change."""

from __future__ import annotations

import pytest

from tests.dist_backend import GPUS_PER_RANK, require_ranks
from tests.learner_fixtures import ragged_batch, small_config


@pytest.mark.ray
def test_two_fsdp_ranks_start_in_a_placement_group_and_step(ray_session):
    import ray
    from ray.util.placement_group import placement_group_table

    from rl.learner import Learner
    from rl.train.learner_client import placed_learner_group

    cfg = small_config(num_ranks=2, sharding="fsdp", micro_batch_tokens=80, lr=1e-3)
    require_ranks(2)  # ODYSSEY_TEST_BACKEND=nccl: a GPU in each bundle (tests/dist_backend.py)
    bundle = {"CPU": 1.0, **({"GPU": float(GPUS_PER_RANK)} if GPUS_PER_RANK else {})}
    orch = cfg.orchestrator.model_copy(update={"learner_resources": bundle})
    cfg = cfg.model_copy(update={"orchestrator": orch})
    batch = ragged_batch(seed=11)
    group = placed_learner_group(cfg)
    try:
        pg = group.placement_group
        table = placement_group_table(pg)
        print("placement group:", table["strategy"], table["state"], table["bundles"])
        assert table["strategy"] == "PACK" and table["state"] == "CREATED"
        assert list(table["bundles"].values()) == [bundle, bundle]
        infos = ray.get([r.info.remote() for r in group.ranks])
        assert len({i["pid"] for i in infos}) == 2
        in_group = ray.get([r.__ray_call__.remote(  # every rank runs inside the learner's placement group
            lambda _: ray.get_runtime_context().get_placement_group_id()) for r in group.ranks])
        assert in_group == [pg.id.hex()] * 2, in_group
        metrics = group.step(batch)
    finally:
        group.shutdown()
    assert group.placement_group is None
    assert placement_group_table(pg)["state"] == "REMOVED"
    single = Learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"num_ranks": 1, "sharding": "none"})}))
    ref = single.step(batch)
    print(f"loss: 2 FSDP ranks {metrics['loss']:.6f}, one rank {ref['loss']:.6f}")
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.ray
def test_too_few_cpus_for_the_bundles_is_refused_before_any_actor(ray_session):
    """The session cluster has 4 CPUs: 3 ranks of 2 CPUs cannot be placed. The error names the key, and
    neither a placement group nor an actor was made (the CPUs are all still free)."""
    import ray
    from ray.util.placement_group import placement_group_table

    from rl.learner.group import LearnerGroup

    cfg = small_config(num_ranks=3, sharding="fsdp")
    cfg = cfg.model_copy(update={"orchestrator": cfg.orchestrator.model_copy(
        update={"learner_resources": {"CPU": 2.0}})})
    groups, free = len(placement_group_table()), ray.available_resources().get("CPU")
    with pytest.raises(ValueError) as e:
        LearnerGroup(cfg, num_cpus=2)
    print(e.value)
    assert "learner.num_ranks=3" in str(e.value) and "orchestrator.learner_resources" in str(e.value)
    assert len(placement_group_table()) == groups and ray.available_resources().get("CPU") == free


def test_placement_problems_name_the_fix():
    """No cluster needed: bundles that do not pack into the nodes, a GPU demand above the cluster's, and
    expert parallelism that does not divide the experts."""
    from rl.placement import learner_bundle, learner_placement_problems

    cfg = small_config(num_ranks=4, sharding="fsdp")
    o = cfg.orchestrator.model_copy(update={"learner_resources": {"CPU": 1.0, "GPU": 1.0, "x": 0.0}})
    cfg = cfg.model_copy(update={"orchestrator": o})
    assert learner_bundle(o.learner_resources) == {"CPU": 1.0, "GPU": 1.0}
    two_nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    assert learner_placement_problems(cfg, two_nodes, whole_run=False) == []
    one_node = [{"CPU": 8.0, "GPU": 3.0}]
    problems = learner_placement_problems(cfg, one_node)
    assert any("hold only 3 learner bundles" in p and "lower learner.num_ranks" in p for p in problems)
    assert any("asks for 4 GPU" in p for p in problems)
    # a bundle never spans nodes: 4 x 3 GPU nodes with 1 CPU each hold 4 bundles; 8 nodes of 0.5 CPU none
    assert learner_placement_problems(cfg, [{"CPU": 1.0, "GPU": 3.0}] * 4, whole_run=False) == []
    assert "hold only 0" in learner_placement_problems(cfg, [{"CPU": 0.5, "GPU": 1.0}] * 8, False)[0]
    ep = small_config(num_ranks=3, sharding="fsdp+ep")  # SMALL has 8 routed experts
    msgs = learner_placement_problems(ep, [{"CPU": 8.0}], whole_run=False)
    assert len(msgs) == 1 and "set learner.num_ranks to a divisor of" in msgs[0], msgs
    assert learner_placement_problems(small_config(num_ranks=3, sharding="fsdp"), [{"CPU": 8.0}], False) == []
