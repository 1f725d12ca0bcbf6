"""Any Hugging Face causal LM as the policy: the packed interface the learner and TorchEngine use.

    policy = HFPolicy.from_pretrained("ckpt/llama")                  # AutoModelForCausalLM inside
    h = policy.packed_hidden(input_ids [T], cu_seqlens [N+1])         # [T, D], no cross-sequence attention
    lp = policy.token_logprobs(input_ids [T], targets [T], cu_seqlens) # [T] fp32
    cache = policy.empty_cache(2)                                    # TorchEngine: one KV row per sequence
    logits, cache = policy.packed_logits(ids, cu_seqlens, cache)     # [T | len(logit_index), V] fp32

Packing (the learner): the sequences of a micro-batch are concatenated into one row [1, T] with
`position_ids` restarting at 0 at every `cu_seqlens` boundary (per-sequence rotary positions) and the
boundaries passed as `cu_seq_lens_q/k`, transformers' varlen kwargs. With a flash-attention implementation
(GPU) its varlen kernel runs. An sdpa / eager model (CPU) of full-attention layers is switched to the
attention implementation "odyssey_packed_sdpa" (`packed_sdpa` + `packed_mask`, registered with
transformers): given `cu_seq_lens_q` it runs causal SDPA per sequence, O(sum L_i^2) work and no [T, T] mask
(transformers' own fallback for packed position_ids builds a block-diagonal [T, T] mask: 16x the work at 16
sequences of 1K tokens); without it, it is transformers' sdpa (generate, padding, KV cache). No padding, and
a token never attends to another sequence (tested against a per-sequence loop on an independent eager model).
The boundaries also reach packed_sdpa out of band (`_PACKING`, set by packed_hidden and restored in activation
checkpointing's recomputation), since some decoder layers (StableLM, Nemotron) do not pass the varlen kwargs
on; inside a packed forward packed_sdpa never attends across the row. Every load runs a probe
(`HFPolicy.verify_packing`: packed == per-sequence on three short sequences) and refuses an architecture that
fails it (docs/hf.md, "HF support"; tests/test_hf_architectures.py).
Shared prefixes (rl/learner/prefix_sharing.py): with `prefix_of` (int [N], per sequence the sequence it
continues, or -1) a continuing sequence attends to all of its prefix, then causally to itself, at positions
after the prefix's; so a GRPO group's prompt is computed once for its G completions.

Decoding (TorchEngine): `HFPackedCache` keeps one row per sequence, each a tuple over layers of (K, V)
[1, H_kv, L, D_h]. A forward never mutates the cache passed in; it returns a new one. A decode step (one new
token per row) runs as one batched forward: the rows' K/V right-padded to the longest, a 2-D padding mask and
each row's own position; its result stays batched (`BatchedKV`) for the next step, so consecutive decode
steps copy no rows, and rows are cut out only when sequences join or leave. Prefill chunks run row by row.
A linear-attention hybrid (KDA: kimi_linear, glm5_next; Gated DeltaNet: qwen3_next, qwen3_5) keeps, per
linear-attention layer of each row, a `KDAState` (short-conv tail [1, C, W-1], recurrent state S [1, H, K, V]
fp32) and per DSA layer (K, V, indexer keys). Prefill chunks and observations run one forward per row
(`_per_row`), continuing from the row's states (model/hf_linear_attention.py `_cached`); decode steps run
batched as above, the rows' states stacked ([N, C, W-1], [N, H, K, V]) beside the padded K/V and kept
stacked between steps (glm5_next's DSA rows still decode one row per forward). Its full-attention layers
take the packed SDPA path in the learner too (the linear-attention layers reset per sequence on their own);
shared prefixes do not apply (a continuation would need its prefix's recurrent state).

Parameter names are the HF checkpoint's (`model.…`, `lm_head.weight`): the wrapper registers the HF model's
two children under their own names, so `state_dict()` feeds vLLM's own model code and `save_pretrained`
writes a checkpoint any HF tool reads.

Routing replay (R3) of an HF MoE (qwen3_moe, mixtral, olmoe, kimi_linear, ... : model/hf_routing.py): its
routers are hooked (`self.routing`, `moe_layer_indices` = the decoder layers with a router), TorchEngine
records every fed token's free top-k (`packed_logits_routed`), and the learner's packed forward replays them
(`packed_hidden_routed(replay_experts=[T, n_moe, k])`), with expert-load metrics per MoE layer.
What does not apply (Odyssey's own model only): sequence-chunked and context-parallel forwards, the
balancing-bias update. An HF MoE whose router class is not in model/hf_routing.py has no `routing`
(`moe_layer_indices` empty): the learner and the engines treat it as dense for routing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.hf_linear_attention import (
    KDAState,
    has_kda_layers,
    patch_linear_attention,
    register_hybrid_causal_lms,
)
from model.hf_routing import HFRouting, find_routed_layers, recompute_scope

ODYSSEY_MODEL_TYPE = "odyssey_moe"


def is_odyssey_checkpoint(path: str | Path) -> bool:
    """True when `path`/config.json was written by OdysseyForCausalLM (model_type 'odyssey_moe')."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("model_type") == ODYSSEY_MODEL_TYPE


