"""The packed-forward oracle of the HF hybrid tests (tests/test_hf_hybrid.py, tests/test_hf_gated_delta.py):
a packed batch of ragged sequences, and transformers' own forward on each sequence alone.

    ids, targets, cu = packed_batch(seed=0)                       # [T], [T], [n + 1]
    want = per_sequence_logprobs(model_type, hf_model, ids, targets, cu)   # [T] fp32
"""

from __future__ import annotations

import numpy as np
import torch

from model.hf_linear_attention import transformers_reference_kernels
from model.tokenizer import load_tokenizer

V = len(load_tokenizer())
LENS = [7, 1, 19, 3, 70]  # shorter than the conv window, one token, longer than a 64-token chunk


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T], next-token targets [T], cu_seqlens [len(LENS) + 1] int32) of random ids, T = sum(LENS)."""
    ids = torch.randint(0, V, (sum(LENS),), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *np.cumsum(LENS)], dtype=torch.int32)
    return ids, torch.roll(ids, -1), cu


def per_sequence_logprobs(model_type: str, ref: torch.nn.Module, ids: torch.Tensor, tg: torch.Tensor,
                          cu: torch.Tensor) -> torch.Tensor:
    """The oracle: HF's own forward (torch reference kernels) on each sequence alone -> log p(tg[t]) [T]
    fp32."""
    with transformers_reference_kernels(model_type):
        logits = torch.cat([ref(input_ids=ids[None, a:b], use_cache=False).logits[0]
                            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    return torch.log_softmax(logits.float(), -1).gather(-1, tg[:, None]).squeeze(-1)
