"""Speed per token: `tiny` against a dense HF Llama of the same active size -> bench/results/vs_llama.json.

The baseline is a `transformers.LlamaForCausalLM` built locally with random weights: the same hidden size
(128), layers (8), attention heads (4 x 32), vocab (4096) and an untied head, with the MLP width chosen so
that its parameter count equals Odyssey tiny's ACTIVE count (2.50M: every parameter a token touches, routed
experts at k/n). Both run fp32 on the CPU, in the same process, with the same number of torch threads.

Rows (tokens per second, median over rounds with min and max; every round runs Odyssey then Llama, so both
see the same machine load, and the ratio of a row is the median of the per-round ratios):

- decode at batch 1, 8, 32: `TorchEngine.generate` vs `LlamaForCausalLM.generate` (HF's KV cache), each
  sequence a 32-token prompt and 64 sampled tokens (temperature 1, no top-k / top-p, fixed seeds, no stop
  token); tokens/s = generated tokens / wall time of the whole call (prefill of the prompts included);
- training forward + backward at 8 x 256 (Odyssey packed with cu_seqlens, Llama [8, 256]), 1 x 4K, 1 x 16K and
  1 x 64K: `model(ids, labels=ids).loss.backward()` from zeroed grads, train mode;
- prefill at 1 x 16K: one no-grad forward (eval mode), logits at every position for both.

Targets (issue 19): >= 1x the Llama on every row at T <= 4K, >= 2x on the training and prefill rows at
T >= 16K. Rows that do not fit the time budget (`--budget-s`, estimated from the previous sizes) or memory are
recorded with the reason instead of a number. The shared dev machines are noisy: the JSON records the load
average before and after, and the per-round ratios matter more than the absolute rates.

Usage: .venv/bin/python bench/vs_llama.py [--quick] [--threads N] [--rows decode,train,prefill]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from model.config import OdysseyConfig  # noqa: E402
from model.count import count_parameters  # noqa: E402
from model.modeling import OdysseyForCausalLM  # noqa: E402
from rl.rollout.engine import GenerationRequest, TorchEngine  # noqa: E402
from rl.rollout.sampling import SamplingParams  # noqa: E402

PROMPT, NEW = 32, 64


def llama_like(cfg: OdysseyConfig, max_len: int) -> tuple[LlamaForCausalLM, int]:
    """A dense Llama with Odyssey's hidden size, layers, heads and vocab and the MLP width whose parameter
    count is closest to Odyssey's active count. Returns (model, Odyssey active parameters)."""
    active = count_parameters(cfg).active
    D, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    fixed = 2 * V * D + D + L * (4 * D * D + 2 * D)  # embed, head, final norm; per layer attention, 2 norms
    inter = round((active - fixed) / (3 * D * L))
    lcfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=inter, num_hidden_layers=L,
                       num_attention_heads=cfg.mla_num_heads, num_key_value_heads=cfg.mla_num_heads,
                       head_dim=D // cfg.mla_num_heads, max_position_embeddings=max_len,
                       rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, attn_implementation="sdpa",
                       pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(lcfg), active


