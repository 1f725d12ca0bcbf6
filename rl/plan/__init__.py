"""`odyssey plan`: memory, GPU count and step time of an RL run, computed from the model code.

    state.py        per-rank parameter / gradient / AdamW bytes of the sharded learner (meta-device model)
    activations.py  saved-activation bytes from the config's shapes (formula fitted to saved.py, validated):
                    windows (cp = 1) and context-parallel shards (cp > 1, checked against gloo ranks)
    saved.py        the measurement: bytes autograd saves in a real forward (the oracle of activations.py)
    plan.py         learner and rollout GPU counts, step time; cli.py: the command and its table / JSON

docs/scale.md has the k3 plan and how each number is computed.
"""

from rl.plan.plan import Cluster, Plan, Workload, make_plan

__all__ = ["Cluster", "Plan", "Workload", "make_plan"]
