"""Learner benchmarks -> bench/results/learner.json.

1. Packing: learner tokens/s for one optimizer step's forward + backward over an agentic length mix (64
   trajectories, lengths lognormal(median 500, sigma 1.0) clipped to [100, 8192], ~30 % prompt, the rest
   generated), packed (first-fit decreasing into micro_batch_tokens, cu_seqlens, no padding) against TRL's
   layout (right-padded batches of `--padded-batch` trajectories in data order, each row one sequence). Same
   model, same tokens, same token-mean loss through `Learner.backward_micro_batch`. Packed, the LM head runs
   on the scored positions only; padded, on every completion position of every row as TRL does (pads
   included, with zero weight). The two layouts' micro-batches run interleaved, so both see the same machine
   load; wall and CPU seconds are summed per layout. Target: packed >= 2x. Padding waste = pad tokens /
   tokens computed.
2. Long sequences: peak RSS and seconds of one forward + backward of a single 8K and 16K-token trajectory on
   `tiny` through the learner, with and without activation checkpointing. Each case runs in its own
   subprocess (peak RSS = that process's VmHWM; the peak after building the learner is reported too).

    python bench/learner.py                 # both parts (~8 min on a quiet 2-core machine)
    python bench/learner.py --part packing  # one part

Timings taken while other jobs load the machine are noisy; the packed/padded ratio is measured in the same
run and is what counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.config import RunConfig  # noqa: E402
from rl.learner import Learner  # noqa: E402
from rl.learner.packing import MicroBatch, collate, pack  # noqa: E402
from rl.trajectory import Trajectory, TurnSpan  # noqa: E402

OUT = ROOT / "bench" / "results" / "learner.json"
PACKING_MODEL = {"num_hidden_layers": 4}  # tiny's first 4 layers ([kda, kda, kda, mla], 3 MoE): same for both


def fingerprint() -> str:
    from model.tokenizer import load_tokenizer, tokenizer_fingerprint

    return tokenizer_fingerprint(load_tokenizer())


def moe_shape(cfg) -> tuple[int, int, int]:
    """(MoE layers, experts, top-k) of the run's policy."""
    from model.config import OdysseyConfig

    oc = OdysseyConfig.from_preset(cfg.model.preset, **cfg.model.overrides)
    return len(oc.moe_layer_indices), oc.n_routed_experts, oc.num_experts_per_tok


def trajectory(rng: np.random.Generator, T: int, moe: tuple[int, int, int], reward: float) -> Trajectory:
    """A scored single-turn episode of T tokens: 30 % prompt, then generated tokens, routed experts."""
    n_prompt = max(1, int(0.3 * T))
    tokens = rng.integers(16, 4096, T).astype(np.int32)
    mask = np.zeros(T, np.uint8)
    mask[n_prompt:] = 1
    lp = np.full(T, np.nan, np.float32)
    lp[n_prompt:] = -8.3
    n_moe, n, k = moe
    routed = np.argsort(rng.random((T, n_moe, n)), axis=-1)[..., :k].astype(np.uint16)
    return Trajectory(tokens=tokens, loss_mask=mask, rollout_logprobs=lp, routed_experts=routed,
                      turns=[TurnSpan("prompt", 0, n_prompt), TurnSpan("assistant", n_prompt, T)],
                      rewards={"total": reward}, turn_rewards=[0.0], terminated=True,
                      metadata={"group_id": 0, "tokenizer": fingerprint()})


def length_mix(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(500), 1.0, n)), 100, 8192)]