PACKED_ATTENTION = "odyssey_packed_sdpa"
#: attention keywords that change the scores (soft-capping, sinks, a window); the per-sequence SDPA of a
#: packed call cannot apply them, so a model that passes one is refused rather than computed without it
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sinks", "sliding_window")


@dataclass(frozen=True)
class _Packing:
    """The sequence boundaries of the packed forward in progress (HFPolicy.packed_hidden): cu int32 [N+1],
    prefix_of int [N] or None, total tokens T."""

    cu: torch.Tensor
    prefix_of: torch.Tensor | None
    total: int


#: Out-of-band copy of the boundaries, set by packed_hidden for the duration of its forward (and, under
#: activation checkpointing, of each recomputation: `_packing_context_fn`). transformers' varlen kwargs
#: (`cu_seq_lens_q`) only reach the attention function when every decoder layer passes `**kwargs` on, which
#: StableLM's and Nemotron's do not; these boundaries reach it whatever the layers pass.
_PACKING: contextvars.ContextVar[_Packing | None] = contextvars.ContextVar("odyssey_packing", default=None)


@contextlib.contextmanager
def _packing_scope(packing: _Packing | None):
    """Set the packed boundaries seen by packed_sdpa for the duration of the block."""
    token = _PACKING.set(packing)
    try:
        yield
    finally:
        _PACKING.reset(token)


def _packing_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint `context_fn`: a checkpointed layer's recomputation (in the backward, after
    packed_hidden returned) sees the boundaries of the forward that saved it, and its replayed experts
    (model/hf_routing.py `recompute_scope`: same experts, nothing recorded)."""
    packing, routing = _PACKING.get(), recompute_scope()

    @contextlib.contextmanager
    def recompute():
        with _packing_scope(packing), routing:
            yield

    return contextlib.nullcontext(), recompute()


def packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface of "odyssey_packed_sdpa". A packed call (inside
    HFPolicy.packed_hidden): one row, query [1, H, T, D], key / value [1, H_kv, T, D], no mask (packed_mask
    gives none) -> (output [1, T, H, D], None): causal SDPA per sequence (GQA by enable_gqa). The boundaries
    are packed_hidden's (`_PACKING`), whether or not the decoder layer passed transformers' varlen kwargs on;
    a packed call whose shape is not the packed row's is an error, never full causal attention over the row.
    Outside packed_hidden, kwargs["cu_seq_lens_q"] (transformers' own varlen convention) is honoured, and
    any other call (generate, padding, KV cache) is transformers' sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    prefix_of = kwargs.pop("odyssey_prefix_of", None)
    odd = {k: type(kwargs[k]).__name__ for k in _UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(k) is not None}
    if odd:
        raise ValueError(f"{PACKED_ATTENTION}: {type(module).__name__} passes {sorted(odd)} to its attention "
                         "(soft-capping, sinks or a sliding window), which per-sequence SDPA cannot apply; "
                         "this architecture is not supported by Odyssey's packed learner (docs/hf.md, HF "
                         "support)")
    packing = _PACKING.get()
    if packing is not None:
        if query.shape[0] != 1 or query.shape[2] != packing.total or key.shape[2] != packing.total:
            raise ValueError(
                f"{PACKED_ATTENTION}: {type(module).__name__} attends with query {tuple(query.shape)}, key "
                f"{tuple(key.shape)} inside a packed forward of {packing.total} tokens; the sequence "
                "boundaries cannot be applied to it, and attending across the row would mix sequences. This "
                "architecture is not supported by Odyssey's packed learner (docs/hf.md, HF support)")
        cu, prefix_of = packing.cu, packing.prefix_of
    if cu is None:  # not packed: transformers' sdpa (its mask, or causal when there is none)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION}: a packed call (cu_seq_lens_q) takes one row and no mask; got "
                         f"batch {query.shape[0]}, mask {attention_mask is not None}")
    bounds = cu.tolist()
    parents = prefix_of.tolist() if prefix_of is not None else [-1] * (len(bounds) - 1)
    drop, gqa = (dropout if module.training else 0.0), key.shape[1] != query.shape[1]
    outs = []
    for a, b, parent in zip(bounds[:-1], bounds[1:], parents):
        if parent < 0:  # a sequence of its own: causal
            outs.append(F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                       is_causal=True, scale=scaling, dropout_p=drop,
                                                       enable_gqa=gqa))
            continue
        pa, pb = bounds[parent], bounds[parent + 1]  # the prefix it continues: all of it, then causal
        mask = torch.ones(b - a, pb - pa + b - a, dtype=torch.bool, device=query.device).tril(pb - pa)
        outs.append(F.scaled_dot_product_attention(
            query[:, :, a:b], torch.cat([key[:, :, pa:pb], key[:, :, a:b]], 2),
            torch.cat([value[:, :, pa:pb], value[:, :, a:b]], 2), attn_mask=mask, scale=scaling,
            dropout_p=drop, enable_gqa=gqa))
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


def packed_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers mask interface of "odyssey_packed_sdpa": None (causal, applied by packed_sdpa per
    sequence or by SDPA's is_causal) when there is no padding mask and no cache offset; else sdpa's mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and int(q_offset) == 0 and int(kv_offset) == 0 and q_length == kv_length:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def _use_packed_attention(config, recurrent: bool = False) -> bool:
    """Switch an sdpa / eager model of full-attention layers to "odyssey_packed_sdpa" (registered here).
    recurrent: the model's linear-attention layers are patched (model/hf_linear_attention.py: they run per
    sequence on their own), so only its full-attention layers take packed_sdpa; a Gated DeltaNet / KDA hybrid
    (qwen3_next, qwen3_5, kimi_linear) then attends per sequence, O(sum L_i^2), instead of through
    transformers' block-diagonal [T, T] mask. Flash-attention models keep their varlen kernels;
    sliding-window models, and DSA layers (glm5_next: indexer top-k, run per sequence by the patch), keep
    transformers' masks."""
    from transformers import AttentionInterface
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if config._attn_implementation not in ("sdpa", "eager", PACKED_ATTENTION):
        return False
    allowed = (DynamicLayer, LinearAttentionLayer) if recurrent else (DynamicLayer,)
    if any(type(layer) not in allowed for layer in DynamicCache(config=config).layers):
        return False
    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, packed_mask)
    config._attn_implementation = PACKED_ATTENTION
    return True


