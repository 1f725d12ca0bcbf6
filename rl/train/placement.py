"""Placement: which Ray resources each rollout worker and learner rank asks for (from the config).

    orchestrator:
      rollout_resources: {CPU: 1, rollout_node: 0.01}    # one RolloutWorker actor
      learner_resources: {CPU: 1, learner_node: 0.01}    # one learner rank (learner.num_ranks of them)

`CPU` and `GPU` become the actor's num_cpus / num_gpus, every other key a custom resource: give a node
`ray start --resources '{"rollout_node": 8}'` and ask for a small amount of it to pin actors there.
An actor's torch thread count is its CPU amount (at least 1), so runs are reproducible whatever the
machine. Before any actor starts, `check_fits` compares the requests with the cluster's resources, so
a request no node can satisfy is an error naming the key, not an actor that waits forever.
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


def cluster_demand(cfg: Any) -> dict[str, float]:
    """Resources the whole run asks for: num_workers x rollout + num_ranks x learner."""
    o = cfg.orchestrator
    ranks = int(getattr(cfg.learner, "num_ranks", 1) or 1)
    out: dict[str, float] = {}
    for resources, n in ((o.rollout_resources, cfg.rollout.num_workers), (o.learner_resources, ranks)):
        for k, v in resources.items():
            out[k] = out.get(k, 0.0) + float(v) * n
    return out


def fit_problems(cfg: Any, available: dict[str, float]) -> list[str]:
    """Requests that the cluster's total resources (`ray.cluster_resources()`) cannot meet: one line each,
    naming the config key and the fix."""
    o = cfg.orchestrator
    out = []
    for key, resources in (
        ("rollout_resources", o.rollout_resources),
        ("learner_resources", o.learner_resources),
    ):
        for k, v in resources.items():
            if v > 0 and k not in available:
                have = ", ".join(
                    sorted(r for r in available if not r.startswith("node:") and "memory" not in r)
                )
                out.append(
                    f"orchestrator.{key}: no node of the cluster has the resource {k!r} (the cluster has: "
                    f"{have}); start a node with `ray start --resources '{{\"{k}\": 1}}'` or drop the key"
                )
    demand = cluster_demand(cfg)
    for k in ("GPU",):  # CPUs may be oversubscribed (they are logical); GPUs may not
        if demand.get(k, 0.0) > available.get(k, 0.0) > 0:
            out.append(
                f"orchestrator: the run asks for {demand[k]:g} {k} in all but the cluster has "
                f"{available.get(k, 0.0):g}; lower rollout.num_workers / learner.num_ranks or the {k} amounts"
            )
    return out


def check_fits(cfg: Any) -> None:
    """Raise ValueError listing every request the connected Ray cluster cannot meet."""
    import ray

    problems = fit_problems(cfg, dict(ray.cluster_resources()))
    if problems:
        raise ValueError("placement:\n" + "\n".join(f"  - {p}" for p in problems))
