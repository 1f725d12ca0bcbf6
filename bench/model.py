"""Model benchmarks -> bench/results/model.json.

1. chunk_kda (chunkwise WY form, chunk 64) vs naive_recurrent_kda (token loop) at [1, T, H=4, K=V=64],
   T = 1K and 8K, fp32, forward only, 1 thread, median CPU (process) time. Target: >= 10x at 8K.
   chunk_kda runs as the model runs it without autograd: with its fused CPU kernels (model/kda_cpu.cpp).
   Also reported: the same call on the torch reference path (ODYSSEY_KDA_CPU_KERNEL=0; the autograd path
   uses it), and chunk size 32.
2. Forward throughput (tokens/s) of the tiny preset (4 x 512 tokens packed) and the small preset (1 x 2048).
3. Decode-cache bytes per token at 128K context, ours (MLA latent per MLA layer + constant KDA state amortised
   over the context) vs a standard GQA KV cache in EVERY layer (8 KV heads x head_dim 128 for k3, K and V,
   bf16) and vs a full-width MHA cache (K and V of width hidden_size). This ratio is the reason for the
   architecture. Also checks the analytic size against a real cache built by the tiny model.

KDA times are the median process (CPU) time of several interleaved rounds (naive, chunk 64, chunk 64 on
the torch path, chunk 32), each timed call right after an untimed call of the same function; a speedup is
the median over rounds of the ratio of two times taken in the same round (with its min and max):
the dev machines are shared, CPU time is less sensitive to other processes than wall time, and
interleaving gives all three the same load. The other sections report the best of `--repeats`.
Usage: .venv/bin/python bench/model.py [--quick] [--out bench/results/model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import kda_cpu  # noqa: E402
from model.cache import cache_bytes, gqa_cache_bytes  # noqa: E402
from model.config import OdysseyConfig  # noqa: E402
from model.kda import chunk_kda, kda_gate, naive_recurrent_kda  # noqa: E402
from model.modeling import OdysseyForCausalLM  # noqa: E402

CTX = 131072


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved_cpu_times(fns: list, repeats: int) -> list[list[float]]:
    """Process (CPU) time of each fn in each of `repeats` rounds. A round runs every fn in turn, so that all
    see the same machine load; each fn is called once untimed right before its timed call, so that each is
    timed in its own steady state (the naive loop churns ~400 MB of heap per call and leaves the caches
    cold: whatever runs right after it is up to 1.5x slower)."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            fn()
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
    return times


def speedup(base: list[float], fast: list[float]) -> dict:
    """Per-round ratios base/fast (both timed in the same round, so a load change between rounds cancels):
    their median, min and max."""
    ratios = [b / f for b, f in zip(base, fast)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def torch_path(fn, *args, **kwargs):
    """fn on chunk_kda's torch reference path (the fused CPU kernels switched off for this call)."""
    os.environ["ODYSSEY_KDA_CPU_KERNEL"] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["ODYSSEY_KDA_CPU_KERNEL"]


def kda_inputs(T: int, H: int = 4, K: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, K, generator=g)
    gate = kda_gate(torch.randn(1, T, H, K, generator=g), torch.zeros(H))
    beta = torch.sigmoid(torch.randn(1, T, H, generator=g))
    return q, k, v, gate, beta


@torch.no_grad()
def bench_kda(lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    for T in lengths:
        q, k, v, g, beta = kda_inputs(T)
        args = (q, k, v, g, beta)
        # interleaved, so that all four see the same load on a shared machine
        rounds = interleaved_cpu_times(
            [lambda args=args: naive_recurrent_kda(*args),
             lambda args=args: chunk_kda(*args, chunk_size=64),
             lambda args=args: torch_path(chunk_kda, *args, chunk_size=64),
             lambda args=args: chunk_kda(*args, chunk_size=32)],
            max(11, repeats),
        )
        t_naive, t_chunk, t_torch, t_c32 = (statistics.median(ts) for ts in rounds)
        sp, sp_torch, sp_c32 = (speedup(rounds[0], ts) for ts in rounds[1:])
        o_n, s_n = naive_recurrent_kda(q, k, v, g, beta)
        o_c, s_c = chunk_kda(q, k, v, g, beta, chunk_size=64)
        rel = float((o_c - o_n).pow(2).mean().sqrt() / o_n.pow(2).mean().sqrt())
        rows.append({"T": T, "H": 4, "K": 64, "V": 64, "chunk_size": 64, "timer": "process time",
                     "rounds": len(rounds[0]), "fused_cpu_kernels": kda_cpu.load() is not None,
                     "naive_s": t_naive, "chunk_s": t_chunk, "speedup": sp["median"], "speedup_rounds": sp,
                     "chunk_torch_path_s": t_torch, "speedup_torch_path": sp_torch["median"],
                     "chunk32_s": t_c32, "speedup_chunk32": sp_c32["median"], "rel_rms_error": rel})
        print(f"KDA T={T:5d}: naive {t_naive * 1e3:8.1f} ms  chunk {t_chunk * 1e3:7.1f} ms  "
              f"speedup {sp['median']:5.1f}x (rounds {sp['min']:.1f}-{sp['max']:.1f}x)  (torch path: "
              f"{t_torch * 1e3:6.1f} ms, {sp_torch['median']:4.1f}x; chunk 32: {t_c32 * 1e3:6.1f} ms, "
              f"{sp_c32['median']:4.1f}x)  (rel-RMS {rel:.1e})")
    return rows


@torch.no_grad()
def bench_forward(preset: str, batch: int, seqlen: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = OdysseyForCausalLM(OdysseyConfig.from_preset(preset)).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch * seqlen,))
    cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)
    t = best_time(lambda: model(ids, cu_seqlens=cu), repeats)
    n = batch * seqlen
    print(f"forward {preset:5s} {batch}x{seqlen}: {t * 1e3:7.1f} ms  {n / t:9.0f} tokens/s")
    return {"preset": preset, "batch": batch, "seqlen": seqlen, "seconds": t, "tokens_per_s": n / t}


