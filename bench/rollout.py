"""Rollout benchmarks -> bench/results/rollout.json (ratios against baselines measured in the same run).

1. decode: TorchEngine (incremental cache, batched) vs a naive no-cache loop (packed full forward over the
   whole sequence every step) vs Hugging Face `generate` (native since issue 34: left-padded batch with the
   model's OdysseyHFCache; results/rollout.json predates it and holds the earlier no-cache adapter's numbers).
   Greedy decoding, so all three must produce the same tokens.
2. agent loop: arith episodes/s in real Docker sandboxes on the tiny policy, concurrency 4 vs 1 (the shared
   batched engine), plus a scripted calc-calling policy (the sandbox round-trip bound).
3. long observation: chunked prefill of --long-tokens tokens on a session (a subprocess measures peak RSS)
   against the [T, vocab] logits and [H, T, T] scores a one-shot forward would need.

    .venv/bin/python bench/rollout.py [--quick] [--long-tokens 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import resource
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
from tests.calc_oracle_engine import CalcOracleEngine  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "rollout.json"


def tiny_model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def prompts(B: int, P: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(16, 3000, (P + 3 * i,), generator=g).tolist() for i in range(B)]


# ---------------------------------------------------------------------------------------------- decode
def bench_engine(model, ps, new) -> tuple[float, list[list[int]]]:
    eng = TorchEngine(model, max_batch_size=len(ps))
    reqs = [GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=new)) for p in ps]
    t = time.perf_counter()
    res = eng.generate(reqs)
    return time.perf_counter() - t, [r.token_ids for r in res]


@torch.inference_mode()
def bench_naive(model, ps, new) -> tuple[float, list[list[int]]]:
    """No cache: every step runs the packed forward over every sequence's full history."""
    seqs = [list(p) for p in ps]
    t = time.perf_counter()
    for _ in range(new):
        ids = torch.tensor([x for s in seqs for x in s])
        lens = torch.tensor([len(s) for s in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        logits = model(ids, cu_seqlens=cu).logits[(cu[1:] - 1).long()]
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.append(tok)
    return time.perf_counter() - t, [s[len(p) :] for s, p in zip(seqs, ps)]


def bench_hf_generate(model, ps, new) -> tuple[float | None, list[list[int]] | None, str]:
    """Hugging Face `generate` on the model itself (a GenerationMixin since issue 34): one left-padded batch
    with an attention_mask and the model's OdysseyHFCache. bench/hf_generate.py compares it in more detail."""
    T = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(ps):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    t = time.perf_counter()
    with torch.inference_mode():
        o = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    total = time.perf_counter() - t
    return total, o[:, T:].tolist(), "native generate, left-padded batch, OdysseyHFCache"


def decode_section(model, B: int, P: int, new: int, with_hf: bool) -> dict:
    ps = prompts(B, P)
    n = B * new
    te, toks_e = bench_engine(model, ps, new)
    tn, toks_n = bench_naive(model, ps, new)
    out = {
        "batch": B,
        "prompt_len": P,
        "new_tokens": new,
        "engine_tok_s": n / te,
        "naive_no_cache_tok_s": n / tn,
        "engine_vs_naive": tn / te,
        "engine_matches_naive": toks_e == toks_n,
    }
    if with_hf:
        th, toks_h, note = bench_hf_generate(model, ps, new)
        out.update(
            hf_generate_tok_s=n / th,
            engine_vs_hf_generate=th / te,
            engine_matches_hf=toks_e == toks_h,
            hf_generate_note=note,
        )
    return out


# ---------------------------------------------------------------------------------------------- agent loop
def agent_section(episodes: int, new_tokens: int) -> dict:
    from rl.rollout.agent_loop import EpisodeConfig
    from rl.rollout.tasks import TaskStream
    from rl.rollout.worker import RolloutWorker, WorkerSettings

    def run(concurrency: int, scripted: bool = False) -> dict:
        s = WorkerSettings(
            env_id="arith",
            env_kwargs={"difficulty": 1, "max_turns": 3},
            concurrency=concurrency,
            sandbox_pool_size=min(concurrency, 4),
            episode=EpisodeConfig(max_new_tokens=new_tokens, max_turns=3),
            rewards=[{"name": "outcome", "weight": 1.0}],
        )
        w = RolloutWorker(s)  # TorchEngine on the tiny preset, seeded: same weights every run
        if scripted:
            w.engine = CalcOracleEngine()

        async def go():
            try:
                await w._ensure_pool()  # pool warm-up is not part of the episode rate
                t = time.perf_counter()
                rep = await w.run(TaskStream(base_seed=0).first_samples(episodes, group_size=1))
                return time.perf_counter() - t, rep
            finally:
                await w.close()

        dt, rep = asyncio.run(go())
        return {
            "episodes": episodes,
            "concurrency": concurrency,
            "episodes_per_s": episodes / dt,
            "generated_tok_s": rep["generated_tokens"] / dt,
            "tool_calls": rep["tool_calls"],
            "infra_errors": rep["infra_errors"],
            "success_rate": rep["successes"] / episodes,
        }

    c1 = run(1)
    c4 = run(4)
    scripted = run(4, scripted=True)
    return {
        "tiny_policy_concurrency_1": c1,
        "tiny_policy_concurrency_4": c4,
        "concurrency_4_vs_1": c4["episodes_per_s"] / c1["episodes_per_s"],
        "scripted_calc_policy_concurrency_4": scripted,
    }


# ---------------------------------------------------------------------------------------------- long prefill
def _long_prefill_child(n_tokens: int, chunk: int, q) -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    eng = TorchEngine(model, prefill_chunk_size=chunk)
    first = eng.generate([GenerationRequest(list(range(16, 80)), SamplingParams(max_new_tokens=4, seed=0))])[
        0
    ]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    obs = torch.randint(16, 3000, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    t = time.perf_counter()
    r = eng.generate(
        [GenerationRequest(obs, SamplingParams(max_new_tokens=4, seed=1), session=first.session)]
    )[0]
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    q.put(
        {
            "tokens": n_tokens,
            "chunk": chunk,
            "seconds": dt,
            "prefill_tok_s": n_tokens / dt,
            "peak_rss_growth_mb": (peak - base) / 2**20,
            "session_tokens": r.session.num_tokens,
            "cache_mb": r.session.cache.nbytes() / 2**20,
        }
    )


def long_section(n_tokens: int, chunk: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_long_prefill_child, args=(n_tokens, chunk, q))
    p.start()
    out = q.get()
    p.join()
    cfg = OdysseyConfig.from_preset("tiny")
    out["one_shot_logits_TxV_mb"] = n_tokens * cfg.vocab_size * 4 / 2**20
    out["one_shot_scores_HxTxT_mb"] = cfg.mla_num_heads * n_tokens**2 * 4 / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke)")
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model()
    new = 16 if args.quick else 48
    results = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
        }
    }
    t0 = time.perf_counter()
    results["decode_b1"] = decode_section(model, 1, 64, new, with_hf=True)
    results["decode_b8"] = decode_section(model, 8, 64, new, with_hf=True)
    results["agent_loop_docker"] = agent_section(4 if args.quick else 8, 32)
    results["long_observation"] = long_section(4096 if args.quick else args.long_tokens, 2048)
    results["total_s"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))

    d1, d8, a, lo = (results[k] for k in ("decode_b1", "decode_b8", "agent_loop_docker", "long_observation"))
    rows = [
        (
            "decode B=1: engine tok/s",
            f"{d1['engine_tok_s']:.1f}",
            f"x{d1['engine_vs_naive']:.2f} vs naive, x{d1['engine_vs_hf_generate']:.2f} vs HF generate",
        ),
        (
            "decode B=8: engine tok/s",
            f"{d8['engine_tok_s']:.1f}",
            f"x{d8['engine_vs_naive']:.2f} vs naive, x{d8['engine_vs_hf_generate']:.2f} vs HF generate",
        ),
        ("greedy tokens identical", str(d8["engine_matches_naive"] and d8["engine_matches_hf"]), ""),
        (
            "agent loop eps/s (conc 4)",
            f"{a['tiny_policy_concurrency_4']['episodes_per_s']:.3f}",
            f"x{a['concurrency_4_vs_1']:.2f} vs concurrency 1",
        ),
        (
            "scripted calc policy eps/s",
            f"{a['scripted_calc_policy_concurrency_4']['episodes_per_s']:.3f}",
            f"success {a['scripted_calc_policy_concurrency_4']['success_rate']:.2f}",
        ),
        (
            f"{lo['tokens']}-token observation prefill",
            f"{lo['prefill_tok_s']:.0f} tok/s",
            f"peak RSS +{lo['peak_rss_growth_mb']:.0f} MB vs one-shot logits "
            f"{lo['one_shot_logits_TxV_mb']:.0f} MB",
        ),
    ]
    w = max(len(r[0]) for r in rows)
    for name, val, ratio in rows:
        print(f"{name:<{w}}  {val:>12}  {ratio}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
