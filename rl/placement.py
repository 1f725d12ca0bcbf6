"""Placement: which Ray resources each rollout worker and learner rank asks for (from the config).

    orchestrator:
      rollout_resources: {CPU: 1, rollout_node: 0.01}    # one RolloutWorker actor
      learner_resources: {CPU: 1, learner_node: 0.01}    # one learner rank (learner.num_ranks of them)

`CPU` and `GPU` become the actor's num_cpus / num_gpus, every other key a custom resource: give a node
`ray start --resources '{"rollout_node": 8}'` and ask for a small amount of it to pin actors there.
An actor's torch thread count is its CPU amount (at least 1), so runs are reproducible whatever the
machine. Before any actor starts, `check_fits` compares the requests with the cluster's resources, so
a request no node can satisfy is an error naming the key, not an actor that waits forever.

Learner ranks start in one Ray placement group (`learner_placement_group`): learner.num_ranks bundles of
orchestrator.learner_resources, strategy PACK, reserved all together before any rank starts, so a learner
never half-starts with some ranks waiting for resources that rollout workers hold. `check_learner_placement`
(and `check_fits`) first checks that the bundles pack into the nodes and that expert parallelism divides
the experts, naming the key to change.
"""

from __future__ import annotations

import math
from typing import Any


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray `.options(...)` for one actor asking for `resources` ({"CPU": 1, "GPU": 0, "custom": 0.1})."""
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU") and v > 0}
    opts: dict[str, Any] = {"num_cpus": float(resources.get("CPU", 0.0))}
    if resources.get("GPU", 0.0) > 0:
        opts["num_gpus"] = float(resources["GPU"])
    if custom:
        opts["resources"] = custom
    return opts


def torch_threads(resources: dict[str, float]) -> int:
    """Intra-op threads of an actor with these resources: its CPU amount, at least 1."""
    return max(1, math.floor(float(resources.get("CPU", 1.0))))


def cluster_demand(cfg: Any, with_learner: bool = True) -> dict[str, float]:
    """Resources the whole run asks for: num_workers x rollout + num_ranks x learner (with_learner=False:
    the rollout workers only, as `odyssey eval` starts them)."""
    o = cfg.orchestrator
    ranks = int(getattr(cfg.learner, "num_ranks", 1) or 1) if with_learner else 0
    out: dict[str, float] = {}
    for resources, n in ((o.rollout_resources, cfg.rollout.num_workers), (o.learner_resources, ranks)):
        for k, v in resources.items():
            out[k] = out.get(k, 0.0) + float(v) * n
    return out


def fit_problems(cfg: Any, available: dict[str, float], with_learner: bool = True) -> list[str]:
    """Requests that the cluster's total resources (`ray.cluster_resources()`) cannot meet: one line each,
    naming the config key and the fix (with_learner=False: the rollout workers' requests only)."""
    o = cfg.orchestrator
    out = []
    asks = [("rollout_resources", o.rollout_resources)]
    if with_learner:
        asks.append(("learner_resources", o.learner_resources))
    for key, resources in asks:
        for k, v in resources.items():
            if v > 0 and k not in available:
                have = ", ".join(
                    sorted(r for r in available if not r.startswith("node:") and "memory" not in r)
                )
                out.append(
                    f"orchestrator.{key}: no node of the cluster has the resource {k!r} (the cluster has: "
                    f"{have}); start a node with `ray start --resources '{{\"{k}\": 1}}'` or drop the key"
                )
    demand = cluster_demand(cfg, with_learner)
    for k in ("GPU",):  # CPUs may be oversubscribed (they are logical); GPUs may not
        if demand.get(k, 0.0) > available.get(k, 0.0) > 0:
            out.append(
                f"orchestrator: the run asks for {demand[k]:g} {k} in all but the cluster has "
                f"{available.get(k, 0.0):g}; lower rollout.num_workers / learner.num_ranks or the {k} amounts"
            )
    return out


def _nodes() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster."""
    import ray

    return [dict(nd.get("Resources", {})) for nd in ray.nodes() if nd.get("Alive")]


def check_fits(cfg: Any, with_learner: bool = True) -> None:
    """Raise ValueError listing every request the connected Ray cluster cannot meet (the learner's placement
    group included; with_learner=False: the rollout workers only, for `odyssey eval`, which starts no
    learner)."""
    import ray

    problems = fit_problems(cfg, dict(ray.cluster_resources()), with_learner)
    if with_learner:
        problems += [p for p in learner_placement_problems(cfg, _nodes()) if p not in problems]
    if problems:
        raise ValueError("placement:\n" + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------- learner ranks as a placement group
#: PACK: the ranks' bundles on as few nodes as possible (FSDP's all-gathers and reduce-scatters are fastest
#: inside a node), spilling to more nodes when one cannot hold them all (STRICT_PACK would refuse a learner
#: larger than a node, STRICT_SPREAD would put every rank on its own node)
LEARNER_PG_STRATEGY = "PACK"
LEARNER_PG_TIMEOUT_S = 120.0


def learner_bundle(resources: dict[str, float]) -> dict[str, float]:
    """One rank's placement-group bundle: its positive resource amounts (CPU, GPU, custom)."""
    return {k: float(v) for k, v in resources.items() if v > 0}


def _pack(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> int:
    """How many of `bundles` first-fit into the nodes' capacities (a bundle never spans nodes)."""
    free = [dict(n) for n in nodes]
    placed = 0
    for b in bundles:
        for n in free:
            if all(n.get(k, 0.0) >= v - 1e-9 for k, v in b.items()):
                for k, v in b.items():
                    n[k] = n.get(k, 0.0) - v
                placed += 1
                break
    return placed


def learner_placement_problems(cfg: Any, nodes: list[dict[str, float]], whole_run: bool = True) -> list[str]:
    """What stops learner.num_ranks ranks from starting in their placement group, before any actor starts:
    the N bundles of orchestrator.learner_resources must pack into the nodes' resources (`nodes`: each alive
    node's total resources) next to the rollout workers' CPU / GPU, and expert parallelism
    (learner.sharding=ep | fsdp+ep) must split the routed experts evenly over the ranks. FSDP2 itself pads
    dim 0 (rl/learner/fsdp.py), so learner.sharding=fsdp needs no head or expert count divisible by N.
    whole_run=False leaves out the rollout workers (a LearnerGroup on its own)."""
    lr, o = cfg.learner, cfg.orchestrator
    n = int(lr.num_ranks)
    out = []
    bundle = learner_bundle(o.learner_resources)
    placed = _pack([bundle] * n, nodes) if bundle else n
    if placed < n:
        have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(nd.items()) if k in bundle) or "none"
                         for nd in nodes)
        out.append(f"learner.num_ranks={n}: the cluster's nodes ({have}) hold only {placed} learner "
                   f"bundles of {bundle} (orchestrator.learner_resources); lower learner.num_ranks or the "
                   "amounts, or add nodes")
    demand = cluster_demand(cfg) if whole_run else {}
    for k in ("CPU", "GPU"):
        total = sum(nd.get(k, 0.0) for nd in nodes)
        if bundle.get(k) and demand.get(k, 0.0) > total + 1e-9:
            out.append(f"the run asks for {demand[k]:g} {k} (rollout.num_workers x "
                       f"orchestrator.rollout_resources + learner.num_ranks x "
                       f"orchestrator.learner_resources) but the cluster has {total:g}; the learner's "
                       f"placement group would wait forever: lower rollout.num_workers / learner.num_ranks "
                       f"or the {k} amounts")
    if lr.sharding in ("ep", "fsdp+ep") and not getattr(cfg.model, "hf_path", None):
        from model.config import OdysseyConfig

        experts = OdysseyConfig.from_preset(cfg.model.preset, **cfg.model.overrides).n_routed_experts
        if experts == 0 or experts % n:
            out.append(f"learner.sharding={lr.sharding} splits the {experts} routed experts over the "
                       f"learner.num_ranks={n} ranks: set learner.num_ranks to a divisor of {experts} "
                       "or learner.sharding=fsdp")
    return out