#: the load-time packing probe's tolerance on logits in fp32, relative to their largest magnitude
#: (SmolLM2-135M, 30 layers: 1.4e-4 absolute; a leak across sequences moves logits by a sizeable fraction
#: of that magnitude), and its results per architecture and config
PACKING_PROBE_TOL = 1e-4
_PACKING_VERIFIED: dict[tuple, float] = {}


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor,
                              prefix_of: torch.Tensor | None = None) -> torch.Tensor:
    """cu_seqlens int [N+1] -> position of each token within its sequence, int64 [cu_seqlens[-1]]; with
    prefix_of int [N] (sequence continued, or -1), a continuing sequence starts after its prefix's length."""
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    T = int(cu[-1])
    starts = cu[:-1]
    if prefix_of is not None:
        p = prefix_of.to(device=cu.device, dtype=torch.long)
        starts = starts - torch.where(p >= 0, lens[p.clamp(min=0)], 0)
    return torch.arange(T, device=cu.device) - torch.repeat_interleave(starts, lens, output_size=T)


class KVBuffer:
    """One layer's K and V buffers [N, H_kv, capacity, D_h] for batched decoding, `used` columns written.
    Caches view their first W columns; one of width W appends in place only while used == W (no other cache
    appended after it), else it copies into a new buffer, so a cache never sees another's later tokens."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, used: int) -> None:
        self.k, self.v, self.used = k, v, used

    @classmethod
    def holding(cls, k: torch.Tensor, v: torch.Tensor, room: int) -> KVBuffer:
        """A new buffer holding k, v [N, H_kv, W, D_h] with room for `room` more columns."""
        N, H, W, D = k.shape
        kb, vb = k.new_empty(N, H, W + room, D), v.new_empty(N, H, W + room, D)
        kb[:, :, :W], vb[:, :, :W] = k, v
        return cls(kb, vb, W)


@functools.cache
def _append_layer_class() -> type:
    """AppendLayer (built on first use: transformers is imported lazily): a transformers DynamicLayer over a
    KVBuffer whose `update` writes the new columns into the buffer instead of DynamicLayer's torch.cat of
    the whole cache each step (~27% of a small model's decode step)."""
    from transformers.cache_utils import DynamicLayer

    class AppendLayer(DynamicLayer):
        def __init__(self, buf: KVBuffer, width: int) -> None:
            super().__init__()
            self.buf, self.width, self.is_initialized = buf, width, True
            self.dtype, self.device = buf.k.dtype, buf.k.device
            self.keys, self.values = buf.k[:, :, :width], buf.v[:, :, :width]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            W, t, buf = self.width, key_states.shape[-2], self.buf
            if buf.used != W or W + t > buf.k.shape[2]:  # another cache appended past W, or full: copy
                buf = self.buf = KVBuffer.holding(buf.k[:, :, :W], buf.v[:, :, :W], max(W + t, 64))
            buf.k[:, :, W:W + t], buf.v[:, :, W:W + t] = key_states, value_states
            buf.used = self.width = W + t
            self.keys, self.values = buf.k[:, :, :W + t], buf.v[:, :, :W + t]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.width

    return AppendLayer


@dataclass(frozen=True)
class BatchedKV:
    """Rows decoded together, kept batched between decode steps: per layer (K, V) [N, H_kv, W, D_h] (views of
    `buffers`, where the next step appends in place) of an attention layer, or a `KDAState` of the N rows'
    stacked states (conv tails [N, C, W-1], recurrent S [N, H, K, V] fp32) of a linear-attention layer (its
    buffer None); valid bool [N, W] (row i's tokens are its valid columns, in order; a shorter row has
    padding columns)."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor] | KDAState, ...]
    valid: torch.Tensor
    buffers: tuple[KVBuffer | None, ...]


def _row_length(row: tuple | None) -> int:
    """Tokens held by one HFPackedCache row: the length of its first attention layer's K (a KDA layer's
    state does not count tokens; every supported hybrid has an attention layer)."""
    if row is None:
        return 0
    for entry in row:
        if not isinstance(entry, KDAState):
            return int(entry[0].shape[-2])
    raise ValueError("an HFPackedCache row holds no attention layer, so its length is unknown; TorchEngine "
                     "supports models with at least one attention layer")


class HFPackedCache:
    """KV cache of N sequences for TorchEngine: `rows` (row i: per layer (K, V) [1, H_kv, L_i, D_h] for an
    attention layer, (K, V, indexer keys [1, L_i, D_idx] or None) for a DSA layer (glm5_next), `KDAState`
    (short-conv tail [1, 3HK, W-1], recurrent state S [1, H, K, V] fp32) for a KDA layer (kimi_linear,
    glm5_next); or None for an empty row) or, straight out of a batched decode step, `batch` (BatchedKV;
    rows are cut out of it only when asked for: select / concat / a prefill). Immutable: forwards return
    new caches."""

    def __init__(self, rows: tuple | None = None, batch: BatchedKV | None = None) -> None:
        if (rows is None) == (batch is None):
            raise ValueError("HFPackedCache takes rows or batch, exactly one")
        self._rows, self.batch = rows, batch

    @classmethod
    def empty(cls, n: int) -> HFPackedCache:
        return cls(rows=(None,) * n)

    @property
    def rows(self) -> tuple:
        if self._rows is None:  # cut each row's valid columns out of the batch (a copy where it has padding)
            rows = []
            for i, ok in enumerate(self.batch.valid):
                idx = None if bool(ok.all()) else ok.nonzero().squeeze(1)
                rows.append(tuple(KDAState(e.conv[i:i + 1], e.recurrent[i:i + 1]) if isinstance(e, KDAState)
                                  else (e[0][i:i + 1], e[1][i:i + 1]) if idx is None else
                                  (e[0][i:i + 1].index_select(2, idx), e[1][i:i + 1].index_select(2, idx))
                                  for e in self.batch.layers))
            self._rows = tuple(rows)
        return self._rows

    @property
    def lengths(self) -> list[int]:
        if self._rows is None:
            return self.batch.valid.sum(1).tolist()
        return [_row_length(r) for r in self._rows]

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else int(self.batch.valid.shape[0])

    def select(self, indices: list[int]) -> HFPackedCache:
        return HFPackedCache(rows=tuple(self.rows[i] for i in indices))

    @staticmethod
    def concat(caches: list[HFPackedCache]) -> HFPackedCache:
        return HFPackedCache(rows=tuple(r for c in caches for r in c.rows))


class HFPolicy(nn.Module):
    """A transformers causal LM (`model` trunk + `lm_head`, e.g. Llama, Qwen2/3, Qwen3-MoE) with the packed
    interface of OdysseyForCausalLM that the learner and TorchEngine need (module docstring)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        names = {n for n, _ in hf.named_children()}
        if getattr(hf, "base_model_prefix", None) != "model" or names != {"model", "lm_head"}:
            raise ValueError(
                f"HFPolicy needs a causal LM made of a `model` trunk and an `lm_head` (Llama, Qwen2/3, "
                f"Mistral, Qwen3-MoE, ...); {type(hf).__name__} has children {sorted(names)} and base prefix "
                f"{getattr(hf, 'base_model_prefix', None)!r}. Use a checkpoint of such an architecture"
            )
        cfg = hf.config
        odd = {k: getattr(cfg, k) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
               if getattr(cfg, k, None) not in (None, 1, 1.0)}
        if odd or getattr(hf.lm_head, "bias", None) is not None:
            raise ValueError(
                f"HFPolicy computes logits as lm_head.weight @ h; {type(hf).__name__} transforms them "
                f"({odd or 'lm_head has a bias'}), which the learner's chunked LM head would not reproduce. "
                "Use a model whose logits are a plain linear head"
            )
        patch_linear_attention(hf)  # kimi_linear / glm5_next: packed KDA layers, model/hf_linear_attention.py
        #: a KDA / Gated DeltaNet hybrid: its TorchEngine cache rows carry per-layer state (`KDAState`)
        self.recurrent = has_kda_layers(hf)
        self.__dict__["hf"] = hf  # not registered: its two children are, under their own names
        self.model = hf.model
        self.lm_head = hf.lm_head
        self.config = cfg
        routed = find_routed_layers(hf, int(getattr(cfg, "moe_load_window", 100) or 100))
        #: router hooks of an HF MoE (routing replay, expert load; model/hf_routing.py), None when dense
        self.routing: HFRouting | None = HFRouting(routed) if routed else None
        self.moe_layer_indices: list[int] = list(self.routing.layer_indices) if routed else []
        #: the attention layers run "odyssey_packed_sdpa" (per-sequence SDPA; hybrids' full-attention layers
        #: too)
        self.per_sequence_attention = _use_packed_attention(cfg, self.recurrent)
        #: packed SDPA with shared prefixes (prefix_of) available: not for a hybrid (a continuing sequence
        #: would need its prefix's conv and recurrent state); the learner's `share_prefixes` reads this
        self.packed_attention = self.per_sequence_attention and not self.recurrent
        self.source: Path | None = None  # the checkpoint it was loaded from: its tokenizer travels with it
        self.train(hf.training)
        self.verify_packing()

    @torch.no_grad()
    def verify_packing(self) -> float:
        """The load-time probe, once per architecture and configuration in a process: three short sequences
        packed into one row (the third continuing the first, where shared prefixes are available) must give
        the logits of HF's own forward of each sequence alone. Returns the largest difference; raises a
        ValueError naming the architecture when it exceeds PACKING_PROBE_TOL (fp32; 3e-2 in half precision)
        times the logits' largest magnitude (at least 1), so a model whose packed forward would leak across
        sequences is refused before it trains."""
        p = next(self.parameters(), None)
        if p is None or p.device.type == "meta":
            return 0.0
        try:
            described = self.config.to_json_string(use_diff=True)
        except (TypeError, ValueError):  # a config holding something JSON cannot write: probe every load
            described = str(id(self))
        key = (type(self.hf).__qualname__, self.config._attn_implementation, str(p.dtype), p.device.type,
               described)
        if key in _PACKING_VERIFIED:
            return _PACKING_VERIFIED[key]
        vocab = min(int(self.lm_head.weight.shape[0]), int(getattr(self.config, "vocab_size", 0) or 1 << 30))
        lens = [7, 5, 4]
        ids = torch.randint(0, vocab, (sum(lens),), generator=torch.Generator().manual_seed(0)).to(p.device)
        cu = torch.tensor([0, 7, 12, 16], dtype=torch.int32, device=p.device)
        prefix_of = torch.tensor([-1, -1, 0], device=p.device) if self.packed_attention else None
        solo = [ids[0:7], ids[7:12], torch.cat([ids[0:7], ids[12:]]) if prefix_of is not None else ids[12:]]
        model_type = getattr(self.config, "model_type", "?")
        arch = (f"{type(self.hf).__name__} (model_type {model_type!r}, attention "
                f"{self.config._attn_implementation!r})")
        fix = "Use an architecture listed as supported in docs/hf.md (HF support)"
        was_training = self.training
        self.train(False)
        try:
            packed = self.head_logits(self.packed_hidden(ids, cu, prefix_of)).float()
            alone = [self.model(input_ids=x[None], use_cache=False).last_hidden_state[0] for x in solo]
            ref = torch.cat([self.head_logits(h).float()[-n:] for h, n in zip(alone, lens)])
        except ValueError as e:
            raise ValueError(f"{arch}: the packed forward of Odyssey's learner fails on it ({e}). "
                             f"{fix}") from e
        finally:
            self.train(was_training)
        err = float((packed - ref).abs().max())
        scale = max(1.0, float(ref.abs().max()))  # fp32 rounding grows with depth and the logits' size
        tol = (PACKING_PROBE_TOL if p.dtype.itemsize >= 4 else 3e-2) * scale
        if not err <= tol:  # also NaN
            raise ValueError(
                f"{arch}: packed sequences do not reproduce the per-sequence forward (max |logit diff| "
                f"{err:.3g} > {tol:.3g} on a probe of {len(lens)} sequences), so Odyssey's learner would "
                "train it on wrong log-probs (attention leaking across packed sequences, or an attention "
                f"variant the packed path cannot apply). {fix}")
        _PACKING_VERIFIED[key] = err
        return err

    # ---- construction and files ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> HFPolicy:
        """Load an HF causal LM checkpoint directory (no hub access: a local path only)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds no config.json: not a saved Hugging Face checkpoint; give "
                                    "a directory written by save_pretrained")
        register_hybrid_causal_lms()  # glm5_next's causal LM class (AutoModelForCausalLM does not map it)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        policy = cls(hf)
        policy.source = path
        return policy

    def save_pretrained(self, path: str | Path, **kwargs) -> None:
        """The HF checkpoint (config.json + safetensors), loadable by transformers and vLLM, with the
        tokenizer of the checkpoint it was loaded from when that one shipped one (so `model.init_from` of
        a saved policy keeps its tokenizer)."""
        self.hf.save_pretrained(str(path), **kwargs)
        if self.source is not None and (self.source / "tokenizer.json").is_file():
            from model.tokenizer import policy_tokenizer

            policy_tokenizer(self.source).save_pretrained(str(path))

    def train(self, mode: bool = True) -> HFPolicy:
        super().train(mode)
        self.hf.training = mode  # HF's gradient checkpointing reads the wrapped model's flag
        return self

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each decoder layer's activations in the backward (transformers' own checkpointing)."""
        self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": _packing_context_fn})

    def _checkpointing_keeps_packing(self) -> bool:
        """Every checkpointed layer recomputes with the packed boundaries (`_packing_context_fn`)."""
        fns = [m._gradient_checkpointing_func for m in self.hf.modules()
               if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
        return all(getattr(f, "keywords", {}).get("context_fn") is _packing_context_fn for f in fns)

    # ---- packed forward (learner) ---------------------------------------------------------------
    @property
    def n_routed_experts(self) -> int:
        """Routed experts per MoE layer (0: dense, or a router model/hf_routing.py does not know)."""
        return self.routing.n_experts if self.routing is not None else 0

    @property
    def num_experts_per_tok(self) -> int:
        """Top-k of the MoE layers (0: dense)."""
        return self.routing.top_k if self.routing is not None else 0

    def _routing_scope(self, replay_experts: torch.Tensor | None, return_routed: bool, T: int,
                       device: torch.device) -> contextlib.AbstractContextManager:
        """The router-hook scope of one forward (model/hf_routing.py); load and agreement are tracked only in
        a training forward with gradients (the learner's loss forward), as Odyssey's MoE records."""
        if self.routing is None:
            if replay_experts is not None or return_routed:
                raise ValueError(f"{type(self.hf).__name__} has no MoE router known to Odyssey's routing "
                                 "replay (model/hf_routing.py ROUTER_FORMULAS); set "
                                 "learner.routing_replay=false")
            return contextlib.nullcontext()
        rep = None if replay_experts is None else self.routing.check_replay(replay_experts, T, device)
        return self.routing.scope(rep, record=return_routed, track=self.training and torch.is_grad_enabled())

    def packed_hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      prefix_of: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], cu_seqlens int [N+1] (0 .. T) -> last hidden states [T, D] (free routing)."""
        return self.packed_hidden_routed(input_ids, cu_seqlens, prefix_of)[0]

    def packed_hidden_routed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                             prefix_of: torch.Tensor | None = None,
                             replay_experts: torch.Tensor | None = None,
                             return_routed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [T], cu_seqlens int [N+1] (0 .. T) -> (last hidden states [T, D], the routers' free
        top-k int64 [T, n_moe, k] if return_routed else None); each sequence attends only to itself, with
        positions from 0; prefix_of int [N] (module docstring, packed SDPA only): a sequence i with
        prefix_of[i] = j >= 0 attends to all of sequence j first, at positions after it. replay_experts
        [T, n_moe, k] (an HF MoE): the experts every MoE layer runs (routing replay, model/hf_routing.py)."""
        if input_ids.dim() != 1 or int(cu_seqlens[-1]) != input_ids.shape[0] or int(cu_seqlens[0]) != 0:
            raise ValueError(f"packed input: input_ids must be [T] and cu_seqlens run from 0 to T; got "
                             f"input_ids {tuple(input_ids.shape)}, cu_seqlens {cu_seqlens.tolist()[:8]}")
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if prefix_of is not None and self.recurrent:
            raise ValueError("shared prefixes (learner.share_prefixes) are not supported for hybrid "
                             "linear-attention models: a continuing sequence would need its prefix's "
                             "recurrent and conv state. Set learner.share_prefixes=false")
        if prefix_of is not None and not self.packed_attention:
            raise ValueError(f"shared prefixes need the packed SDPA attention; this model runs "
                             f"{self.config._attn_implementation!r}: set learner.share_prefixes=false")
        pos = positions_from_cu_seqlens(cu, prefix_of)
        lens = cu[1:] - cu[:-1]
        longest = int(lens.max())
        varlen = {}
        if self.per_sequence_attention or self.config._attn_implementation.startswith("flash"):
            varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        if prefix_of is not None:
            varlen["odyssey_prefix_of"] = prefix_of
        # else (sliding-window sdpa/eager): transformers builds a block-diagonal mask from position_ids
        if self.training and self.hf.is_gradient_checkpointing and not self._checkpointing_keeps_packing():
            raise ValueError("activation checkpointing was enabled on the HF model directly; its "
                             "recomputation would not see the packed sequence boundaries. Enable it with "
                             "HFPolicy.gradient_checkpointing_enable()")
        T = input_ids.shape[0]
        with (_packing_scope(_Packing(cu, prefix_of, int(cu[-1])) if self.per_sequence_attention else None),
              self._routing_scope(replay_experts, return_routed, T, input_ids.device) as record):
            out = self.model(input_ids=input_ids[None], position_ids=pos[None], use_cache=False, **varlen)
        return out.last_hidden_state[0], (HFRouting.stack(record) if return_routed else None)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> logits [..., V] (model dtype)."""
        return F.linear(h, self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed logits [T, V] (model dtype). For long inputs prefer packed_hidden + a chunked head."""
        return self.head_logits(self.packed_hidden(input_ids, cu_seqlens))

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """log p(targets[t] | tokens <= t of t's sequence), fp32 [T]. cu_seqlens None = one sequence."""
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(targets.shape)}")
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, input_ids.shape[0]], dtype=torch.int32, device=input_ids.device)
        from_head = torch.log_softmax(self.forward(input_ids, cu_seqlens).float(), -1)
        return from_head.gather(-1, targets.to(torch.long)[:, None]).squeeze(-1)

    # ---- cached forward (TorchEngine) -----------------------------------------------------------
    def empty_cache(self, n: int) -> HFPackedCache:
        """A cache of n empty rows. Full-attention layers, and for the KDA hybrids (kimi_linear, glm5_next)
        their KDA layers (per-row short-conv tails and recurrent state) and DSA layers (per-row indexer keys).
        Sliding-window and other recurrent layers are refused (their cache drops old tokens or holds state
        this row layout does not track)."""
        from transformers.cache_utils import (
            DynamicCache,
            DynamicIndexedLayer,
            DynamicLayer,
            LinearAttentionLayer,
        )

        layers = DynamicCache(config=self.config).layers
        allowed: tuple[type, ...] = (DynamicLayer,)
        if self.recurrent:
            allowed = (DynamicLayer, DynamicIndexedLayer, LinearAttentionLayer)
        if any(type(layer) not in allowed for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"TorchEngine's HF cache supports full-attention layers (and the KDA hybrids "
                             f"kimi_linear, glm5_next) only; this model has {kinds}. Use rollout.engine=vllm "
                             "for it")
        return HFPackedCache.empty(n)

    def packed_logits(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: HFPackedCache,
                      logit_index: torch.Tensor | None = None) -> tuple[torch.Tensor, HFPackedCache]:
        """Feed sequence i the tokens input_ids[cu[i]:cu[i+1]] after its cache row i. Returns (logits fp32
        at `logit_index` [M, V] (None: every position [T, V]), the new cache). The input cache is
        unchanged."""
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if len(lens) != len(cache):
            raise ValueError(f"{len(lens)} sequences in cu_seqlens but {len(cache)} cache rows")
        if len(lens) > 1 and all(n == 1 for n in lens) and min(cache.lengths) > 0 and self._batchable(cache):
            h, new = self._decode_batched(input_ids, cache)
        else:
            h, rows = self._per_row(input_ids, lens, cache)
            new = HFPackedCache(rows=rows)
        if logit_index is not None:
            h = h[logit_index]
        return self.head_logits(h).float(), new

    def packed_logits_routed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: HFPackedCache,
                             logit_index: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, HFPackedCache]:
        """`packed_logits` that also returns every fed token's routed experts, the routers' free top-k int64
        [T, n_moe, k] in input_ids order (None for a dense model): TorchEngine's recording for routing
        replay."""
        if self.routing is None:
            logits, new = self.packed_logits(input_ids, cu_seqlens, cache, logit_index)
            return logits, None, new
        with self.routing.scope(record=True) as record:
            logits, new = self.packed_logits(input_ids, cu_seqlens, cache, logit_index)
        routed = HFRouting.stack(record)
        if routed.shape[0] != input_ids.shape[0]:  # every token passes every router exactly once
            raise RuntimeError(f"recorded routes of {routed.shape[0]} tokens for a forward of "
                               f"{input_ids.shape[0]}")
        return logits, routed, new

    @staticmethod
    def _batchable(cache: HFPackedCache) -> bool:
        """A decode step of these rows can run batched: every layer entry is attention (K, V) or a
        linear-attention `KDAState` (a DSA layer's indexer keys, glm5_next, run row by row)."""
        if cache.batch is not None:
            return True
        return all(isinstance(e, KDAState) or len(e) == 2 for e in cache.rows[0])

    @staticmethod
    def _set_linear_state(layer, entry: KDAState) -> None:
        """Point a transformers LinearAttentionLayer at `entry`'s conv tails [B, C, W-1] and recurrent states
        [B, H, K, V] (read, and replaced with new tensors, by model/hf_linear_attention.py `_cached`)."""
        layer.conv_states[0], layer.recurrent_states[0] = entry.conv, entry.recurrent
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
        layer.dtype, layer.device = entry.conv.dtype, entry.conv.device

    def _dynamic_cache(self, data) -> object:
        """A DynamicCache holding one cache row `data` (None: empty) without copying it
        (DynamicCache(ddp_cache_data=...) concatenates them onto empty tensors: one more copy a step): per
        layer (K, V) [B, H_kv, L, D_h], (K, V, indexer keys [B, L, D_idx]) of a DSA layer, or a `KDAState`
        of a KDA layer (read, and replaced with new tensors, by `cached_kda`)."""
        from transformers.cache_utils import DynamicCache

        dc = DynamicCache(config=self.config)
        for layer, entry in zip(dc.layers, data or ()):
            if isinstance(entry, KDAState):
                self._set_linear_state(layer, entry)
                continue
            k, v = entry[0], entry[1]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if len(entry) == 3 and entry[2] is not None:  # DSA: its indexer's keys (None: shared top-k)
                layer.lazy_initialization_indexer(entry[2])
                layer.indexer_keys = entry[2]
        return dc

    @staticmethod
    def _row_of(dc) -> tuple:
        """The cache row (HFPackedCache layout) a DynamicCache holds after a forward: per layer (K, V),
        (K, V, indexer keys) or KDAState."""
        from transformers.cache_utils import DynamicIndexedLayer, LinearAttentionLayer

        row = []
        for layer in dc.layers:
            if isinstance(layer, LinearAttentionLayer):
                row.append(KDAState(layer.conv_states[0], layer.recurrent_states[0]))
            elif isinstance(layer, DynamicIndexedLayer):
                row.append((layer.keys, layer.values, layer.indexer_keys))
            else:
                row.append((layer.keys, layer.values))
        return tuple(row)

    def _per_row(self, input_ids: torch.Tensor, lens: list[int], cache: HFPackedCache):
        """The obvious path: one forward per sequence on its own DynamicCache (prefills, observations; decode
        steps of glm5_next's DSA rows)."""
        hs, rows, start = [], [], 0
        for n, row, past in zip(lens, cache.rows, cache.lengths):
            if n == 0:
                rows.append(row)
                continue
            dc = self._dynamic_cache(row)
            pos = torch.arange(past, past + n, device=input_ids.device)
            out = self.model(input_ids=input_ids[None, start:start + n], position_ids=pos[None],
                             past_key_values=dc, use_cache=True)
            hs.append(out.last_hidden_state[0])
            rows.append(self._row_of(dc))
            start += n
        w = self.lm_head.weight
        h = torch.cat(hs) if hs else w.new_zeros(0, w.shape[1])
        return h, tuple(rows)

    def _decode_batched(self, input_ids: torch.Tensor,
                        cache: HFPackedCache) -> tuple[torch.Tensor, HFPackedCache]:
        """One new token per row, in one forward: the rows' K/V batched (as the previous decode step left
        them, or right-padded to the longest row), a padding mask over [past..., new], position_ids = each
        row's length; a linear-attention layer's rows (hybrids) stacked, conv tails [N, C, W-1] and recurrent
        states [N, H, K, V], each row stepping from its own (model/hf_linear_attention.py `_cached`: the
        layer sees no padding, since a decode token never is). The result stays batched for the next step
        (no per-row copies)."""
        if cache.batch is not None:
            valid, W = cache.batch.valid, int(cache.batch.valid.shape[1])
            buffers, states = cache.batch.buffers, cache.batch.layers
        else:
            L = cache.lengths
            N, Lmax, dev = len(L), max(L), input_ids.device
            valid = torch.arange(Lmax, device=dev)[None] < torch.tensor(L, device=dev)[:, None]
            buffers, states = [], []
            for j in range(len(cache.rows[0])):
                if isinstance(cache.rows[0][j], KDAState):
                    buffers.append(None)
                    states.append(KDAState(torch.cat([r[j].conv for r in cache.rows]),
                                           torch.cat([r[j].recurrent for r in cache.rows])))
                    continue
                states.append(None)
                k0, v0 = cache.rows[0][j]
                # zeros in the padding columns (masked: finite, so no NaN through the masked softmax) and room
                # for the next 64 decode steps before the buffers grow
                K = k0.new_zeros(N, k0.shape[1], Lmax + 64, k0.shape[-1])
                V = v0.new_zeros(N, v0.shape[1], Lmax + 64, v0.shape[-1])
                for i, r in enumerate(cache.rows):
                    K[i, :, : L[i]], V[i, :, : L[i]] = r[j][0][0], r[j][1][0]
                buffers.append(KVBuffer(K, V, Lmax))
            W = Lmax
        dc = self._dynamic_cache(None)
        layers = list(dc.layers)
        for j, (b, st) in enumerate(zip(buffers, states)):
            if b is None:  # linear attention: its LinearAttentionLayer holding the stacked states
                self._set_linear_state(layers[j], st)
            else:
                layers[j] = _append_layer_class()(b, W)
        dc.layers = layers
        valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], 1)
        mask = None if bool(valid.all()) else valid
        positions = valid.sum(1, keepdim=True) - 1
        out = self.model(input_ids=input_ids[:, None], position_ids=positions, attention_mask=mask,
                         past_key_values=dc, use_cache=True)
        entries = tuple((layer.keys, layer.values) if b is not None else
                        KDAState(layer.conv_states[0], layer.recurrent_states[0])
                        for layer, b in zip(dc.layers, buffers))
        batch = BatchedKV(entries, valid, tuple(layer.buf if b is not None else None
                                                for layer, b in zip(dc.layers, buffers)))
        return out.last_hidden_state[:, 0], HFPackedCache(batch=batch)

    # ---- MoE: expert load (routing replay is in packed_hidden_routed) -----------------------------
    def moe_layers(self) -> list:
        """The MoE layers' model/hf_routing.py RoutedLayer (each with its `load_tracker`), in
        moe_layer_indices order; empty for a dense model."""
        return list(self.routing.layers) if self.routing is not None else []

    def expert_load_metrics(self) -> dict[str, float | list]:
        """Expert-load metrics of the last step, named as Odyssey's ("moe/layer{l}/<metric>" plus summaries;
        model/moe.py aggregate_load_metrics); empty for a dense model."""
        from model.moe import aggregate_load_metrics

        if self.routing is None:
            return {}
        return aggregate_load_metrics({x.layer_idx: x.load_tracker.metrics() for x in self.routing.layers})

    def update_router_biases(self) -> None:
        """No balancing bias to update (an HF MoE keeps its own routing; the learner adds no auxiliary
        load-balancing loss). Closes the expert-load step (summed over data-parallel ranks first), as
        LatentMoE.update_bias does."""
        import torch.distributed as dist

        for layer in self.moe_layers():
            if dist.is_available() and dist.is_initialized():
                layer.load_tracker.all_reduce()
            layer.load_tracker.close_step()


__all__ = ["BatchedKV", "HFPolicy", "HFPackedCache", "is_odyssey_checkpoint", "positions_from_cu_seqlens"]
