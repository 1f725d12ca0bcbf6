"""Blocked prefix attention (model/mla.py `blocked_latent_attention`, `GatedMLA.attend_blocked`), the MLA
step of context parallelism's continuing piece (model/context_parallel.py). The oracle is
`GatedMLA.attend_naive` (decompress every latent row, one causal SDPA): outputs and gradients w.r.t. q, the
latents and the decompression weights W_uk, W_uv agree within 1e-5 relative in fp32, for blocks that do and
do not divide the prefix, a block of one row, and a prefix shorter than one block. Memory: the bytes that
autograd saves beyond the inputs (torch.autograd.graph.saved_tensors_hooks) stay flat as the prefix grows in
the blocked form and grow by the decompressed K, V (2 H Dh floats per latent row) in the naive form.
Measured (tiny, fp32): worst rel diff 3.5e-7 (o), 6.2e-7 (gradients) with and without the CPU flash
blocks; saved beyond the inputs at prefix 256 / 1024: naive 286,976 / 1,073,408 B, blocked 8,448 / 8,448 B
(o and lse of the 16 queries)."""

from __future__ import annotations

import pytest
import torch

from model import mla
from model.config import OdysseyConfig
from model.mla import GatedMLA, blocked_latent_attention

REL = 1e-5


def _mla(seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    m = GatedMLA(OdysseyConfig.from_preset("tiny"), 0)
    for p in m.parameters():  # spread the scores so the softmax is far from uniform
        p.data.mul_(3.0)
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


def _run(m: GatedMLA, q: torch.Tensor, c: torch.Tensor, prefix: int, block: int | None):
    """Output and gradients (q, c, W_uk, W_uv) of one attention call, naive when block is None."""
    m.zero_grad()
    q, c = q.clone().requires_grad_(), c.clone().requires_grad_()
    o = m.attend_naive(q, c, prefix) if block is None else m.attend_blocked(q, c, prefix, block)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(7))  # not _like: o may be strided
    (o * w).sum().backward()
    return o.detach(), q.grad, c.grad, m.k_b_proj.weight.grad.clone(), m.v_b_proj.weight.grad.clone()


@pytest.mark.parametrize(
    "prefix,t,block",
    [
        (48, 16, 8),  # block divides the prefix (and prefix + t)
        (50, 13, 7),  # it divides neither
        (9, 5, 1),  # one latent row per block
        (5, 11, 64),  # the prefix (and everything) is shorter than one block
        (0, 12, 5),  # no prefix: the shard's own causal attention only, in blocks
    ],
)
@pytest.mark.parametrize("flash", [True, False], ids=["cpu-flash-blocks", "tiles-only"])
def test_blocked_equals_naive(prefix, t, block, flash, monkeypatch):
    # flash: on CPU the query rows that see a whole block take the flash kernel, the diagonal fp32 tiles;
    # tiles-only: every row as fp32 masked tiles (the path off CPU)
    monkeypatch.setattr(mla, "_FLASH_ENABLED", flash)
    torch.manual_seed(prefix + t + block)
    m = _mla()
    H, Dh, R = m.num_heads, m.head_dim, m.kv_lora_rank
    q, c = torch.randn(t, H, Dh), torch.randn(prefix + t, R)
    ref, got = _run(m, q, c, prefix, None), _run(m, q, c, prefix, block)
    for name, a, b in zip(["o", "dq", "dc", "dW_uk", "dW_uv"], got, ref):
        assert _rel(a, b) <= REL, (name, _rel(a, b))


def test_blocked_small_score_budget_chunks_queries():
    # several query chunks per block (the tile [H, C, B] under the budget), masked tiles on the diagonal
    torch.manual_seed(3)
    m = _mla()
    H, Dh, R = m.num_heads, m.head_dim, m.kv_lora_rank
    q, c = torch.randn(10, H, Dh), torch.randn(31, R)
    ref = m.attend_naive(q, c, 21)
    got = blocked_latent_attention(q, c, m.k_b_proj.weight, m.v_b_proj.weight, 21, m.scale, block=6,
                                   score_budget=H * 6 * 3)
    assert _rel(got, ref) <= REL


def test_blocked_bad_input_names_the_problem():
    m = _mla()
    q, c = torch.randn(4, m.num_heads, m.head_dim), torch.randn(9, m.kv_lora_rank)
    with pytest.raises(ValueError, match="prefix"):
        m.attend_blocked(q, c, 3)
    with pytest.raises(ValueError, match="block must be >= 1"):
        m.attend_blocked(q, c, 5, 0)


def saved_bytes(fn, *inputs: torch.Tensor) -> int:
    """Bytes autograd saves for the backward of fn(*inputs), beyond tensors sharing storage with an input
    or a parameter (the latents and weights every form keeps)."""
    held = {x.untyped_storage().data_ptr() for x in inputs}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        if st.data_ptr() not in held:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*inputs)
    return sum(seen.values())


def test_blocked_saved_bytes_do_not_grow_with_the_prefix():
    m = _mla()
    H, Dh, R, t, B = m.num_heads, m.head_dim, m.kv_lora_rank, 16, 32
    held = [m.k_b_proj.weight, m.v_b_proj.weight]
    naive, blocked = {}, {}
    for prefix in (256, 1024):
        q = torch.randn(t, H, Dh, requires_grad=True)
        c = torch.randn(prefix + t, R, requires_grad=True)
        naive[prefix] = saved_bytes(lambda q, c, *_, P=prefix: m.attend_naive(q, c, P), q, c, *held)
        blocked[prefix] = saved_bytes(lambda q, c, *_, P=prefix: m.attend_blocked(q, c, P, B), q, c, *held)
    print(f"saved bytes beyond inputs: naive {naive}, blocked {blocked}")
    # naive keeps the decompressed K and V: 2 H Dh fp32 per latent row at least
    assert naive[1024] - naive[256] >= 768 * 2 * H * Dh * 4
    # blocked keeps o [t, H, Dh] and lse [t, H] (fp32) only, whatever the prefix
    assert blocked[1024] == blocked[256] == t * H * (Dh + 1) * 4


def test_blocked_bf16_is_close_to_fp32_naive():
    # the learner's dtype: fp32 accumulators inside, bf16 in and out; against the fp32 reference
    torch.manual_seed(5)
    m = _mla()
    H, Dh, R = m.num_heads, m.head_dim, m.kv_lora_rank
    q, c = torch.randn(12, H, Dh), torch.randn(40, R)
    ref = m.attend_naive(q, c, 28)
    m16 = _mla().bfloat16()
    got = m16.attend_blocked(q.bfloat16(), c.bfloat16(), 28, 9)
    assert got.dtype == torch.bfloat16 and _rel(got.float(), ref) <= 2e-2, _rel(got.float(), ref)