def bench_cache() -> dict:
    """Bytes per token at 128K context (bf16 latents/conv/KV, fp32 KDA state)."""
    out = {}
    for preset in ("tiny", "small", "k3"):
        cfg = OdysseyConfig.from_preset(preset)
        ours = cache_bytes(cfg, CTX, latent_bytes=2, conv_bytes=2, state_bytes=4)
        head_dim = 128 if preset == "k3" else cfg.mla_head_dim
        kv_heads = 8 if preset == "k3" else max(1, cfg.mla_num_heads // 2)
        gqa = gqa_cache_bytes(cfg.num_hidden_layers, kv_heads, head_dim, CTX)
        mha = cfg.num_hidden_layers * 2 * cfg.hidden_size * CTX * 2
        row = {
            "context": CTX,
            "ours_bytes_per_token": ours["total"] / CTX,
            "ours_mla_latent_bytes_per_token": ours["mla"] / CTX,
            "ours_kda_state_bytes_per_token_amortised": ours["kda"] / CTX,
            "ours_kda_state_bytes_per_sequence": ours["kda"],
            "gqa_baseline": f"{cfg.num_hidden_layers} layers x {kv_heads} KV heads x head_dim {head_dim}, "
                            "K+V, bf16",
            "gqa_bytes_per_token": gqa / CTX,
            "mha_full_width_bytes_per_token": mha / CTX,
            "ratio_gqa_over_ours": gqa / ours["total"],
            "ratio_mha_over_ours": mha / ours["total"],
            "ours_total_GiB_per_sequence": ours["total"] / 2 ** 30,
            "gqa_total_GiB_per_sequence": gqa / 2 ** 30,
        }
        out[preset] = row
        print(f"cache {preset:5s} @128K: ours {row['ours_bytes_per_token']:10.1f} B/token "
              f"(MLA {row['ours_mla_latent_bytes_per_token']:.0f} "
              f"+ KDA {row['ours_kda_state_bytes_per_token_amortised']:.1f})"
              f"  GQA {row['gqa_bytes_per_token']:10.0f} B/token  ratio {row['ratio_gqa_over_ours']:5.1f}x"
              f"  (full-width MHA: {row['ratio_mha_over_ours']:.0f}x)")
    return out


@torch.no_grad()
def check_cache_formula() -> dict:
    """The analytic size equals the bytes a real tiny-model cache holds (fp32 model, 1000 tokens)."""
    cfg = OdysseyConfig.from_preset("tiny")
    model = OdysseyForCausalLM(cfg).eval()
    cache = model(torch.randint(0, cfg.vocab_size, (1000,)), use_cache=True).cache
    est = cache_bytes(cfg, 1000, latent_bytes=4, conv_bytes=4, state_bytes=4)["total"]
    print(f"cache formula check (tiny, 1000 tokens, fp32): measured {cache.nbytes()} B, formula {est} B")
    return {"measured_bytes": cache.nbytes(), "formula_bytes": est, "equal": cache.nbytes() == est}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short KDA lengths and fewer repeats (smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: 2 OpenMP threads thrash on the shared 2-core machines)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "model.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [256, 1024] if args.quick else [1024, 8192]
    res = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "kda": bench_kda(lengths, args.repeats),
        "forward": [bench_forward("tiny", 4, 512, args.repeats)],
        "cache_128k": bench_cache(),
        "cache_formula_check": check_cache_formula(),
    }
    if not args.quick:
        res["forward"].append(bench_forward("small", 1, 2048, max(1, args.repeats - 1)))
    at = {r["T"]: r["speedup"] for r in res["kda"]}
    res["summary"] = {
        "kda_speedup_at_8k": at.get(8192),
        "kda_speedup_at_8k_torch_path": {r["T"]: r["speedup_torch_path"] for r in res["kda"]}.get(8192),
        "kda_speedup_at_8k_chunk32": {r["T"]: r["speedup_chunk32"] for r in res["kda"]}.get(8192),
        "kda_target_10x_met": at.get(8192, 0) >= 10 if 8192 in at else None,
        "tiny_forward_tokens_per_s": res["forward"][0]["tokens_per_s"],
        "k3_cache_ratio_vs_gqa_at_128k": res["cache_128k"]["k3"]["ratio_gqa_over_ours"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
