"""Weight sync out of an FSDP2-sharded policy: bucketed streaming (rl/learner/shard_export.py) against the
whole-model gather (`full_state_dict`, rl/learner/fsdp.py), on gloo CPU ranks.

    .venv/bin/python bench/weight_sync.py        # -> bench/results/weight_sync.json

For each model (the tiny preset, and the small preset cut to 4 layers so two ranks fit in ~2 GB) and each
world size (1 and 2 spawned ranks, FSDP2 over gloo, fp32), the sending rank measures, in the same run:
- seconds: the learner side of a sync, from the call until rank 0 holds (full: `Learner.state_dict()`'s
  work, `full_state_dict` then CPU copies; a one-rank `full_state_dict` returns views of the parameters) or
  has seen and dropped (bucketed) every tensor on CPU; the engines' load and Ray's object store are not
  included;
- peak extra memory: the rise of rank 0's resident set (VmHWM, reset through /proc/self/clear_refs, with
  glibc's mmap threshold pinned so freed tensors leave RSS at once) above its RSS before the call.
Ratios are bucketed / full from the same run. Over REPEATS calls: the least seconds, the largest peak.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": ("tiny", {}), "small_4layers": ("small", {"num_hidden_layers": 4})}
WORLDS = (1, 2)
BUCKET_BYTES = 32 << 20
REPEATS = 2
MiB = 1 << 20


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _measure(fn) -> tuple[float, int]:
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, _status("VmHWM") - base


def _rank(rank: int, world: int, init: str, model: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from model.config import OdysseyConfig
        from model.modeling import OdysseyForCausalLM
        from rl.learner.forward import TrainModule
        from rl.learner.fsdp import full_state_dict, shard_train_module
        from rl.learner.shard_export import iter_weight_buckets

        preset, overrides = MODELS[model]
        torch.manual_seed(0)
        policy = OdysseyForCausalLM(OdysseyConfig.from_preset(preset, **overrides))
        nbytes = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
        shard_train_module(TrainModule(policy), torch.device("cpu"), "float32", "float32")

        def full() -> None:  # today's sync: Learner.state_dict() = full_state_dict + CPU copies
            sd = {k: v.detach().to("cpu", copy=True) for k, v in full_state_dict(policy).items()}
            del sd

        def buckets() -> None:
            for b in iter_weight_buckets(policy, BUCKET_BYTES):
                del b

        res = {}
        for name, fn in (("full", full), ("bucketed", buckets)):
            best = (float("inf"), 0)
            for _ in range(REPEATS):
                dist.barrier()
                s, m = _measure(fn)
                best = (min(best[0], s), max(best[1], m))
            res[name] = {"seconds": best[0], "peak_extra_bytes": best[1]}
        if rank == 0:
            res["model_bytes"] = nbytes
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for model in MODELS:
            for world in WORLDS:
                out, init = os.path.join(d, f"{model}{world}.pt"), os.path.join(d, f"rdv{model}{world}")
                mp.start_processes(_rank, args=(world, init, model, out), nprocs=world, start_method="spawn")
                r = torch.load(out)
                full, buck = r["full"], r["bucketed"]
                rows.append({
                    "model": model, "model_bytes": r["model_bytes"], "ranks": world,
                    "bucket_bytes": BUCKET_BYTES,
                    "full_seconds": full["seconds"], "bucketed_seconds": buck["seconds"],
                    "full_peak_extra_bytes": full["peak_extra_bytes"],
                    "bucketed_peak_extra_bytes": buck["peak_extra_bytes"],
                    "seconds_ratio": buck["seconds"] / full["seconds"],
                    "peak_ratio": buck["peak_extra_bytes"] / max(full["peak_extra_bytes"], 1),
                })
                row = rows[-1]
                full_mb, buck_mb = row["full_peak_extra_bytes"] / MiB, row["bucketed_peak_extra_bytes"] / MiB
                print(f"{model:14s} {row['model_bytes'] / MiB:8.1f} MiB  ranks {world}  "
                      f"full {row['full_seconds']:.3f} s +{full_mb:.1f} MiB  "
                      f"bucketed {row['bucketed_seconds']:.3f} s +{buck_mb:.1f} MiB  "
                      f"ratios: time {row['seconds_ratio']:.2f}x, peak {row['peak_ratio']:.2f}x", flush=True)
    result = {
        "bench": "weight_sync",
        "device": "cpu (gloo), torch.set_num_threads(1) per rank, shared 2-core machine",
        "torch": torch.__version__,
        "what": "rank 0's side of a sync from FSDP2 shards: full_state_dict vs iter_weight_buckets "
                "(seconds until every tensor is on rank 0's CPU; peak RSS rise above the pre-call RSS)",
        "rows": rows,
    }
    path = ROOT / "bench" / "results" / "weight_sync.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
