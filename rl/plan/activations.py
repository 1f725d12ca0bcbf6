"""Activation memory of the learner's forward, from the config's shapes (any preset, k3 included).

    per_token = layer_bytes_per_token(config, l)       # {"mixer", "ffn", "rest"} bytes per token, layer l
    w = window_bytes(config, trajectory=1 << 20, chunk=4096)   # the sequence-chunked learner's peak

The formula (bytes autograd saves per token, bf16 activations, the torch code path: model/kda_chunk.py,
model/mla.py, model/moe.py, model/attn_res.py), with D = hidden, H/K the KDA heads/head dim, Hm/hd the MLA
heads/head dim, q/R the MLA q / kv LoRA ranks, n/k the routed experts / top-k, L/I the expert latent /
intermediate, n_s/I_s the shared experts / their width, I_d the dense FFN width, S the AttnRes sources the
layer's two reads see (attn read: 1 + sealed blocks + [open block non-empty]; ffn read: 2 + sealed blocks):

    kda   = -476 + 8.25 D + 134.3 H K + 944.8 H + 10.45 H K^2 / 64
    mla   = 7.0 + 1.98 D + 10.05 q + 10.03 R + 12.0 Hm hd + 3.75 Hm
    dense = 2 D + 14 I_d
    moe   = -76.7 + 6.80 D + 7.42 n + 49.0 k + 8.03 k L + 14.0 k I + 10.0 L + 13.98 n_s I_s
    rest  = 16 + 24.25 D + S (4 D + 12)

The coefficients are a least-squares fit of `rl.plan.saved.measure_saved_bytes` (the real forward, every
saved tensor counted once by storage, bf16, balanced routing) over 40 random small configs (T = 128; the
dense and rest terms fit exactly, mla within 0.1 %, kda and moe within 2.2 %); tests/test_plan.py checks the
formula against fresh measurements of the tiny and small presets and of configs the fit never saw. The k x
terms of the MoE are the expert buffers [n, T k / n, ...] at perfect balance; `capacity` scales them for an
imbalanced step (the most-loaded expert's tokens over the mean). CUDA runs KDA through fla-core's Triton
kernels (model/kda_fla.py), which save less than the torch path measured here: on a GPU this is an upper
bound for the KDA term until it is measured there.

`window_bytes` is the learner's peak for one trajectory of `trajectory` tokens run in windows of `chunk`
tokens with every layer checkpointed (model/sequence_chunks.py, learner.sequence_chunk_tokens and
learner.activation_checkpointing): one layer's saved activations of a window (recomputed in the backward),
the window's layer inputs (the AttnRes stream: every sublayer output [chunk, D]), what crosses windows (the
MLA latents of the whole trajectory and their gradients, one KDA state set per window boundary), the K and V
of one MLA layer decompressed over the whole prefix, and the LM head's logits block.

`shard_bytes` is the learner's peak on rank r of a context-parallel group of R ranks (learner.context_parallel
= R, model/context_parallel.py) for one trajectory cut into R contiguous shards of c = trajectory / R
tokens. Context parallelism runs its shard unchunked and without activation checkpointing (the config refuses
learner.sequence_chunk_tokens and learner.activation_checkpointing with it), so a rank saves every layer:

    layers  = forward_bytes(config, c)                         (the fitted formula x c tokens x every layer,
              - n_mla c 2 Hm hd 2 B                            less, on r > 0, the shard's own MLA K, V that
                                                               the fitted formula counts and the blocked
                                                               attention of the continuing piece never
                                                               keeps, below)
    summary = n_kda H [(4 + 20 K) c + ceil(c / C) 8 K^2]       (r < R-1: the KDA shard summary, a second
              run of the recurrence from [I | 0] over K + V = 2K fp32 state columns (model/kda_compose.py):
              fp32 q = 0, k, [0 | v], g, beta per token, the [K, 2K] fp32 state per C-token chunk; exact for
              the CPU recurrent backend, measured)
    mla     = n_mla P_r R_kv 2 B                               (r > 0: every MLA layer keeps the latents of
              the sequence's P_r = r c earlier tokens for the backward; its attention over them and its own
              shard goes in blocks of B_p = PREFIX_BLOCK latent rows (model/mla.py
              `blocked_latent_attention`), so it keeps no decompressed K, V at all)
            + n_mla (R - 1) c R_kv 2 B                         (r = 0: the gathered latents of all shards stay
              alive through its own shard's slice)
    kda_exchange = n_kda 2 R H K K 4 B                         (r >= 2: the gathered fp32 summaries M, S_local
              that compose its initial state)
    conv    = n_kda [8 (c + 2 (W-1)) + 2 (W-1) 3HK 2 B]        (r > 0: the short conv of a continuing piece
              runs over W-1 more rows, the earlier shards' inputs, through an int64 gather index)
    backward = 2 c Hm hd 2 B                                   (r = 0, transient: one MLA layer's K, V
              gradients, fresh causal attention over its own shard)
             = c Hm hd 10 + (P_r + c) R_kv 6 + B_p Hm 2 hd 10 + 20 S
                                                               (r > 0, transient: the blocked backward's
              fp32 dq and incoming gradient, its latent gradient fp32 + bf16, ONE block's K, V (bf16 and
              fp32) and their fp32 gradients, up to five fp32 score tiles [Hm, C, B_p] of S =
              _SCORE_BUDGET elements alive at once: s, s - lse, P, dP - D, dS)
    head     = the LM head's logits blocks, as for windows.

The saved terms (all but backward and head) are checked against the bytes a real gloo context-parallel
forward saves per rank (`rl.plan.saved.measure_context_parallel_saved_bytes`, tests/test_plan_context_
parallel.py). The plan takes the largest rank. The mla term grows with r, not with 1/R: the last rank holds
the latents of (R-1)/R of the trajectory for every MLA layer, whatever R (R_kv = 512 per token at k3, ~1 GB
per layer at 1M tokens; the naive form also held their K and V, 2 Hm hd = 16384 per token, ~35 GB).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from model.cache import cache_bytes
from model.config import OdysseyConfig
from model.mla import _SCORE_BUDGET as SCORE_BUDGET
from model.mla import PREFIX_BLOCK

ACT_BYTES = 2  # bf16 activations (the coefficients above are measured in bf16)
HEAD_LIVE_BLOCKS = 3  # LM head: the fp32 logits block, its softmax and its gradient (rl/learner/forward.py)


def attn_res_sources(config: OdysseyConfig, layer: int) -> int:
    """Sources of layer `layer`'s two AttnRes reads together (model/attn_res.py): attn read 1 + m (+1 when
    the open block already has outputs), ffn read 2 + m, m = sealed blocks = layer // block size."""
    B = config.attn_res_block_size
    m = layer // B
    return (1 + m + (1 if layer % B else 0)) + (2 + m)