def collate_padded(samples, fields, with_replay: bool) -> tuple[MicroBatch, int]:
    """TRL's layout: B rows right-padded to the longest (pad id 0, pad experts 0..k-1), each row one sequence
    ([B, T_max] flattened, cu_seqlens every T_max); and, as TRL computes logits for every completion position
    of every row (`logits_to_keep`), the LM head runs from each row's first generated position to T_max, pads
    included. Pad positions carry advantage 0 and target 0: with the token_mean loss they add nothing to the
    loss or the gradient, only work. Returns (micro-batch, pad tokens)."""
    tmax = max(s.n_tokens for s in samples)
    B = len(samples)
    ids = torch.zeros(B * tmax, dtype=torch.int64)
    replay = None
    if with_replay:
        k = samples[0].replay.shape[-1]
        replay = torch.arange(k, dtype=torch.int64).expand(B * tmax, samples[0].replay.shape[1], k).clone()
    pos, targets, seq, counts, data = [], [], [], [], {f: [] for f in fields}
    for b, s in enumerate(samples):
        ids[b * tmax: b * tmax + s.n_tokens] = torch.from_numpy(s.input_ids)
        if with_replay:
            replay[b * tmax: b * tmax + s.n_tokens] = torch.from_numpy(s.replay.astype(np.int64))
        completion = np.arange(int(s.scored[0]), tmax)  # single-turn episodes: scored = the first n_scored
        at = s.scored - s.scored[0]
        tg = np.zeros(completion.size, dtype=np.int64)
        tg[at] = s.targets
        pos.append(completion + b * tmax)
        targets.append(tg)
        seq.append(np.full(completion.size, b))
        counts.append(completion.size)
        for f in fields:
            v = np.zeros(completion.size)
            v[at] = getattr(s, f)
            data[f].append(v)
    cu = torch.arange(0, (B + 1) * tmax, tmax, dtype=torch.int32)
    padded = MicroBatch(
        input_ids=ids, cu_seqlens=cu, replay=replay, scored_pos=torch.from_numpy(np.concatenate(pos)),
        targets=torch.from_numpy(np.concatenate(targets)), seq=torch.from_numpy(np.concatenate(seq)),
        seq_tokens=torch.tensor(counts),
        data={f: torch.from_numpy(np.concatenate(v)) for f, v in data.items()})
    return padded, B * tmax - sum(s.n_tokens for s in samples)


