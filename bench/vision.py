"""Image tokens vs text tokens through the rollout prefill and the learner, and the memory of an episode with
N images -> bench/results/vision.json.

Same model, same run, same token counts (the 1-minute load average before and after each preset is
recorded: on a shared 2-core machine the ratios move with it): each image row has a text twin whose
prompts hold exactly as many tokens, all text (random ids), so a ratio isolates what images cost (the patch
embedding, their ImagePatches through packing and chunked prefill). Rows, per preset (tiny: patch 8,
64x64 -> 74 tokens an image; small: patch 16, 256x256 -> 274):

- prefill: TorchEngine, a batch of prompts with N images each (plus a line of text around each), one new
  token; prompt tokens/s, image vs text twin (median of --reps);
- learner: forward + backward of the summed token log-probs over the same sequences packed into one
  micro-batch (`token_logprobs(..., images=)`), tokens/s, image vs text twin;
- memory: one episode in a fresh process (prefill of a prompt with N images, 32 decoded tokens, then the
  learner's forward + backward on the whole sequence), the process's peak RSS during the episode (VmHWM,
  reset to the current RSS just before it) minus its RSS before, for N in (1, 4, 16), with the text twin
  of each.

    .venv/bin/python bench/vision.py [--reps 3] [--threads 1] [--presets tiny,small]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import OdysseyConfig  # noqa: E402
from model.image import prepare_image  # noqa: E402
from model.modeling import OdysseyForCausalLM  # noqa: E402
from model.tokenizer import encode_chat_images, load_tokenizer  # noqa: E402
from model.vision import ImagePatches  # noqa: E402
from rl.rollout.engine import GenerationRequest, TorchEngine  # noqa: E402
from rl.rollout.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "vision.json"


def build(preset: str) -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset(preset)).eval()


def episode_prompt(model, seed: int, n_images: int) -> tuple[list[int], list]:
    """A user turn with `n_images` random images at the preset's full resolution between text lines:
    (ids, [(offset of <|image_start|>, PreparedImage)])."""
    cfg = model.config
    side = int(cfg.vision_max_pixels**0.5)
    rng = np.random.default_rng(seed)
    parts = [{"type": "text", "text": f"Episode {seed}: look at each image."}]
    for j in range(n_images):
        img = prepare_image(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), cfg.vision_patch_size,
                            cfg.vision_max_pixels)  # fmt: skip
        parts += [{"type": "image", "image": img}, {"type": "text", "text": f"That was image {j}."}]
    messages = [{"role": "user", "content": parts}]
    enc = encode_chat_images(load_tokenizer(), messages, add_generation_prompt=True)
    return list(enc.ids), list(enc.images)


def text_twin(ids: list[int], seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 3000, (len(ids),), generator=g).tolist()


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill_row(model, n_images: int, batch: int, reps: int) -> dict:
    prompts = [episode_prompt(model, s, n_images) for s in range(batch)]
    twins = [text_twin(ids, s) for s, (ids, _) in enumerate(prompts)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    eng = TorchEngine(model, max_batch_size=batch)
    n = sum(len(ids) for ids, _ in prompts)
    t_img = median_time(lambda: eng.generate([GenerationRequest(i, sp, images=m) for i, m in prompts]), reps)
    t_txt = median_time(lambda: eng.generate([GenerationRequest(t, sp) for t in twins]), reps)
    n_img_tokens = sum(img.grid[0] * (img.grid[1] + 1) + 2 for _, ims in prompts for _, img in ims)
    return {"images_per_prompt": n_images, "batch": batch, "prompt_tokens": n, "image_tokens": n_img_tokens,
            "image_tok_s": n / t_img, "text_tok_s": n / t_txt, "image_vs_text": t_txt / t_img}  # fmt: skip


def packed(model, prompts) -> tuple[torch.Tensor, torch.Tensor, ImagePatches | None]:
    ids, offsets, parts, cu = [], [], [], [0]
    p = model.config.vision_patch_size
    for seq, ims in prompts:
        offsets.append(len(ids))
        ids += seq
        cu.append(len(ids))
        if ims:
            parts.append(ImagePatches.from_images([img.pixels for _, img in ims], [o for o, _ in ims], p))
        else:
            parts.append(ImagePatches.empty(p))
    images = ImagePatches.concat(parts, offsets) if any(x.n for x in parts) else None
    return torch.tensor(ids), torch.tensor(cu, dtype=torch.int32), images


def learner_step(model, ids, cu, images) -> None:
    model.zero_grad(set_to_none=True)
    lp = model.token_logprobs(ids[:-1], ids[1:], cu_seqlens=_inputs_cu(cu), images=images)
    lp.sum().backward()


def _inputs_cu(cu: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of ids[:-1] (the last sequence loses its last token)."""
    out = cu.clone()
    out[-1] -= 1
    return out