def layer_bytes_per_token(config: OdysseyConfig, layer: int, capacity: float = 1.0) -> dict[str, float]:
    """Saved-activation bytes per token of decoder layer `layer` (module docstring): mixer, ffn, rest."""
    c = config
    D = c.hidden_size
    if c.layer_types[layer] == "kda":
        H, K = c.kda_num_heads, c.kda_head_dim
        mixer = -476.3 + 8.249 * D + 134.30 * H * K + 944.8 * H + 10.450 * H * K * K / 64
    else:
        Hm, hd = c.mla_num_heads, c.mla_head_dim
        mixer = (7.007 + 1.977 * D + 10.047 * c.mla_q_lora_rank + 10.029 * c.mla_kv_lora_rank
                 + 12.003 * Hm * hd + 3.751 * Hm)
    if layer in c.moe_layer_indices:
        k, L = c.num_experts_per_tok, c.moe_latent_dim
        shared = c.n_shared_experts * c.shared_expert_intermediate_size
        experts = 49.01 * k + 8.033 * k * L + 14.001 * k * c.moe_intermediate_size
        ffn = (-76.75 + 6.801 * D + 7.421 * c.n_routed_experts + capacity * experts + 10.020 * L
               + 13.975 * shared)
    else:
        ffn = 2.0 * D + 14.0 * c.intermediate_size
    rest = 16.0 + 24.25 * D + attn_res_sources(c, layer) * (4 * D + 12)
    return {"mixer": mixer, "ffn": ffn, "rest": rest}


def padded_tokens(config: OdysseyConfig, tokens: int) -> int:
    """Tokens as KDA runs them: rounded up to its chunk (kda_chunk_size)."""
    C = config.kda_chunk_size
    return math.ceil(tokens / C) * C


def forward_bytes(config: OdysseyConfig, tokens: int, capacity: float = 1.0) -> int:
    """Saved activations of one forward of `tokens` tokens through every layer, no checkpointing (what
    `measure_saved_bytes(...).total` measures, less the embedding and final read)."""
    T = padded_tokens(config, tokens)
    return round(sum(sum(layer_bytes_per_token(config, l, capacity).values()) * T
                     for l in range(config.num_hidden_layers)))


