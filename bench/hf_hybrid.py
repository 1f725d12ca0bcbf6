"""Hybrid HF checkpoints (small, random) on Odyssey's kernels (HFPolicy, model/hf_linear_attention.py) vs
transformers' own CPU path -> bench/results/hf_hybrid.json (one entry per model; the others are kept).

Models: `kimi_linear` (KDA + MLA, MoE) and `qwen3_next` (Gated DeltaNet + gated attention, MoE). Same
checkpoint, same tokens, same run, same threads, fp32 CPU. N sequences of L tokens each:
- learner (forward + backward of the token log-probs):
  - odyssey: HFPolicy.token_logprobs over ONE packed row (cu_seqlens; per-sequence state resets in the short
    convs and recurrences, per-sequence SDPA in the full-attention layers), backward;
  - transformers: the unpatched model on a [N, L] batch (equal lengths, so no padding and no mask: its
    fastest correct call; a packed row would leak state), with its torch reference kernels (fla's Triton
    kernels do not run on CPU), log-softmax of the same targets, backward.
- decode (both models; greedy, --decode-rows prompts of --prompt tokens, --new tokens each):
  - odyssey: TorchEngine on the HFPolicy (per-row conv + recurrent state, prefill by the chunkwise kernel,
    decode steps of all rows in one forward: qwen3_next by the token-step kernel of model/gated_delta.py,
    kimi_linear by the KDA C++ CPU kernels with MLA rows in the packed KV cache);
  - transformers: `generate` on the same prompts as one [rows, prompt] batch (its DynamicCache, conv-update
    and recurrent decode kernels, torch reference path), greedy.
  Decode tokens/s = rows * new / median seconds of the whole generation (prefill included); the two greedy
  outputs must agree token for token (recorded).
Tokens/s = N * L / median time of --reps runs (after one warm-up; the two paths' runs alternate, so load
changes on a shared machine hit both). Also recorded: the largest difference of
the two log-prob vectors (~1e-6: the same function) and the ratios odyssey / transformers.

    .venv/bin/python bench/hf_hybrid.py [--models kimi_linear,qwen3_next] [--seqs 4] [--len 512] [--reps 3]
        [--parts learner,decode]   (a part left out keeps that model's recorded numbers for it)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.hf_linear_attention import transformers_reference_kernels  # noqa: E402
from model.hf_policy import HFPolicy  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "hf_hybrid.json"
VOCAB = 4096


def make_kimi_linear(path: Path) -> dict:
    """A small random Kimi Linear: hidden 256, 4 layers [KDA, KDA, KDA, MLA] (Kimi's 3:1), KDA 4 heads x 64,
    MLA 4 heads (latent 64), first FFN dense, the rest MoE (8 experts, top-2, 1 shared)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                 q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=64, qk_nope_head_dim=48,
                 num_local_experts=8, num_experts_per_tok=2, linear_head_dim=64, linear_num_heads=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    KimiLinearForCausalLM(KimiLinearConfig(**shape, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                           max_position_embeddings=8192)).save_pretrained(str(path))
    return shape


def make_qwen3_next(path: Path) -> dict:
    """A small random Qwen3-Next: hidden 256, 4 layers [GDN, GDN, GDN, gated attention] (its 3:1), GDN 2 key /
    4 value heads x 64, attention 4 query / 2 KV heads x 64 with partial rope (1/4), MoE (8 experts, top-2, a
    gated shared expert) in every layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
                 num_experts_per_tok=2, layer_types=["linear_attention"] * 3 + ["full_attention"])
    Qwen3NextForCausalLM(Qwen3NextConfig(**shape, max_position_embeddings=8192, pad_token_id=None,
                                         bos_token_id=None, eos_token_id=None)).save_pretrained(str(path))
    return shape


MAKERS = {"kimi_linear": make_kimi_linear, "qwen3_next": make_qwen3_next}


def paired_times(fa, fb, reps: int) -> tuple[float, object, float, object]:
    """Median seconds and last output of fa and of fb over `reps` runs each, after one warm-up of each
    (kernel builds, allocator), the runs ALTERNATING (fa, fb, fa, fb, ...) so that a change of load on a
    shared machine falls on both paths alike."""
    fa(), fb()
    ta, tb, oa, ob = [], [], None, None
    for _ in range(reps):
        t = time.perf_counter()
        oa = fa()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        ob = fb()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), oa, statistics.median(tb), ob


def learner(model_type: str, policy: HFPolicy, ref: torch.nn.Module, N: int, L: int, reps: int) -> dict:
    """Forward + backward of the token log-probs, odyssey (one packed row) vs transformers ([N, L] batch)."""
    ids = torch.randint(0, VOCAB, (N, L), generator=torch.Generator().manual_seed(1))
    tg = torch.roll(ids, -1, dims=1)
    cu = torch.arange(0, N * L + 1, L, dtype=torch.int32)
    policy.train()
    ref.train()

    def odyssey() -> torch.Tensor:
        policy.zero_grad(set_to_none=True)
        lp = policy.token_logprobs(ids.flatten(), tg.flatten(), cu)
        lp.sum().backward()
        return lp.detach()

    def transformers_path() -> torch.Tensor:
        ref.zero_grad(set_to_none=True)
        with transformers_reference_kernels(model_type):
            logits = ref(input_ids=ids, use_cache=False).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tg[..., None]).squeeze(-1).flatten()
        lp.sum().backward()
        return lp.detach()

    t_ody, lp_ody, t_hf, lp_hf = paired_times(odyssey, transformers_path, reps)
    return {
        "sequences": N, "tokens_per_sequence": L,
        "rows": {"odyssey_kernels": {"seconds": t_ody, "tokens_per_s": N * L / t_ody},
                 "transformers_cpu": {"seconds": t_hf, "tokens_per_s": N * L / t_hf}},
        "speedup_odyssey_over_transformers": t_hf / t_ody,
        "max_abs_logprob_diff": (lp_ody - lp_hf).abs().max().item(),
    }


@torch.no_grad()
def decode(model_type: str, policy: HFPolicy, ref: torch.nn.Module, rows: int, prompt: int, new: int,
           reps: int) -> dict:
    """Greedy generation of `new` tokens after `rows` prompts: TorchEngine vs transformers' generate."""
    from rl.rollout.engine import GenerationRequest, TorchEngine
    from rl.rollout.sampling import SamplingParams

    policy.eval()
    ref.eval()
    prompts = torch.randint(10, VOCAB, (rows, prompt), generator=torch.Generator().manual_seed(2))
    engine = TorchEngine(policy, max_batch_size=rows)

    def odyssey() -> list[list[int]]:
        reqs = [GenerationRequest(p.tolist(), SamplingParams(temperature=0, max_new_tokens=new))
                for p in prompts]
        return [r.token_ids for r in engine.generate(reqs)]

    def transformers_path() -> list[list[int]]:
        with transformers_reference_kernels(model_type):
            out = ref.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0)
        return out[:, prompt:].tolist()

    t_ody, out_ody, t_hf, out_hf = paired_times(odyssey, transformers_path, reps)
    return {
        "rows": rows, "prompt_tokens": prompt, "new_tokens": new,
        "paths": {"odyssey_torch_engine": {"seconds": t_ody, "tokens_per_s": rows * new / t_ody},
                  "transformers_generate": {"seconds": t_hf, "tokens_per_s": rows * new / t_hf}},
        "speedup_odyssey_over_transformers": t_hf / t_ody,
        "greedy_tokens_equal": out_ody == out_hf,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="kimi_linear,qwen3_next")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--parts", default="learner,decode",
                    help="which parts to run; a part left out keeps the model's recorded entry for it")
    args = ap.parse_args()
    parts = {p for p in args.parts.split(",") if p}
    if not parts or parts - {"learner", "decode"}:
        raise SystemExit(f"--parts: {args.parts!r}; choose from learner, decode (comma separated)")
    torch.set_num_threads(args.threads)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MAKERS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(MAKERS)}")
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if "rows" in results:  # the earlier single-model (kimi_linear) layout: keep it as that model's entry
        results = {"kimi_linear": results}
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__}
    for model_type in models:
        with tempfile.TemporaryDirectory() as tmp:
            shape = MAKERS[model_type](Path(tmp))
            policy = HFPolicy.from_pretrained(tmp)
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(tmp)  # its default (sdpa) attention
        entry = dict(results.get(model_type, {}))
        if "learner" in parts:
            entry.update({"what": f"learner forward+backward (token log-probs, sum, backward), fp32 CPU, "
                                  f"random {model_type}", "model": shape, "threads": args.threads,
                          "reps": args.reps,
                          **learner(model_type, policy, ref, args.seqs, args.len, args.reps),
                          "machine": machine})
        elif entry.get("model") not in (None, shape):
            raise SystemExit(f"{model_type}: the recorded learner entry is for another model shape; rerun "
                             "with --parts learner,decode")
        if "decode" in parts:
            entry["decode"] = {**decode(model_type, policy, ref, args.decode_rows, args.prompt, args.new,
                                        args.reps), "threads": args.threads, "reps": args.reps,
                               "machine": machine}
        results[model_type] = entry
        if "learner" in parts:
            print(f"{model_type}: learner {args.seqs} x {args.len} tokens")
            print(f"  {'path':<24}{'seconds':>10}{'tokens/s':>12}")
            for name, r in entry["rows"].items():
                print(f"  {name:<24}{r['seconds']:>10.3f}{r['tokens_per_s']:>12.0f}")
            print(f"  odyssey / transformers: {entry['speedup_odyssey_over_transformers']:.2f}x  "
                  f"(max |log-prob diff| {entry['max_abs_logprob_diff']:.1e})")
        if "decode" in parts:
            d = entry["decode"]
            print(f"{model_type}: greedy decode, {d['rows']} rows x {d['new_tokens']} new tokens after "
                  f"{d['prompt_tokens']}")
            for name, r in d["paths"].items():
                print(f"  {name:<24}{r['seconds']:>10.3f}{r['tokens_per_s']:>12.1f}")
            print(f"  odyssey / transformers: {d['speedup_odyssey_over_transformers']:.2f}x  (greedy tokens "
                  f"equal: {d['greedy_tokens_equal']})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
