"""TrajectoryStore size and speed vs pickle / np.savez on the same trajectories.

Cases:
  1m:    one 1,048,576-token trajectory, routed_experts [T, 7, 2] uint16 (37 payload bytes/token)
  batch: 256 trajectories x 4,096 tokens in one append / one pickle / one savez

Every method writes a file (with fsync, as the store does by default) and reads it back, then
touches every array (sum) so zero-copy reads are not free. Best of `--repeats`.
Writes bench/results/trajectory.json and prints ratios store/baseline (time: < 1 is faster).

    .venv/bin/python bench/trajectory.py [--repeats 3] [--out bench/results/trajectory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from rl.trajectory import SCHEMA_VERSION, Trajectory, TrajectoryStore, TurnSpan

VOCAB, N_MOE, TOPK, N_EXPERTS = 160_000, 7, 2, 896


def synth(T: int, n_turns: int, seed: int) -> Trajectory:
    """Prompt, then n_turns x (assistant, observation) of equal size; Zipf-ish token ids."""
    rng = np.random.default_rng(seed)
    tokens = np.minimum(rng.zipf(1.3, T), VOCAB - 1).astype(np.int32)
    seg = T // (2 * n_turns + 1)
    turns, pos = [TurnSpan("prompt", 0, seg)], seg
    for i in range(n_turns):
        end = T if i == n_turns - 1 else pos + 2 * seg
        turns += [TurnSpan("assistant", pos, pos + seg), TurnSpan("observation", pos + seg, end)]
        pos = end
    mask = np.zeros(T, np.uint8)
    for s in turns:
        if s.role == "assistant":
            mask[s.start : s.end] = 1
    lp = np.full(T, np.nan, np.float32)
    lp[mask == 1] = np.log(rng.random(int(mask.sum()), dtype=np.float32) + 1e-6)
    experts = rng.integers(0, N_EXPERTS, (T, N_MOE, TOPK), dtype=np.uint16)
    infos = [
        {
            "tool_calls": [{"name": "grep", "arguments": {"q": "x"}}],
            "tool_results": ["..."],
            "tool_errors": [],
            "subgoals": [],
            "env_reward": 0.0,
            "infra_error": None,
        }
        for _ in range(n_turns)
    ]
    return Trajectory(
        tokens=tokens,
        loss_mask=mask,
        rollout_logprobs=lp,
        routed_experts=experts,
        turns=turns,
        step_infos=infos,
        outcome=1.0,
        terminated=True,
        metadata={"env_id": "long-docs", "task_id": f"t{seed}", "seed": seed, "policy_version": 0},
    )


def touch(trajs: list[Trajectory]) -> float:
    return float(
        sum(
            int(t.tokens.sum())
            + int(t.routed_experts.sum())
            + float(np.nansum(t.rollout_logprobs))
            + int(t.loss_mask.sum())
            for t in trajs
        )
    )


def _fsync_write(path: Path, data_fn) -> None:
    with open(path, "wb") as f:
        data_fn(f)
        f.flush()
        os.fsync(f.fileno())


def m_store(compression):
    def write(d: Path, trajs):
        store = TrajectoryStore(d / "store", compression=compression)
        path = store.append(trajs)
        return path.stat().st_size

    def read(d: Path):
        return TrajectoryStore(d / "store").read_all()

    return write, read


def m_pickle():
    def write(d: Path, trajs):
        _fsync_write(d / "x.pkl", lambda f: pickle.dump(trajs, f, protocol=5))
        return (d / "x.pkl").stat().st_size

    def read(d: Path):
        with open(d / "x.pkl", "rb") as f:
            return pickle.load(f)

    return write, read


def m_savez():
    def write(d: Path, trajs):
        arrays = {}
        for i, t in enumerate(trajs):
            arrays |= {
                f"{i}_tokens": t.tokens,
                f"{i}_mask": t.loss_mask,
                f"{i}_lp": t.rollout_logprobs,
                f"{i}_re": t.routed_experts,
                f"{i}_turns": np.array([[s.start, s.end] for s in t.turns]),
                f"{i}_json": np.frombuffer(
                    json.dumps([[s.to_dict() for s in t.step_infos], t.metadata]).encode(), np.uint8
                ),
            }
        _fsync_write(d / "x.npz", lambda f: np.savez(f, **arrays))
        return (d / "x.npz").stat().st_size

    def read(d: Path):
        z = np.load(d / "x.npz")
        n = len([k for k in z.files if k.endswith("_tokens")])
        out = []
        for i in range(n):
            info, meta = json.loads(z[f"{i}_json"].tobytes())
            spans = z[f"{i}_turns"]
            roles = ["prompt"] + ["assistant", "observation"] * ((len(spans) - 1) // 2)
            out.append(
                Trajectory(
                    tokens=z[f"{i}_tokens"],
                    loss_mask=z[f"{i}_mask"],
                    rollout_logprobs=z[f"{i}_lp"],
                    routed_experts=z[f"{i}_re"],
                    turns=[TurnSpan(r, int(a), int(b)) for r, (a, b) in zip(roles, spans)],
                    step_infos=info,
                    metadata=meta,
                )
            )
        return out

    return write, read


METHODS = {
    "store": m_store(None),
    "store_lz4": m_store("lz4"),
    "store_zstd": m_store("zstd"),
    "pickle": m_pickle(),
    "np_savez": m_savez(),
}


def run_case(trajs: list[Trajectory], repeats: int) -> dict:
    T = sum(t.n_tokens for t in trajs)
    ref = touch(trajs)
    res = {}
    for name, (write, read) in METHODS.items():
        best_w = best_r = float("inf")
        for _ in range(repeats):
            d = Path(tempfile.mkdtemp(prefix="odyssey_bench_"))
            try:
                t0 = time.perf_counter()
                size = write(d, trajs)
                t1 = time.perf_counter()
                got = read(d)
                check = touch(got)
                t2 = time.perf_counter()
            finally:
                shutil.rmtree(d)
            assert check == ref, f"{name} round-trip mismatch"
            best_w, best_r = min(best_w, t1 - t0), min(best_r, t2 - t1)
        res[name] = {
            "bytes_per_token": size / T,
            "write_s": best_w,
            "read_s": best_r,
            "write_MBps": size / best_w / 1e6,
            "read_MBps": size / best_r / 1e6,
        }
    base = res["pickle"]
    for r in res.values():
        r["vs_pickle"] = {k: r[k] / base[k] for k in ("bytes_per_token", "write_s", "read_s")}
    res["_tokens"] = T
    res["_n_trajectories"] = len(trajs)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trajectory.json"))
    args = ap.parse_args()
    cases = {
        "1m": [synth(1 << 20, 32, seed=0)],
        "batch": [synth(4096, 4, seed=i) for i in range(256)],
    }
    results = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "schema_version": SCHEMA_VERSION,  # "2": every record batch CRC-32-checked and validated on read
        "payload_bytes_per_token": 4 + 1 + 4 + 2 * N_MOE * TOPK,
        "note": "synthetic data: uniform random expert ids and logprobs barely compress; Zipf token ids do",
        "cases": {},
    }
    for case, trajs in cases.items():
        r = run_case(trajs, args.repeats)
        results["cases"][case] = r
        print(
            f"\n{case}: {r['_n_trajectories']} trajectories, {r['_tokens']:,} tokens "
            f"(payload {results['payload_bytes_per_token']} B/token)"
        )
        print(
            f"{'method':<12}{'B/token':>9}{'write ms':>10}{'read ms':>10}"
            f"{'size/pkl':>10}{'write/pkl':>11}{'read/pkl':>10}"
        )
        for name in METHODS:
            m = r[name]
            v = m["vs_pickle"]
            print(
                f"{name:<12}{m['bytes_per_token']:>9.2f}{m['write_s'] * 1e3:>10.1f}{m['read_s'] * 1e3:>10.1f}"
                f"{v['bytes_per_token']:>10.3f}{v['write_s']:>11.3f}{v['read_s']:>10.3f}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