def check_learner_placement(cfg: Any, whole_run: bool = True) -> None:
    """Raise ValueError listing `learner_placement_problems` against the connected Ray cluster."""
    problems = learner_placement_problems(cfg, _nodes(), whole_run)
    if problems:
        raise ValueError("learner placement:\n" + "\n".join(f"  - {p}" for p in problems))


def learner_placement_group(resources: dict[str, float], ranks: int,
                            timeout_s: float = LEARNER_PG_TIMEOUT_S) -> Any:
    """A ready placement group of `ranks` bundles of `resources` (strategy LEARNER_PG_STRATEGY), or None when
    a rank asks for no resource at all. ValueError (the group removed) when Ray cannot reserve it in
    timeout_s, naming what it asked for and what the cluster has free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = learner_bundle(resources)
    if not bundle:
        return None
    pg = placement_group([dict(bundle) for _ in range(ranks)], strategy=LEARNER_PG_STRATEGY,
                         name=f"odyssey-learner-{ranks}x")
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        free = {k: v for k, v in ray.available_resources().items() if k in bundle}
        raise ValueError(f"the learner's placement group ({ranks} bundles of {bundle}, "
                         f"{LEARNER_PG_STRATEGY}) was not ready after {timeout_s:g} s; the cluster has free "
                         f"{free}: lower "
                         "learner.num_ranks or orchestrator.learner_resources, or free / add resources")
    return pg


def in_placement_group(pg: Any, index: int) -> dict[str, Any]:
    """Ray `.options(...)` that run an actor in bundle `index` of `pg` ({} when pg is None)."""
    if pg is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}
