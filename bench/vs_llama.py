"""Speed per token: `tiny` against a dense HF Llama of the same active size -> bench/results/vs_llama.json.

The baseline is a `transformers.LlamaForCausalLM` built locally with random weights: the same hidden size
(128), layers (8), attention heads (4 x 32), vocab (4096) and an untied head, with the MLP width chosen so
that its parameter count equals Odyssey tiny's ACTIVE count (2.50M: every parameter a token touches, routed
experts at k/n). Both run fp32 on the CPU with the same number of torch threads.

Rows (tokens per second, median over rounds with min and max; every round runs Odyssey then Llama, so both
see the same machine load, and the ratio of a row is the median of the per-round ratios):

- decode at batch 1, 8, 32: `TorchEngine.generate` vs `LlamaForCausalLM.generate` (HF's KV cache), each
  sequence a 32-token prompt and 64 sampled tokens (temperature 1, no top-k / top-p, fixed seeds, no stop
  token); tokens/s = generated tokens / wall time of the whole call (prefill of the prompts included);
- training forward + backward at 8 x 256 (Odyssey packed with cu_seqlens, Llama [8, 256]), 1 x 4K, 1 x 16K and
  1 x 64K: `model(ids, labels=ids).loss.backward()` from zeroed grads, train mode;
- prefill at 1 x 16K: one no-grad forward (eval mode), logits at every position for both.

Each row also records the process CPU time per call (`*_cpu_s`): on a loaded machine wall time includes
waiting for a core, CPU time much less so. The 64K rows run in child processes under an address-space limit
(`--max-mem-gib`), so that running out of memory is a recorded failure rather than the end of the bench;
Llama's 64K row runs only if its estimate (16x its 16K time: quadratic attention) fits `--budget-s`.

Targets (issue 19): >= 1x the Llama on every row at T <= 4K, >= 2x on the training and prefill rows at
T >= 16K. The JSON records the load average before and after.

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
import subprocess
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


def build(max_len: int) -> tuple[OdysseyForCausalLM, LlamaForCausalLM, int]:
    cfg = OdysseyConfig.from_preset("tiny")
    torch.manual_seed(0)
    ours = OdysseyForCausalLM(cfg)
    llama, active = llama_like(cfg, max_len)
    return ours, llama, active


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def rounds_of(fn_ours, fn_llama, n_rounds: int) -> tuple[list, list]:
    """(wall, cpu) seconds of each fn per round (ours then Llama in every round), after one untimed call."""
    fn_ours(), fn_llama()
    t_ours, t_llama = [], []
    for _ in range(n_rounds):
        t_ours.append(timed(fn_ours))
        t_llama.append(timed(fn_llama))
    return t_ours, t_llama


def summarise(name: str, tokens: int, t_ours: list, t_llama: list, target: float, failure: str = "") -> dict:
    def rate(ts):
        r = [tokens / w for w, _ in ts]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)}

    row = {"row": name, "tokens": tokens, "rounds": len(t_ours), "target": target,
           "odyssey_tok_s": rate(t_ours), "odyssey_seconds": [w for w, _ in t_ours],
           "odyssey_cpu_s": [c for _, c in t_ours]}
    if t_llama:
        ratios = [tl[0] / to[0] for to, tl in zip(t_ours, t_llama)]
        cpu_ratios = [tl[1] / to[1] for to, tl in zip(t_ours, t_llama)]
        row |= {"llama_tok_s": rate(t_llama), "llama_seconds": [w for w, _ in t_llama],
                "llama_cpu_s": [c for _, c in t_llama],
                "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                "cpu_time_ratio": statistics.median(cpu_ratios)}
        row["target_met"] = row["ratio"]["median"] >= target
        r = row["ratio"]
        shown = (f"{r['median']:5.2f}x (rounds {r['min']:.2f}-{r['max']:.2f}, "
                 f"CPU-time ratio {row['cpu_time_ratio']:.2f})")
    else:
        row |= {"llama_failure": failure, "target_met": None}
        shown = f"llama: {failure}"
    print(f"{name:16s} odyssey {row['odyssey_tok_s']['median']:8.0f} tok/s   llama "
          f"{row.get('llama_tok_s', {}).get('median', 0):8.0f} tok/s   {shown}", flush=True)
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


def train_inputs(vocab: int, batch: int, seqlen: int):
    ids = torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(seqlen))
    return ids, ids.reshape(-1), torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)


def train_name(batch: int, seqlen: int) -> str:
    return f"train {batch}x{seqlen // 1024}K" if seqlen >= 1024 else f"train {batch}x{seqlen}"


def bench_train(ours, llama, batch: int, seqlen: int, n_rounds: int) -> dict:
    ours.train(), llama.train()
    ids, packed, cu = train_inputs(ours.config.vocab_size, batch, seqlen)
    t_o, t_l = rounds_of(lambda: train_step(ours, packed, cu), lambda: train_step(llama, ids, None), n_rounds)
    ours.zero_grad(set_to_none=True), llama.zero_grad(set_to_none=True)
    return summarise(train_name(batch, seqlen), batch * seqlen, t_o, t_l, 2.0 if seqlen >= 16384 else 1.0)


def bench_prefill(ours, llama, seqlen: int, n_rounds: int) -> dict:
    ours.eval(), llama.eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(1))

    def run(model):
        with torch.inference_mode():
            model(ids)

    t_o, t_l = rounds_of(lambda: run(ours), lambda: run(llama), n_rounds)
    return summarise(f"prefill 1x{seqlen // 1024}K", seqlen, t_o, t_l, 2.0)


def bench_attention(ours, llama, seqlen: int, n_rounds: int) -> dict:
    """One gated MLA layer of `tiny` against one Llama attention layer (same hidden size and heads; rotary
    embeddings included), forward + backward over 1 x seqlen tokens: the quadratic quarter of the model,
    per layer (issue 19: "no slower per layer than Llama's attention")."""
    mla = ours.model.layers[ours.config.layer_types.index("mla")].mixer.train()
    attn = llama.model.layers[0].self_attn.train()
    D = ours.config.hidden_size
    x = torch.randn(seqlen, D, generator=torch.Generator().manual_seed(seqlen)) * 0.5
    r = torch.randn(seqlen, D, generator=torch.Generator().manual_seed(seqlen + 1))
    cu = torch.tensor([0, seqlen], dtype=torch.int32)
    pos = torch.arange(seqlen)[None]
    rope = llama.model.rotary_emb(x[None], pos)

    def ours_step():
        mla.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        (mla(xi, cu)[0] * r).sum().backward()

    def llama_step():
        attn.zero_grad(set_to_none=True)
        xi = x[None].clone().requires_grad_()
        (attn(xi, position_embeddings=rope, attention_mask=None)[0][0] * r).sum().backward()

    t_o, t_l = rounds_of(ours_step, llama_step, n_rounds)
    return summarise(f"attention layer 1x{seqlen // 1024}K", seqlen, t_o, t_l, 1.0)


def single_train_step(which: str, seqlen: int, threads: int) -> dict:
    """Child process: one untimed-free fwd+bwd of one model at 1 x seqlen (the first call is the measurement:
    at 64K a warm-up call would double the cost). Prints and returns {wall, cpu, max_rss_GiB}."""
    torch.set_num_threads(threads)
    ours, llama, _ = build(seqlen + 1)
    model = ours if which == "odyssey" else llama
    model.train()
    ids, packed, cu = train_inputs(ours.config.vocab_size, 1, seqlen)
    wall, cpu = timed(lambda: train_step(model, packed, cu) if which == "odyssey" else
                      train_step(model, ids, None))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return {"wall": wall, "cpu": cpu, "max_rss_GiB": rss}


def run_isolated(which: str, seqlen: int, threads: int, max_mem_gib: float, timeout_s: float) -> dict:
    """single_train_step in a child process with an address-space limit; {'error': why} if it fails."""
    def limit():
        cap = int(max_mem_gib * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    cmd = [sys.executable, str(Path(__file__).resolve()), "--single", f"{which}:{seqlen}",
           "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=limit,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"failed under a {max_mem_gib:g} GiB address-space limit: {tail[:300]}"}
    return json.loads(lines[-1])


def bench_train_64k(threads: int, max_mem_gib: float, llama_16k_s: float | None, budget_s: float) -> dict:
    seqlen = 65536
    name = train_name(1, seqlen)
    ours = run_isolated("odyssey", seqlen, threads, max_mem_gib, timeout_s=budget_s + 600)
    if "error" in ours:
        print(f"{name:16s} odyssey failed: {ours['error']}", flush=True)
        return {"row": name, "tokens": seqlen, "target": 2.0, "odyssey_failure": ours["error"],
                "target_met": None}
    t_ours = [(ours["wall"], ours["cpu"])]
    mem = {"odyssey_max_rss_GiB": ours["max_rss_GiB"]}
    est = 16 * llama_16k_s if llama_16k_s else None
    if est is None or est > budget_s:
        why = "not run: " + (f"estimated {est:.0f} s for one fwd+bwd (16 x its 16K row: quadratic "
                             f"attention) exceeds the budget of {budget_s:.0f} s" if est else
                             "no 16K row to estimate from")
        return summarise(name, seqlen, t_ours, [], 2.0, why) | mem
    llama = run_isolated("llama", seqlen, threads, max_mem_gib, timeout_s=2 * est + 300)
    if "error" in llama:
        return summarise(name, seqlen, t_ours, [], 2.0, llama["error"]) | mem
    return summarise(name, seqlen, t_ours, [(llama["wall"], llama["cpu"])], 2.0) | mem | {
        "llama_max_rss_GiB": llama["max_rss_GiB"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 round per row, no 16K/64K rows (smoke run)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both models")
    ap.add_argument("--rows", default="decode,train,prefill,attention",
                    help="comma list of row groups to run; a subset updates those rows of --out in place")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="run Llama's 64K training row only if its estimated time fits this")
    ap.add_argument("--max-mem-gib", type=float, default=14.0, help="address-space limit of each 64K row")
    ap.add_argument("--single", help=argparse.SUPPRESS)  # child process of a 64K row: "odyssey:65536"
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_llama.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        which, seqlen = args.single.split(":")
        print(json.dumps(single_train_step(which, int(seqlen), args.threads)), flush=True)
        return 0
    groups = set(args.rows.split(","))
    t_start, load0 = time.time(), os.getloadavg()[0]
    ours, llama, active = build(1 << 17)
    n_llama = sum(p.numel() for p in llama.parameters())
    print(f"odyssey tiny active {active:,} params; llama {n_llama:,} params "
          f"(intermediate {llama.config.intermediate_size}); {torch.get_num_threads()} threads", flush=True)
    rows = []
    if "decode" in groups:
        for b in (1, 8, 32):
            rows.append(bench_decode(ours, llama, b, 1 if args.quick else 5))
    if "train" in groups:
        rows.append(bench_train(ours, llama, 8, 256, 1 if args.quick else 5))
        rows.append(bench_train(ours, llama, 1, 4096, 1 if args.quick else 3))
        if not args.quick:
            r16 = bench_train(ours, llama, 1, 16384, 2)
            rows.append(r16)
            llama_16k = statistics.median(r16["llama_seconds"])
            rows.append(bench_train_64k(args.threads, args.max_mem_gib, llama_16k, args.budget_s))
    if "prefill" in groups:
        rows.append(bench_prefill(ours, llama, 4096 if args.quick else 16384, 1 if args.quick else 3))
    if "attention" in groups:
        for seqlen in (4096,) if args.quick else (4096, 16384):
            rows.append(bench_attention(ours, llama, seqlen, 1 if args.quick else 3))
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
    for r in rows:
        r["measured"] = {"at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_avg_1m": load0}
    out = Path(args.out)
    if groups != {"decode", "train", "prefill", "attention"} and out.exists():  # a subset: update in place
        old = json.loads(out.read_text())
        fresh = {r["row"] for r in rows}
        res["rows"] = [r for r in old["rows"] if r["row"] not in fresh] + rows
        res["machine"] = old["machine"] | {f"rows {args.rows}": res["machine"]}
        res["wall_s"] = old.get("wall_s")
    res["summary"] = {r["row"]: round(r["ratio"]["median"], 3) if "ratio" in r else
                      r.get("llama_failure") or r.get("odyssey_failure") for r in res["rows"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=2))
    print(f"wrote {args.out} in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