def rounds_of(fn_ours, fn_llama, n_rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of each fn per round (ours then Llama in every round), after one untimed call of each."""
    fn_ours(), fn_llama()
    t_ours, t_llama = [], []
    for _ in range(n_rounds):
        for fn, ts in ((fn_ours, t_ours), (fn_llama, t_llama)):
            gc.collect()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return t_ours, t_llama


def summarise(name: str, tokens: int, t_ours: list[float], t_llama: list[float], target: float) -> dict:
    def rate(ts):
        r = [tokens / t for t in ts]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)}

    ratios = [tl / to for to, tl in zip(t_ours, t_llama)] if t_llama else []
    row = {"row": name, "tokens": tokens, "rounds": len(t_ours), "odyssey_tok_s": rate(t_ours),
           "odyssey_seconds": t_ours}
    if t_llama:
        row |= {"llama_tok_s": rate(t_llama), "llama_seconds": t_llama,
                "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                "target": target}
        row["target_met"] = row["ratio"]["median"] >= target
    o, lr = row["odyssey_tok_s"]["median"], row.get("llama_tok_s", {}).get("median")
    ratio = f"{row['ratio']['median']:5.2f}x (rounds {row['ratio']['min']:.2f}-{row['ratio']['max']:.2f})" \
        if t_llama else row.get("llama_failure", "")
    print(f"{name:22s} odyssey {o:9.0f} tok/s   llama {lr or 0:9.0f} tok/s   {ratio}", flush=True)
    return row


def bench_decode(ours: OdysseyForCausalLM, llama: LlamaForCausalLM, batch: int, n_rounds: int) -> dict:
    ours.eval(), llama.eval()
    engine = TorchEngine(ours, max_batch_size=max(64, batch))
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, ours.config.vocab_size, (batch, PROMPT), generator=gen)

    def run_ours():
        reqs = [GenerationRequest(p.tolist(), SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=i))
                for i, p in enumerate(prompts)]
        res = engine.generate(reqs)
        assert all(len(r.token_ids) == NEW for r in res)

    def run_llama():
        with torch.inference_mode():
            out = llama.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW, min_new_tokens=NEW)
        assert out.shape == (batch, PROMPT + NEW)

    t_o, t_l = rounds_of(run_ours, run_llama, n_rounds)
    return summarise(f"decode b={batch}", batch * NEW, t_o, t_l, 1.0)


def train_step(model, ids: torch.Tensor, cu: torch.Tensor | None) -> None:
    model.zero_grad(set_to_none=True)
    kw = {"cu_seqlens": cu} if cu is not None else {}
    model(ids, labels=ids, **kw).loss.backward()


def bench_train(ours, llama, batch: int, seqlen: int, n_rounds: int, with_llama: bool, why: str) -> dict:
    ours.train(), llama.train()
    gen = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(0, ours.config.vocab_size, (batch, seqlen), generator=gen)
    packed, cu = ids.reshape(-1), torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)
    name = f"train {batch}x{seqlen // 1024}K" if seqlen >= 1024 else f"train {batch}x{seqlen}"
    target = 2.0 if seqlen >= 16384 else 1.0
    if with_llama:
        t_o, t_l = rounds_of(lambda: train_step(ours, packed, cu), lambda: train_step(llama, ids, None),
                             n_rounds)
    else:
        train_step(ours, packed, cu)
        t_o, t_l = [], []
        for _ in range(n_rounds):
            t0 = time.perf_counter()
            train_step(ours, packed, cu)
            t_o.append(time.perf_counter() - t0)
    ours.zero_grad(set_to_none=True), llama.zero_grad(set_to_none=True)
    row = summarise(name, batch * seqlen, t_o, t_l, target)
    if not with_llama:
        row |= {"llama_failure": why, "target": target}
    return row


def bench_prefill(ours, llama, seqlen: int, n_rounds: int) -> dict:
    ours.eval(), llama.eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(1))

    def run(model):
        with torch.inference_mode():
            model(ids)

    t_o, t_l = rounds_of(lambda: run(ours), lambda: run(llama), n_rounds)
    return summarise(f"prefill 1x{seqlen // 1024}K", seqlen, t_o, t_l, 2.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 round per row, no 16K/64K rows (smoke run)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both models")
    ap.add_argument("--rows", default="decode,train,prefill", help="comma list of row groups to run")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip the Llama 64K training row if its estimated time exceeds this")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_llama.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    groups = set(args.rows.split(","))
    t_start, load0 = time.time(), os.getloadavg()[0]
    cfg = OdysseyConfig.from_preset("tiny")
    torch.manual_seed(0)
    ours = OdysseyForCausalLM(cfg)
    llama, active = llama_like(cfg, 1 << 17)
    n_llama = sum(p.numel() for p in llama.parameters())
    print(f"odyssey tiny active {active:,} params; llama {n_llama:,} params "
          f"(intermediate {llama.config.intermediate_size}); {torch.get_num_threads()} threads", flush=True)
    rows = []
    if "decode" in groups:
        for b in (1, 8, 32):
            rows.append(bench_decode(ours, llama, b, 1 if args.quick else 5))
    if "train" in groups:
        rows.append(bench_train(ours, llama, 8, 256, 1 if args.quick else 5, True, ""))
        rows.append(bench_train(ours, llama, 1, 4096, 1 if args.quick else 3, True, ""))
        if not args.quick:
            r16 = bench_train(ours, llama, 1, 16384, 3, True, "")
            rows.append(r16)
            # Llama's attention is quadratic: 4x the tokens ~ 16x the attention time of the 16K row
            est = 16 * statistics.median(r16["llama_seconds"])
            fits = est <= args.budget_s
            why = "" if fits else (f"not run: estimated {est:.0f} s for one fwd+bwd (16 x the 16K row, "
                                   f"quadratic attention) exceeds the bench budget of {args.budget_s:.0f} s")
            rows.append(bench_train(ours, llama, 1, 65536, 1, fits, why))
    if "prefill" in groups:
        rows.append(bench_prefill(ours, llama, 4096 if args.quick else 16384, 1 if args.quick else 3))
    res = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "load_avg_1m": {"start": load0, "end": os.getloadavg()[0]},
                    "max_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20},
        "models": {"odyssey": "tiny preset, fp32", "odyssey_active_params": active,
                   "llama_params": n_llama, "llama_intermediate_size": llama.config.intermediate_size,
                   "decode": f"{PROMPT}-token prompts, {NEW} new tokens, temperature 1"},
        "rows": rows,
        "wall_s": time.time() - t_start,
    }
    res["summary"] = {r["row"]: round(r["ratio"]["median"], 3) if "ratio" in r else r.get("llama_failure")
                      for r in rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=2))
    print(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