def bench_packing(args) -> dict:
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({
        "model": {"overrides": PACKING_MODEL},
        "learner": {"group_size": 64, "micro_batch_tokens": args.micro_batch_tokens, "tis_cap": None,
                    "activation_checkpointing": True},
        "rollout": {"max_tokens": 8192, "max_new_tokens": 512},
    })
    lengths = length_mix(args.trajectories, args.seed)
    rng = np.random.default_rng(args.seed)
    trajs = [trajectory(rng, T + 1, moe_shape(cfg), float(i % 4)) for i, T in enumerate(lengths)]
    learner = Learner(cfg)
    samples = learner.prepare(trajs).samples
    n_scored = sum(s.n_scored for s in samples)
    fields = learner.token_fields()
    real = sum(s.n_tokens for s in samples)

    warm = collate(samples[:2], fields, True)
    learner.backward_micro_batch(warm, n_scored, len(samples))  # first-call costs (allocator, threads)

    jobs = {
        "packed": [(collate([samples[i] for i in b], fields, True), 0)
                   for b in pack([s.n_tokens for s in samples], args.micro_batch_tokens)],
        "padded": [collate_padded(samples[i:i + args.padded_batch], fields, True)
                   for i in range(0, len(samples), args.padded_batch)],
    }
    # Interleave the two layouts (whichever has done the smaller share of its micro-batches goes next), so
    # that both see the same machine load; time each micro-batch's forward + backward, wall and CPU.
    spent = {k: [0.0, 0.0] for k in jobs}
    loss = dict.fromkeys(jobs, 0.0)
    done = dict.fromkeys(jobs, 0)
    learner.optimizer.zero_grad(set_to_none=True)
    while any(done[k] < len(jobs[k]) for k in jobs):
        k = min((k for k in jobs if done[k] < len(jobs[k])), key=lambda k: (done[k] / len(jobs[k]), k))
        mb, _ = jobs[k][done[k]]
        w0, c0 = time.perf_counter(), time.process_time()
        loss[k] += learner.backward_micro_batch(mb, n_scored, len(samples))
        spent[k][0] += time.perf_counter() - w0
        spent[k][1] += time.process_time() - c0
        done[k] += 1

    rows = {}
    for name in jobs:
        secs, cpu = spent[name]
        pads = sum(p for _, p in jobs[name])
        n = len(jobs[name])
        rows[name] = {
            "seconds": round(secs, 2),
            "cpu_seconds": round(cpu, 2),
            "tokens_per_s": round(real / secs, 1),
            "tokens_per_cpu_s": round(real / cpu, 1),
            "micro_batches": n,
            "tokens_computed": real + pads,
            "pad_tokens": pads,
            "padding_waste": round(pads / (real + pads), 4),
            "loss": loss[name],  # the same objective in both layouts (pads weigh 0)
        }
        print(f"packing  {name:7s} {secs:8.1f} s ({cpu:8.1f} CPU s)  {real / secs:8.1f} tok/s  {n:3d} "
              f"micro-batches  waste {pads / (real + pads):.1%}", flush=True)
    ratio = rows["padded"]["seconds"] / rows["packed"]["seconds"]
    cpu_ratio = rows["padded"]["cpu_seconds"] / rows["packed"]["cpu_seconds"]
    print(f"packing  speed-up packed / padded: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time (target >= 2x)",
          flush=True)
    return {
        "model": {"preset": "tiny", "overrides": PACKING_MODEL, "activation_checkpointing": True},
        "trajectories": len(lengths),
        "lengths": {"distribution": "lognormal(median 500, sigma 1.0) clipped to [100, 8192]",
                    "seed": args.seed, "min": min(lengths), "median": int(np.median(lengths)),
                    "max": max(lengths), "total_tokens": real},
        "micro_batch_tokens": args.micro_batch_tokens,
        "padded_batch_size": args.padded_batch,
        "packed": rows["packed"],
        "padded": rows["padded"],
        "speedup_packed_over_padded": round(ratio, 3),
        "speedup_packed_over_padded_cpu_time": round(cpu_ratio, 3),
        "interleaved": True,
        "target_speedup": 2.0,
    }


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM). Not ru_maxrss: on Linux that carries over the parent's
    RSS at fork/exec, so a subprocess of a big process would report the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def long_case(tokens: int, checkpointing: bool) -> dict:
    """One forward + backward of a single `tokens`-token trajectory on tiny (run in its own process)."""
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({
        "learner": {"group_size": 2, "micro_batch_tokens": tokens, "tis_cap": None,
                    "activation_checkpointing": checkpointing},
        "rollout": {"max_tokens": tokens + 1, "max_new_tokens": min(512, tokens + 1)},
    })
    rng = np.random.default_rng(0)
    trajs = [trajectory(rng, tokens + 1, moe_shape(cfg), 1.0), trajectory(rng, 2, moe_shape(cfg), 0.0)]
    learner = Learner(cfg)
    (s, _) = learner.prepare(trajs).samples
    mb = collate([s], learner.token_fields(), True)
    rss_setup = peak_rss_gib()
    t0 = time.perf_counter()
    learner.backward_micro_batch(mb, s.n_scored, 1)
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "activation_checkpointing": checkpointing, "seconds": round(secs, 2),
            "peak_rss_gib": round(peak_rss_gib(), 3),
            "rss_after_setup_gib": round(rss_setup, 3)}


def bench_long(args) -> list[dict]:
    out = []
    for tokens in args.long_tokens:
        for ckpt in (False, True):
            cmd = [sys.executable, __file__, "--long-case", str(tokens), str(int(ckpt))]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if proc.returncode != 0:
                row = {"tokens": tokens, "activation_checkpointing": ckpt, "error": proc.stderr[-2000:]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            out.append(row)
            print(f"long     {tokens:6d} tokens  checkpointing {str(ckpt):5s}  "
                  + (f"{row['seconds']:7.1f} s  peak RSS {row['peak_rss_gib']:.2f} GiB" if "error" not in row
                     else "FAILED: " + row["error"].splitlines()[-1]), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "packing", "long"], default="all")
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--padded-batch", type=int, default=4)
    p.add_argument("--long-tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT, help="the JSON to update (default: %(default)s)")
    p.add_argument("--long-case", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.long_case:
        print(json.dumps(long_case(args.long_case[0], bool(args.long_case[1]))))
        return 0
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result.update({"torch_threads": args.threads, "cpu_count": os.cpu_count(),
                   "load_average_at_start": os.getloadavg()})
    if args.part in ("all", "packing"):
        result["packing"] = bench_packing(args)
    if args.part in ("all", "long"):
        result["long_sequences"] = bench_long(args)
    result["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
