"""Hugging Face `generate` on OdysseyForCausalLM vs TorchEngine -> bench/results/hf_generate.json.

Same model (tiny preset, fp32, CPU), same prompts, same run. Prompts have different lengths (64 + 3i
tokens), so HF gets one left-padded batch with an attention_mask and its OdysseyHFCache; TorchEngine packs
them. Rows:
- greedy, batch 1 and 8: tokens/s of HF generate (with the cache) vs TorchEngine, and whether the tokens
  are identical (they must be: same decode path, greedy);
- greedy batch 8 with use_cache=False: HF's full-recompute fallback, for scale;
- sampling (temperature 1) batch 8: tokens/s only (the two samplers draw differently).
Each timing is the median of --reps runs. Ratios are TorchEngine / HF (> 1: TorchEngine faster).

    .venv/bin/python bench/hf_generate.py [--new 64] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import OdysseyConfig  # noqa: E402
from model.modeling import OdysseyForCausalLM  # noqa: E402
from rl.rollout.engine import GenerationRequest, TorchEngine  # noqa: E402
from rl.rollout.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "hf_generate.json"


def prompts(B: int, P: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(16, 3000, (P + 3 * i,), generator=g).tolist() for i in range(B)]


def left_pad(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(ps):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    return ids, mask


def median_time(fn, reps: int):
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def run_engine(model, ps, new: int, temperature: float) -> list[list[int]]:
    eng = TorchEngine(model, max_batch_size=len(ps))
    sp = SamplingParams(temperature=temperature, max_new_tokens=new)
    return [r.token_ids for r in eng.generate([GenerationRequest(p, sp) for p in ps])]


@torch.inference_mode()
def run_hf(model, ps, new: int, sample: bool, use_cache: bool = True) -> list[list[int]]:
    ids, mask = left_pad(ps)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                         use_cache=use_cache, **kw)
    return out[:, ids.shape[1]:].tolist()


def section(model, B: int, new: int, reps: int, sample: bool, no_cache: bool) -> dict:
    ps = prompts(B, 64)
    n = B * new
    te, toks_e = median_time(lambda: run_engine(model, ps, new, 1.0 if sample else 0.0), reps)
    th, toks_h = median_time(lambda: run_hf(model, ps, new, sample), reps)
    out = {"batch": B, "prompt_len": f"64..{64 + 3 * (B - 1)}", "new_tokens": new, "sampling": sample,
           "torch_engine_tok_s": n / te, "hf_generate_tok_s": n / th, "engine_vs_hf": th / te}
    if not sample:
        out["tokens_identical"] = toks_e == toks_h
    if no_cache:
        tn, toks_n = median_time(lambda: run_hf(model, ps, new, sample, use_cache=False), 1)
        out.update(hf_no_cache_tok_s=n / tn, hf_cache_vs_no_cache=tn / th,
                   no_cache_tokens_identical=toks_n == toks_h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    run_hf(model, prompts(2, 8), 4, False)  # warm-up (kernel build / first-call costs)
    run_engine(model, prompts(2, 8), 4, 0.0)
    t0 = time.perf_counter()
    results = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
                    "cpu": platform.processor() or platform.machine()},
        "greedy_b1": section(model, 1, args.new, args.reps, sample=False, no_cache=False),
        "greedy_b8": section(model, 8, args.new, args.reps, sample=False, no_cache=True),
        "sample_b8": section(model, 8, args.new, args.reps, sample=True, no_cache=False),
    }
    results["total_s"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")

    print(f"{'row':<16}{'TorchEngine tok/s':>19}{'HF generate tok/s':>19}{'engine/HF':>11}  notes")
    for key in ("greedy_b1", "greedy_b8", "sample_b8"):
        r = results[key]
        notes = []
        if "tokens_identical" in r:
            notes.append(f"tokens identical: {r['tokens_identical']}")
        if "hf_no_cache_tok_s" in r:
            notes.append(f"HF use_cache=False {r['hf_no_cache_tok_s']:.1f} tok/s "
                         f"(cache x{r['hf_cache_vs_no_cache']:.2f})")
        print(f"{key:<16}{r['torch_engine_tok_s']:>19.1f}{r['hf_generate_tok_s']:>19.1f}"
              f"{r['engine_vs_hf']:>10.2f}x  {'; '.join(notes)}")
    print(f"total {results['total_s']:.1f} s -> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