@dataclass
class WindowBytes:
    """The sequence-chunked learner's peak activation bytes for one trajectory (module docstring)."""

    layer: int  # the largest layer's saved activations for one window, recomputed in the backward
    stream: int  # the window's checkpointed layer inputs: (2 layers + 1) sublayer outputs [chunk, D]
    carried: int  # MLA latents of the whole trajectory (+ gradients) and KDA states per window boundary
    mla_prefix: int  # K and V of one MLA layer decompressed over the trajectory [L, Hm, hd] x 2
    head: int  # the LM head's live logits blocks (fp32)

    @property
    def total(self) -> int:
        return self.layer + self.stream + self.carried + self.mla_prefix + self.head

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def window_bytes(config: OdysseyConfig, trajectory: int, chunk: int, capacity: float = 1.0) -> WindowBytes:
    """Peak activation bytes of the learner for one `trajectory`-token sequence in windows of `chunk`."""
    from rl.learner.forward import HEAD_CHUNK_ELEMENTS

    if trajectory < 1 or chunk < 1:
        raise ValueError(f"trajectory and chunk must be >= 1 tokens, got {trajectory}, {chunk}")
    c = config
    chunk = min(chunk, trajectory)
    T = padded_tokens(c, chunk)
    layer = max(sum(layer_bytes_per_token(c, l, capacity).values()) for l in range(c.num_hidden_layers)) * T
    stream = (2 * c.num_hidden_layers + 1) * T * c.hidden_size * ACT_BYTES
    n_mla = len(c.mla_layer_indices)
    latents = 2 * n_mla * trajectory * c.mla_kv_lora_rank * ACT_BYTES
    windows = math.ceil(trajectory / chunk)
    kda_state = cache_bytes(c, 0, latent_bytes=ACT_BYTES, conv_bytes=ACT_BYTES)["kda"]
    carried = latents + (windows - 1) * kda_state
    mla_prefix = 2 * trajectory * c.mla_num_heads * c.mla_head_dim * ACT_BYTES if n_mla else 0
    head = HEAD_LIVE_BLOCKS * HEAD_CHUNK_ELEMENTS * 4
    return WindowBytes(round(layer), stream, carried, mla_prefix, head)


@dataclass
class ShardBytes:
    """The context-parallel learner's activation bytes on one rank (module docstring, `shard_bytes`)."""

    layers: int  # every layer's saved activations of the c-token shard (the fitted formula; r > 0: less K, V)
    summary: int  # the KDA shard summaries (fp32 recurrence over K + V columns), ranks that hand on a state
    mla: int  # earlier shards' latents, every MLA layer (r = 0: the gathered latents); no K, V (blocked)
    kda_exchange: int  # the gathered fp32 summaries [R, H, K, K] x 2 per KDA layer (ranks >= 2)
    conv: int  # the short conv's W-1 rows from the earlier shards and its gather index (ranks > 0)
    stream: int  # checkpointed only: every layer's input [c, D] and the final read over them
    backward: int  # transient: one MLA layer's attention backward (r > 0: blocked, one block's K, V)
    head: int  # the LM head's live logits blocks (fp32)
    checkpointed: bool = False  # the five terms above `stream` are then the largest single layer's

    @property
    def saved(self) -> int:
        """What the rank holds after the forward (the measured part)."""
        if self.checkpointed:
            return self.stream
        return self.layers + self.summary + self.mla + self.kda_exchange + self.conv

    @property
    def total(self) -> int:
        return (self.layers + self.summary + self.mla + self.kda_exchange + self.conv + self.stream
                + self.backward + self.head)

    def to_dict(self) -> dict[str, int]:
        d = {k: v for k, v in asdict(self).items() if k != "checkpointed"}
        return {**d, "total": self.total}


def final_read_bytes_per_token(config: OdysseyConfig) -> float:
    """Saved bytes per token of the final AttnRes read + norm on a fresh stream (no inverse RMS cached from
    the layers, as after checkpointed layers): 4 + 8.03 D + S (8 D + 16), S = its sources (the embedding and
    the sealed blocks, plus the open one). Fitted to the measured read at D = 128, 256 and S = 2, 5, 9
    (exact to 0.1 %)."""
    c = config
    L, B, D = c.num_hidden_layers, c.attn_res_block_size, c.hidden_size
    S = 1 + L // B + (1 if L % B else 0)
    return 4 + 8.03 * D + S * (8 * D + 16)


