"""Learner forward + backward on a small random `kimi_linear` HF checkpoint: Odyssey's KDA kernels (HFPolicy,
model/hf_linear_attention.py) vs transformers' own CPU path -> bench/results/hf_hybrid.json.

Same checkpoint, same tokens, same run, same threads, fp32 CPU. N sequences of L tokens each:
- odyssey: HFPolicy.token_logprobs over ONE packed row (cu_seqlens; per-sequence state resets in the
  short convs and recurrences: the fused CPU short conv, the C++ recurrence with its own backward), backward;
- transformers: the unpatched model on a [N, L] batch (equal lengths, so no padding and no mask: its
  fastest correct call; a packed row would leak state), with its torch reference kernels
  (`chunk_kimi_delta_attention`, `causal_conv1d_fn`: fla's Triton kernels do not run on CPU), log-softmax
  of the same targets, backward.
Tokens/s = N * L / median time of --reps runs (after one warm-up). Also recorded: the largest difference of
the two log-prob vectors (must be ~1e-6: the same function) and the ratio odyssey / transformers.

    .venv/bin/python bench/hf_hybrid.py [--seqs 4] [--len 512] [--reps 3] [--threads 1]
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


def make_checkpoint(path: Path) -> dict:
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


def median_time(fn, reps: int) -> tuple[float, torch.Tensor]:
    fn()  # warm-up (kernel builds, allocator)
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    N, L = args.seqs, args.len
    with tempfile.TemporaryDirectory() as tmp:
        shape = make_checkpoint(Path(tmp))
        policy = HFPolicy.from_pretrained(tmp).train()
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(tmp).train()  # its default (sdpa) attention
    ids = torch.randint(0, VOCAB, (N, L), generator=torch.Generator().manual_seed(1))
    tg = torch.roll(ids, -1, dims=1)
    cu = torch.arange(0, N * L + 1, L, dtype=torch.int32)

    def odyssey() -> torch.Tensor:
        policy.zero_grad(set_to_none=True)
        lp = policy.token_logprobs(ids.flatten(), tg.flatten(), cu)
        lp.sum().backward()
        return lp.detach()

    def transformers_path() -> torch.Tensor:
        ref.zero_grad(set_to_none=True)
        with transformers_reference_kernels("kimi_linear"):
            logits = ref(input_ids=ids, use_cache=False).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tg[..., None]).squeeze(-1).flatten()
        lp.sum().backward()
        return lp.detach()

    t_ody, lp_ody = median_time(odyssey, args.reps)
    t_hf, lp_hf = median_time(transformers_path, args.reps)
    rows = {
        "odyssey_kernels": {"seconds": t_ody, "tokens_per_s": N * L / t_ody},
        "transformers_cpu": {"seconds": t_hf, "tokens_per_s": N * L / t_hf},
    }
    result = {
        "what": "learner forward+backward (token log-probs, sum, backward), fp32 CPU, random kimi_linear",
        "model": shape,
        "sequences": N, "tokens_per_sequence": L, "threads": args.threads, "reps": args.reps,
        "rows": rows,
        "speedup_odyssey_over_transformers": t_hf / t_ody,
        "max_abs_logprob_diff": (lp_ody - lp_hf).abs().max().item(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'path':<20}{'seconds':>10}{'tokens/s':>12}")
    for name, r in rows.items():
        print(f"{name:<20}{r['seconds']:>10.3f}{r['tokens_per_s']:>12.0f}")
    print(f"odyssey / transformers: {result['speedup_odyssey_over_transformers']:.2f}x  "
          f"(max |log-prob diff| {result['max_abs_logprob_diff']:.1e})  -> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