def learner_row(model, n_images: int, batch: int, reps: int) -> dict:
    prompts = [episode_prompt(model, s, n_images) for s in range(batch)]
    twins = [(text_twin(ids, s), []) for s, (ids, _) in enumerate(prompts)]
    model.train()
    a, b = packed(model, prompts), packed(model, twins)
    n = int(a[0].numel()) - 1
    t_img = median_time(lambda: learner_step(model, *a), reps)
    t_txt = median_time(lambda: learner_step(model, *b), reps)
    model.eval()
    return {"images_per_sequence": n_images, "sequences": batch, "tokens": n, "image_tok_s": n / t_img,
            "text_tok_s": n / t_txt, "image_vs_text": t_txt / t_img}  # fmt: skip


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> float:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: "5" > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def memory_child(preset: str, n_images: int, text: bool) -> dict:
    """In a fresh process: peak RSS of one episode (prefill + 32 decoded tokens + learner step)."""
    model = build(preset)
    ids, ims = episode_prompt(model, 0, n_images)
    if text:
        ids, ims = text_twin(ids, 0), []
    before = _reset_peak()
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, seed=0)
    res = TorchEngine(model).generate([GenerationRequest(ids, sp, images=ims)])[0]
    seq = ids + list(res.token_ids)
    model.train()
    learner_step(model, *packed(model, [(seq, ims)]))
    png = sum(len(img.png) for _, img in ims)
    peak = _status_mib("VmHWM")
    return {"tokens": len(seq), "peak_rss_mib": peak, "episode_mib": peak - before, "png_bytes": png}


def memory_rows(preset: str, counts: tuple[int, ...], threads: int) -> list[dict]:
    rows = []
    for n in counts:
        row = {"images": n}
        for kind in ("image", "text"):
            cmd = [sys.executable, __file__, "--child", preset, str(n), kind, "--threads", str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            row[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        row["image_vs_text_episode_mib"] = row["image"]["episode_mib"] / max(row["text"]["episode_mib"], 1e-9)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--child", nargs=3, metavar=("PRESET", "N", "KIND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        preset, n, kind = args.child
        print(json.dumps(memory_child(preset, int(n), kind == "text")))
        return
    t0 = time.perf_counter()
    # presets not measured in this run keep their rows from the last one (each with its own machine load)
    results: dict = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": args.threads, "cpu": platform.processor() or platform.machine()}
    for preset in args.presets.split(","):
        model = build(preset)
        learner_row(model, 1, 1, 1)  # warm-up (kernel loading, first calls)
        prefill_row(model, 1, 1, 1)
        cfg = model.config
        load_before = os.getloadavg()[0]
        results[preset] = {
            "load_avg_1min_before": load_before,
            "patch_size": cfg.vision_patch_size,
            "max_pixels": cfg.vision_max_pixels,
            "prefill": [prefill_row(model, n, 4, args.reps) for n in (1, 4)],
            "learner": [learner_row(model, n, 4, args.reps) for n in (1, 4)],
            "memory": memory_rows(preset, (1, 4, 16), args.threads),
        }
        results[preset]["load_avg_1min_after"] = os.getloadavg()[0]
        print(f"{preset}: patch {cfg.vision_patch_size}, max pixels {cfg.vision_max_pixels}, load average "
              f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for kind in ("prefill", "learner"):
            for r in results[preset][kind]:
                n = r.get("images_per_prompt", r.get("images_per_sequence"))
                print(f"  {kind:<8} {n:>2} images/seq  {r.get('prompt_tokens', r.get('tokens')):>6} tokens  "
                      f"image {r['image_tok_s']:>8.0f} tok/s  text {r['text_tok_s']:>8.0f} tok/s  "
                      f"image/text {r['image_vs_text']:.2f}x")
        for r in results[preset]["memory"]:
            i, t = r["image"], r["text"]
            print(f"  memory   {r['images']:>2} images  {i['tokens']:>6} tokens  "
                  f"episode {i['episode_mib']:>7.1f} MiB (text twin {t['episode_mib']:.1f} MiB)  "
                  f"PNG {i['png_bytes'] / 1024:.0f} KiB")
    results["total_s"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"total {results['total_s']:.1f} s -> {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