def shard_bytes(config: OdysseyConfig, trajectory: int, ranks: int, rank: int, capacity: float = 1.0,
                checkpointed: bool = False) -> ShardBytes:
    """Activation bytes of `rank` of a `ranks`-rank context-parallel group for one `trajectory`-token sequence
    (module docstring); shard r holds tokens [r L // R, (r + 1) L // R) as model/context_parallel.py cuts.
    checkpointed: every layer under its activation checkpoint (learner.activation_checkpointing): the rank
    holds the layer inputs (`stream`) and, in the backward, the largest layer's activations with that
    layer's context-parallel terms (one layer at a time)."""
    from rl.learner.forward import HEAD_CHUNK_ELEMENTS

    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} context-parallel ranks")
    if trajectory < ranks:
        raise ValueError(f"a {trajectory}-token trajectory cannot be cut into {ranks} non-empty shards")
    c = config
    start, end = rank * trajectory // ranks, (rank + 1) * trajectory // ranks
    n = end - start
    widest = max((r + 1) * trajectory // ranks - r * trajectory // ranks for r in range(min(ranks, 2)))
    n_kda, n_mla = len(c.kda_layer_indices), len(c.mla_layer_indices)
    H, K, C = c.kda_num_heads, c.kda_head_dim, c.kda_chunk_size
    summary = n_kda * H * ((4 + 20 * K) * n + math.ceil(n / C) * 8 * K * K) if rank < ranks - 1 else 0
    Hm, hd, R_kv = c.mla_num_heads, c.mla_head_dim, c.mla_kv_lora_rank
    own_kv = n * 2 * Hm * hd * ACT_BYTES if rank > 0 else 0  # per MLA layer: blocked, never kept
    if rank > 0:
        mla = n_mla * start * R_kv * ACT_BYTES
    else:
        mla = n_mla * (ranks - 1) * widest * R_kv * ACT_BYTES if ranks > 1 else 0
    kda_exchange = n_kda * 2 * ranks * H * K * K * 4 if rank >= 2 else 0
    W = c.kda_conv_size
    conv = n_kda * (8 * (n + 2 * (W - 1)) + 2 * (W - 1) * 3 * H * K * ACT_BYTES) if rank > 0 else 0
    if not n_mla:
        backward = 0
    elif rank == 0:
        backward = 2 * n * Hm * hd * ACT_BYTES
    else:
        backward = (n * Hm * hd * 10 + (start + n) * R_kv * 6 + PREFIX_BLOCK * Hm * 2 * hd * 10
                    + 20 * SCORE_BUDGET)
    head = HEAD_LIVE_BLOCKS * HEAD_CHUNK_ELEMENTS * 4
    if not checkpointed:
        return ShardBytes(forward_bytes(c, n, capacity) - n_mla * own_kv, summary, mla, kda_exchange, conv, 0,
                          backward, head)
    T = padded_tokens(c, n)
    per = [sum(layer_bytes_per_token(c, l, capacity).values()) * T for l in range(c.num_hidden_layers)]
    kda = max((per[l] for l in c.kda_layer_indices), default=0)
    mla_l = max((per[l] for l in c.mla_layer_indices), default=0) - own_kv
    one_kda = (kda + (summary + kda_exchange + conv) / n_kda) if n_kda else 0
    one_mla = (mla_l + mla / n_mla) if n_mla else 0
    stream = c.num_hidden_layers * n * c.hidden_size * ACT_BYTES + final_read_bytes_per_token(c) * n
    if one_kda >= one_mla:
        return ShardBytes(round(kda), round(summary / n_kda), 0, round(kda_exchange / n_kda),
                          round(conv / n_kda), round(stream), backward, head, checkpointed=True)
    return ShardBytes(round(mla_l), 0, round(mla / n_mla), 0, 0, round(stream), backward, head,
                      checkpointed=True)


def context_parallel_bytes(config: OdysseyConfig, trajectory: int, ranks: int, capacity: float = 1.0,
                           checkpointed: bool = False) -> ShardBytes:
    """The largest rank's `shard_bytes` (by total) of a `ranks`-rank context-parallel group."""
    cands = {0, 1, 2, ranks - 2, ranks - 1}  # the terms are monotone in r between these
    return max((shard_bytes(config, trajectory, ranks, r, capacity, checkpointed) for r in sorted(cands)
                if 0 <= r < ranks), key=lambda s: s.total)


__all__ = ["ACT_BYTES", "ShardBytes", "WindowBytes", "context_parallel_bytes", "final_read_bytes_per_token",
           "shard_bytes",
           "attn_res_sources", "forward_bytes", "layer_bytes_per_token",
           "padded_tokens", "window_bytes"]
