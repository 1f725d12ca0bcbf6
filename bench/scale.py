"""Per-rank learner memory: `odyssey plan`'s prediction (rl/plan/state.py, the meta-device model) against
the bytes each rank of a real FSDP learner holds (`rl.learner.fsdp.local_bytes` through
LearnerGroup.memory_bytes), on gloo ranks spawned as Ray actors, for 1, 2 and 4 ranks.

    python bench/scale.py [--presets tiny] [--ranks 1 2 4]

For every preset and rank count: one FSDP learner step (GRPO, two groups of 4) on a ragged batch, then each
rank's parameter / gradient / AdamW bytes next to the prediction for that rank, and their ratio (the target:
within 10 %). Writes bench/results/scale.json and prints a table. The `small` preset (200M parameters: 3.2 GB
of fp32 state on one rank) does not fit this machine's 4 GB budget next to Ray; its prediction is printed
alone, marked unmeasured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import OdysseyConfig  # noqa: E402
from rl.plan.state import meta_policy, model_shapes, rank_state  # noqa: E402

PARTS = ("params", "grads", "optimizer")
MEASURABLE = {"tiny"}  # presets whose learner fits this machine (module docstring)


def measure(preset: str, ranks: int) -> list[dict[str, int]]:
    """Per-rank bytes of a real `ranks`-rank FSDP learner after one step."""
    from rl.config import RunConfig
    from rl.learner.group import LearnerGroup
    from tests.learner_fixtures import ragged_batch

    cfg = RunConfig.model_validate({
        "model": {"preset": preset},
        "learner": {"group_size": 4, "num_ranks": ranks, "sharding": "fsdp", "micro_batch_tokens": 80,
                    "routing_replay": False}})
    group = LearnerGroup(cfg, torch_threads=1)
    try:
        group.step(ragged_batch(seed=11, routed=False))
        return group.memory_bytes()
    finally:
        group.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    import torch

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="ray_scale_", dir="/tmp")
    ray.init(num_cpus=max(args.ranks), include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}})
    rows = []
    try:
        for preset in args.presets:
            config = OdysseyConfig.from_preset(preset)
            shapes = model_shapes(meta_policy(config))
            for n in args.ranks:
                t0 = time.perf_counter()
                measured = measure(preset, n) if preset in MEASURABLE else None
                for r in range(n):
                    pred = rank_state(config, n, rank=r, param_bytes=4, shapes=shapes)
                    row = {"preset": preset, "ranks": n, "rank": r,
                           "predicted": {p: getattr(pred, p) for p in PARTS}}
                    if measured is not None:
                        row["measured"] = measured[r]
                        row["ratio"] = {p: row["predicted"][p] / measured[r][p] for p in PARTS}
                    rows.append(row)
                print(f"{preset} x{n}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        ray.shutdown()
    out = ROOT / "bench" / "results" / "scale.json"
    worst = max((abs(v - 1) for r in rows if "ratio" in r for v in r["ratio"].values()), default=None)
    out.write_text(json.dumps({"bench": "scale", "target_rel": 0.10, "worst_rel": worst, "rows": rows},
                              indent=1))
    head = "  ".join(f"{p + ' pred/meas (ratio)':>36}" for p in PARTS)
    print(f"{'preset':<6} {'ranks':>5} {'rank':>4}  {head}")
    for r in rows:
        cells = []
        for p in PARTS:
            if "measured" in r:
                cells.append(f"{r['predicted'][p]:>12,}/{r['measured'][p]:>12,} ({r['ratio'][p]:.4f})")
            else:
                cells.append(f"{r['predicted'][p]:>12,}/  unmeasured")
        print(f"{r['preset']:<6} {r['ranks']:>5} {r['rank']:>4}  " + "  ".join(f"{c:>36}" for c in cells))
    print(f"worst |ratio - 1| = {worst}; wrote {out}")
    return 0 if worst is None or worst <= 0.10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
