"""VllmEngine vs TorchEngine -> bench/results/vllm_engine.json (ratios measured in the same run).

1. agent loop: `arith` episodes (RolloutWorker, real Docker sandboxes, the same episode seeds, so the same
   tasks and prompts) at concurrency 8 and 32, on the tiny and small presets, each with both engines;
   generated tokens per second of wall time, and where the time goes (vLLM: engine steps, the model
   runner's execute_model, the model's forward; TorchEngine: its forwards; the rest is the agent loop:
   env steps, tokenisation, sandboxes);
2. sessions: the tiny agent loop at concurrency 8 with vLLM's prefix cache on (continuations re-send the
   conversation and hit the session's own blocks) and off (every turn re-prefills everything);
3. engine start seconds and weight-update seconds (state_dict -> engine, in place) for both engines;
4. (not the agent loop) single-turn decode of 32 requests together: decode-dominated batches; on tiny
   also a peer: vLLM serving a dense Llama of the same active size with its own model code, eager and
   compiled (vLLM's CPU compile path: Dynamo + Inductor), each in a fresh process, same prompts.

One intra-op thread for both engines (vLLM sets it for serving on this machine; TorchEngine gets the same).
The machine is shared: each comparison is repeated in rounds that alternate which engine runs first, and
reported as the median per-round ratio, of wall-clock tokens/s and of tokens per CPU-second of this
process (less sensitive to other processes' load).

    .venv/bin/python bench/vllm_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl.policy import build_policy  # noqa: E402
from rl.rollout.agent_loop import EpisodeConfig  # noqa: E402
from rl.rollout.engine import TorchEngine  # noqa: E402
from rl.rollout.worker import RolloutWorker, WorkerSettings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "vllm_engine.json"


def settings_for(preset: str, concurrency: int, new_tokens: int, turns: int) -> WorkerSettings:
    return WorkerSettings(
        env_id="arith",
        env_kwargs={"difficulty": 1, "max_turns": turns},
        model_preset=preset,
        concurrency=concurrency,
        sandbox_pool_size=4,
        episode=EpisodeConfig(max_new_tokens=new_tokens, max_turns=turns, max_episode_tokens=2048),
        rewards=[{"name": "outcome", "weight": 1.0}],
        max_batch_size=64,
    )


def run_agent_loop(settings: WorkerSettings, engine, episodes: int) -> dict:
    """The first `episodes` tasks, one sample each, on `engine` (sandbox pool warmed before the clock
    starts)."""
    from rl.rollout.tasks import TaskStream

    worker = RolloutWorker(settings, engine=engine)
    stats0 = dict(engine.stats)
    timing0 = engine.worker_timing() if hasattr(engine, "worker_timing") else None

    async def go():
        try:
            await worker._ensure_pool()
            t, c = time.perf_counter(), time.process_time()
            rep = await worker.run(TaskStream(base_seed=0).first_samples(episodes, group_size=1))
            return time.perf_counter() - t, time.process_time() - c, rep
        finally:
            await worker.close()

    wall, cpu, rep = asyncio.run(go())
    out = {
        "episodes": episodes,
        "wall_s": wall,
        "cpu_s": cpu,
        "generated_tokens": rep["generated_tokens"],
        "generated_tok_s": rep["generated_tokens"] / wall,
        "generated_tok_per_cpu_s": rep["generated_tokens"] / cpu,
        "episodes_per_s": episodes / wall,
        "turns": rep["turns"],
        "infra_errors": rep["infra_errors"],
    }
    step_s = engine.stats["forward_s"] - stats0["forward_s"]
    if timing0 is not None:
        t1 = engine.worker_timing()
        forward = t1["forward_s"] - timing0["forward_s"]
        execute = t1["execute_model_s"] - timing0["execute_model_s"]
        out["time_split_s"] = {
            "engine_steps": step_s,
            "model_forward": forward,
            "runner_outside_forward": execute - forward,  # input prep, sampling, bookkeeping
            "engine_outside_runner": step_s - execute,  # scheduler, output processing, our stop/flush logic
            "agent_loop_and_env": wall - step_s,
        }
        out["prefill_tokens"] = engine.stats["prefill_tokens"] - stats0["prefill_tokens"]
        out["prefix_cache_hit_tokens"] = engine.stats["cached_tokens"] - stats0["cached_tokens"]
    else:
        out["time_split_s"] = {"model_forward": step_s, "agent_loop_and_env": wall - step_s}
        out["prefill_tokens"] = engine.stats["prefill_tokens"] - stats0["prefill_tokens"]
    return out


def paired(settings: WorkerSettings, torch_engine, vllm_engine, episodes: int, repeats: int) -> dict:
    """`repeats` rounds of the same episodes on both engines, alternating which goes first; the ratios
    are medians of the per-round ratios (the machine is shared: a round's two runs see similar load)."""
    rounds = []
    for i in range(repeats):
        order = [("torch", torch_engine), ("vllm", vllm_engine)][:: 1 - 2 * (i % 2)]
        runs = {name: run_agent_loop(settings, eng, episodes) for name, eng in order}
        rounds.append(runs)
    wall = [r["vllm"]["generated_tok_s"] / r["torch"]["generated_tok_s"] for r in rounds]
    cpu = [r["vllm"]["generated_tok_per_cpu_s"] / r["torch"]["generated_tok_per_cpu_s"] for r in rounds]
    return {
        "vllm_vs_torch_generated_tok_s": statistics.median(wall),
        "vllm_vs_torch_tok_per_cpu_s": statistics.median(cpu),
        "per_round_wall_ratio": wall,
        "per_round_cpu_ratio": cpu,
        "rounds": rounds,
    }


def warm_up(engine) -> None:
    from rl.rollout.engine import GenerationRequest
    from rl.rollout.sampling import SamplingParams

    for n in (1, 3, 8):
        engine.generate([GenerationRequest([16, 17, 18], SamplingParams(max_new_tokens=4))] * n)


def single_turn_prompts(vocab: int, n: int = 32) -> list[list[int]]:
    """n prompts of 100..300 random tokens (the same in every process: seeded)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(16, vocab, (100 + 200 * i // n,), generator=g).tolist() for i in range(n)]


def median_rate(run, repeats: int = 3) -> dict:
    """run() -> generated tokens; median and all of `repeats` generated tok/s (after one warm-up call)."""
    run()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        rates.append(run() / (time.perf_counter() - t))
    return {"tok_s": statistics.median(rates), "rounds": rates}


def single_turn(torch_engine, vllm_engine, vocab: int, peer: bool, new: int = 64) -> dict:
    """Not the agent loop: 32 single-turn requests (prompts of 100..300 tokens) decoded together for `new`
    tokens, i.e. decode-dominated batches with no session continuations. With `peer`, the same prompts on
    vLLM serving a dense Llama of the same active size (vLLM's own model code, eager and compiled; each in a
    fresh process): what vLLM does on this CPU with a model it knows."""
    from rl.rollout.engine import GenerationRequest
    from rl.rollout.sampling import SamplingParams

    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=new)) for p in single_turn_prompts(vocab)]
    out = {}
    for name, eng in (("torch", torch_engine), ("vllm", vllm_engine)):
        r = median_rate(lambda eng=eng: sum(len(x.token_ids) for x in eng.generate(reqs)))
        out[f"{name}_generated_tok_s"], out[f"{name}_rounds"] = r["tok_s"], r["rounds"]
    out["vllm_vs_torch"] = out["vllm_generated_tok_s"] / out["torch_generated_tok_s"]
    if peer:
        for mode in ("eager", "compiled"):
            proc = subprocess.run([sys.executable, __file__, "--llama-peer", mode, "--new", str(new)],
                                  capture_output=True, text=True, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEER ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"dense Llama peer ({mode}) failed:\n{proc.stderr[-3000:]}")
            peer_out = json.loads(lines[-1][5:])
            out[f"dense_llama_vllm_{mode}"] = peer_out
            for name in ("torch", "vllm"):
                out[f"{name}_vs_dense_llama_vllm_{mode}"] = out[f"{name}_generated_tok_s"] / peer_out["tok_s"]
    return out


def llama_peer(mode: str, new: int) -> dict:
    """In its own process: vLLM serving `bench/vs_llama.py`'s dense Llama of tiny's active size (random
    weights) on `single_turn_prompts`, `enforce_eager` (mode 'eager') or vLLM's compiled CPU path
    (Dynamo + Inductor, mode 'compiled'); temperature 1 with processed log-probs, as VllmEngine asks."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt
    from vs_llama import llama_like

    from model.config import OdysseyConfig

    cfg = OdysseyConfig.from_preset("tiny")
    llama, active = llama_like(cfg, 2048)
    with tempfile.TemporaryDirectory() as d:
        llama.save_pretrained(d)
        t = time.perf_counter()
        llm = LLM(model=d, skip_tokenizer_init=True, enforce_eager=mode == "eager", max_model_len=2048,
                  max_num_seqs=64, dtype="float32", logprobs_mode="processed_logprobs", seed=0)
        start = time.perf_counter() - t
        sp = VllmSamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0, logprobs=0,
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in single_turn_prompts(cfg.vocab_size)]
        t = time.perf_counter()
        llm.generate(prompts[:4], sp, use_tqdm=False)  # the compiled path compiles on first use
        first = time.perf_counter() - t
        r = median_rate(lambda: sum(len(o.outputs[0].token_ids)
                                    for o in llm.generate(prompts, sp, use_tqdm=False)))
    return {"mode": mode, "engine_start_s": start, "first_request_s": first, "active_params": active,
            "llama_params": sum(p.numel() for p in llama.parameters()), **r}


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def preset_section(preset: str, concurrencies: list[int], episodes_per: int, new_tokens: int, turns: int,
                   prefix_cache_off: bool, repeats: int) -> dict:
    from rl.rollout.vllm_engine import VllmEngine

    base = settings_for(preset, concurrencies[0], new_tokens, turns)
    t = time.perf_counter()
    policy = build_policy(base)
    torch_engine = TorchEngine(policy, max_batch_size=64)
    torch_start = time.perf_counter() - t
    out: dict = {"preset": preset}
    with tempfile.TemporaryDirectory() as d:
        policy.save_pretrained(d)
        t = time.perf_counter()
        vllm_engine = VllmEngine(d, max_num_seqs=64, max_model_len=2050)
        out["engine_start_s"] = {"vllm": time.perf_counter() - t, "vllm_llm_init": vllm_engine.start_s,
                                 "torch": torch_start}
        t = time.perf_counter()
        warm_up(vllm_engine)  # first requests compile vLLM's sampler ops (torch.compile): not a rollout cost
        out["engine_start_s"]["vllm_first_request"] = time.perf_counter() - t
        warm_up(torch_engine)
        sd = {k: v.clone() for k, v in policy.state_dict().items()}
        out["weight_update_s"] = {
            "vllm": timed(lambda: vllm_engine.update_weights(sd, 1)),
            "torch": timed(lambda: torch_engine.update_weights(sd, 1)),
            "n_params": sum(v.numel() for v in sd.values()),
        }
        for c in concurrencies:
            s = settings_for(preset, c, new_tokens, turns)
            out[f"concurrency_{c}"] = paired(s, torch_engine, vllm_engine, episodes_per * c, repeats)
            r = out[f"concurrency_{c}"]
            print(f"{preset} c={c}: vllm/torch generated tok/s x{r['vllm_vs_torch_generated_tok_s']:.2f} "
                  f"(per CPU second x{r['vllm_vs_torch_tok_per_cpu_s']:.2f})", flush=True)
        vocab = policy.config.vocab_size
        out["single_turn_decode_concurrency_32"] = single_turn(torch_engine, vllm_engine, vocab,
                                                               peer=preset == "tiny")
        vllm_engine.shutdown()
        if prefix_cache_off:
            # the same episodes with the prefix cache off: every turn re-prefills the whole conversation.
            # Compared with the prefix-cache-on rounds above and with TorchEngine (which feeds only new
            # tokens), paired with a TorchEngine run of its own round for the load correction
            no_cache = VllmEngine(d, max_num_seqs=64, max_model_len=2050, enable_prefix_caching=False)
            warm_up(no_cache)
            c = concurrencies[0]
            s = settings_for(preset, c, new_tokens, turns)
            off = paired(s, torch_engine, no_cache, episodes_per * c, repeats)
            no_cache.shutdown()
            on = out[f"concurrency_{c}"]
            out["sessions_prefix_cache"] = {
                "concurrency": c,
                "prefix_cache_on_vs_torch_tok_per_cpu_s": on["vllm_vs_torch_tok_per_cpu_s"],
                "prefix_cache_off_vs_torch_tok_per_cpu_s": off["vllm_vs_torch_tok_per_cpu_s"],
                "prefix_cache_on_vs_torch_tok_s": on["vllm_vs_torch_generated_tok_s"],
                "prefix_cache_off_vs_torch_tok_s": off["vllm_vs_torch_generated_tok_s"],
                "prefill_tokens_on": on["rounds"][0]["vllm"]["prefill_tokens"],
                "prefill_tokens_off": off["rounds"][0]["vllm"]["prefill_tokens"],
                "prefill_tokens_torch": on["rounds"][0]["torch"]["prefill_tokens"],
                "hit_tokens_on": on["rounds"][0]["vllm"]["prefix_cache_hit_tokens"],
                "off_rounds": off["rounds"],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer episodes (smoke run)")
    ap.add_argument("--llama-peer", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.llama_peer:  # the dense Llama peer's own process (single_turn)
        print("PEER " + json.dumps(llama_peer(args.llama_peer, args.new)), flush=True)
        return
    episodes_per, repeats = (1, 1) if args.quick else (2, 3)
    t0 = time.perf_counter()
    tiny = preset_section("tiny", [8, 32], episodes_per, new_tokens=64, turns=3, prefix_cache_off=True,
                          repeats=repeats)
    small = preset_section("small", [8, 32], 1, new_tokens=32, turns=2, prefix_cache_off=False,
                           repeats=max(1, repeats - 1))
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": 1,
                    "note": "shared 2-core machine; ratios are measured in the same run"},
        "target": "vllm_vs_torch_generated_tok_s >= 2 on CPU",
        "tiny": tiny,
        "small": small,
        "total_s": time.perf_counter() - t0,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {c: [v[c]["vllm_vs_torch_generated_tok_s"], v[c]["vllm_vs_torch_tok_per_cpu_s"]]
                          for c in v if c.startswith("concurrency")}
                      for k, v in (("tiny", tiny), ("small", small))}, indent=2))
    st = tiny["single_turn_decode_concurrency_32"]
    print("single turn, tiny: tok/s torch {:.0f}, vllm {:.0f}, dense Llama on vLLM eager {:.0f}, "
          "compiled {:.0f}"
          .format(st["torch_generated_tok_s"], st["vllm_generated_tok_s"],
                  st["dense_llama_vllm_eager"]["tok_s"], st["dense_llama_vllm_compiled"]["tok_s"]))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
