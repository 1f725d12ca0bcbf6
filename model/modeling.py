"""`OdysseyForCausalLM`: the hybrid KDA / gated-MLA sparse-MoE causal LM with Block Attention Residuals.

Stack (DESIGN.md "Model"; formulas in the module of each component, overview in docs/model.md):

    x_0 = Embed(ids)                                           [T, D]
    for l in layers:                                           layer_types[l] in {kda, mla}
        a_l = Mixer_l(RMSNorm(AttnRes_attn,l(sources)))        Mixer = KDAttention | GatedMLA
        f_l = FFN_l(RMSNorm(AttnRes_ffn,l(sources + a_l)))     FFN = DenseFFN (l < first_k_dense) | LatentMoE
    h = RMSNorm(AttnRes_final(sources));  logits = W_lm h      untied LM head unless tie_word_embeddings

Inputs are packed without padding: ``input_ids`` [T] with ``cu_seqlens`` int32 [N+1] (N sequences), or
[B, T] (B equal-length sequences, no cu_seqlens). KDA resets its state at sequence boundaries and MLA
attends only within a sequence; AttnRes and FFNs are per token. Incremental decoding carries an
`OdysseyCache` (KDA recurrent + conv state, MLA latent per sequence); row n of the cache is sequence n.

Images (model/vision.py): ``images`` is an `ImagePatches`, one patch per `<|image_pad|>` token it replaces
in the packed input; the patch embedding is written over those positions of x_0 and everything after is the
text path. Image tokens are never LM targets (the labels loss ignores them).

Routing replay: ``replay_experts`` [T, n_moe_layers, k] forces each MoE layer's experts (the axis order is
`moe_layer_indices`); ``return_routed_experts=True`` returns the experts used, same layout (int64).

Per-layer activation checkpointing: `model.gradient_checkpointing_enable()` (transformers' API) makes every
decoder layer keep only its inputs (the AttnRes sources) during a forward with gradients and recompute its
activations in the backward. MoE statistics are recorded again by the recomputation unless the caller
turns recording off around the backward (`model.moe.statistics_recording`; the learner does).

Hugging Face conventions (docs/hf.md): without cu_seqlens, `OdysseyModel` / `OdysseyForCausalLM` also take
the padded form (input_ids [B, T] + attention_mask, position_ids, past_key_values = `OdysseyHFCache`,
logits_to_keep), run as the packed form (model/padding.py), so padded == packed exactly; the causal LM is a
`GenerationMixin` (`generate`, `pipeline`, TRL).

Importing this module registers the config/model with `AutoConfig` / `AutoModel` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.utils import ModelOutput

from model import fused_cpu
from model.attn_res import AttnResRead, AttnResStream, BlockAttnRes
from model.cache import LayerCache, OdysseyCache
from model.config import OdysseyConfig
from model.ffn import DenseFFN
from model.fused_weights import small_linear
from model.hf_cache import OdysseyHFCache
from model.kda import KDAttention, initial_dt_bias
from model.mla import GatedMLA, MLALatentCache
from model.moe import LatentMoE, Router, aggregate_load_metrics
from model.norm import RMSNorm
from model.padding import PaddedLayout, boundaries_from_position_ids
from model.short_conv import seq_lens_from_cu
from model.vision import IMAGE_PAD_ID, ImagePatches, PatchEmbed, is_image_token

IGNORE_INDEX = -100


@dataclass
class OdysseyOutput(ModelOutput):
    """logits [T, V] (or [B, T, V]); cache: the advanced OdysseyCache (None unless cache/use_cache);
    routed_experts int64 [T, n_moe_layers, k] (None unless requested); aux_loss: summed MoE balancing
    loss (None unless balancing == "aux_loss"); loss: mean next-token NLL (+ aux_loss) when labels given;
    past_key_values: the advanced OdysseyHFCache of a padded call (or of [B, T] input with use_cache)."""

    logits: torch.Tensor | None = None
    cache: OdysseyCache | None = None
    routed_experts: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    past_key_values: OdysseyHFCache | None = None


@dataclass
class OdysseyModelOutput(ModelOutput):
    """The backbone's Hugging Face-style output (`OdysseyModel.forward` without cu_seqlens):
    last_hidden_state [B, T, D] (zeros at padding positions); past_key_values: the advanced OdysseyHFCache
    (None unless use_cache / a cache was given); aux_loss: summed MoE balancing loss (or None)."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: OdysseyHFCache | None = None
    aux_loss: torch.Tensor | None = None


@dataclass
class PaddedRun:
    """What `OdysseyModel.forward_padded` computed: packed hidden [n, D] of the n real tokens, their layout
    in the [B, T] batch, the advanced cache, routed experts [n, n_moe, k] | None, aux_loss | None."""

    hidden: torch.Tensor
    layout: PaddedLayout
    past_key_values: OdysseyHFCache | None
    routed_experts: torch.Tensor | None
    aux_loss: torch.Tensor | None


# packed backbone return: (hidden [T, D], layer caches | None, routed experts | None, aux_loss | None)
PackedRun = tuple[torch.Tensor, list[LayerCache] | None, torch.Tensor | None, torch.Tensor | None]

# Hugging Face forward kwargs refused when set (others, e.g. return_dict, are ignored, as HF models do)
_HF_UNSUPPORTED = {
    "inputs_embeds": "pass input_ids (the model embeds them itself)",
    "output_attentions": "the model has no attention-probability tensors to return (KDA is recurrent)",
    "output_hidden_states": "call model.model(...) for the last hidden state [B, T, D]",
}


def _check_hf_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse the Hugging Face forward kwargs the model cannot honour (unknown ones are ignored)."""
    for name, fix in _HF_UNSUPPORTED.items():
        v = kwargs.get(name)
        if v is not None and v is not False:
            raise ValueError(f"OdysseyForCausalLM does not support {name}: {fix}")


class OdysseyDecoderLayer(nn.Module):
    """One layer: AttnRes read -> RMSNorm -> mixer (KDA | MLA); AttnRes read -> RMSNorm -> FFN (dense|MoE).

    The mixer and MoE classes are class attributes so that another runtime (the vLLM plugin,
    model/vllm_plugin) can swap in its cache-aware versions and keep this forward.
    """

    mixer_classes: dict[str, type[nn.Module]] = {"kda": KDAttention, "mla": GatedMLA}
    moe_class: type[nn.Module] = LatentMoE

    def __init__(self, config: OdysseyConfig, layer_idx: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.attn_res = BlockAttnRes(D, layer_idx, config.attn_res_block_size, eps)
        self.attn_norm = RMSNorm(D, eps)
        self.mixer = self.mixer_classes[self.layer_type](config, layer_idx)
        self.ffn_norm = RMSNorm(D, eps)
        self.is_moe = layer_idx in config.moe_layer_indices
        self.mlp = self.moe_class(config, layer_idx) if self.is_moe else DenseFFN(config)

    def mix(self, h: torch.Tensor, cu_seqlens: torch.Tensor, layer_cache: LayerCache | None,
            keep_cache: bool) -> tuple[torch.Tensor, LayerCache | None]:
        """Mixer sublayer on the AttnRes read h [T, D] -> (a [T, D], new layer cache or None)."""
        return self.mix_normed(self.attn_norm(h), cu_seqlens, layer_cache, keep_cache)

    def mix_normed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layer_cache: LayerCache | None,
                   keep_cache: bool) -> tuple[torch.Tensor, LayerCache | None]:
        """`mix` after its RMSNorm: x = attn_norm(h) [T, D]."""
        if self.layer_type == "kda":
            a, state = self.mixer(x, cu_seqlens, layer_cache)
            return a, (state if keep_cache else None)
        if keep_cache and layer_cache is None:
            raise ValueError("MLA layer needs its past latents (possibly empty) to build a cache")
        return self.mixer(x, cu_seqlens, layer_cache)

    def ffn(self, h: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FFN sublayer on the AttnRes read h [T, D] -> (f [T, D], topk_idx [T, k] | None)."""
        return self.ffn_normed(self.ffn_norm(h), replay)

    def ffn_normed(self, x: torch.Tensor, replay: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ffn` after its RMSNorm: x = ffn_norm(h) [T, D]."""
        if self.is_moe:
            return self.mlp(x, replay)
        return self.mlp(x), None

    def forward(self, stream: AttnResStream, cu_seqlens: torch.Tensor, layer_cache: LayerCache | None = None,
                keep_cache: bool = False, replay: torch.Tensor | None = None,
                ) -> tuple[LayerCache | None, torch.Tensor | None]:
        """Advance the AttnRes stream by this layer. Returns (new layer cache | None, topk_idx | None)."""
        # each read comes with its sublayer's RMSNorm (one fused call without autograd on CPU)
        x = self.attn_res.read_attn(stream, self.attn_norm)
        a, new_cache = self.mix_normed(x, cu_seqlens, layer_cache, keep_cache)
        stream.add(a)
        f, topk = self.ffn_normed(self.attn_res.read_ffn(stream, self.ffn_norm), replay)
        stream.add(f)
        self.attn_res.end_layer(stream)
        return new_cache, topk


class OdysseyPreTrainedModel(PreTrainedModel):
    config_class = OdysseyConfig
    config: OdysseyConfig
    base_model_prefix = "model"
    _no_split_modules = ["OdysseyDecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, initializer_range) matrices, unit norms, zero pseudo-queries, KDA A_log = 0 (+ its
        dt_bias schedule), PyTorch's default for the short conv. Uses transformers.initialization so loaded
        weights are never overwritten."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            module.reset_parameters()  # kaiming-uniform taps (torch.nn.init is guarded by transformers here)
        elif isinstance(module, AttnResRead):
            init.zeros_(module.query)
            init.ones_(module.norm_weight)
        elif "RMSNorm" in type(module).__name__:
            init.ones_(module.weight)
        elif isinstance(module, KDAttention):
            init.zeros_(module.A_log)
            if not getattr(module.dt_bias, "_is_hf_initialized", False):
                # initial log-decay log-uniform in [-1, -1e-3] (as KDAttention.reset_gate_parameters)
                init.copy_(module.dt_bias, initial_dt_bias(module.dt_bias, module.g_min))
        elif isinstance(module, Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, LatentMoE):
            init.normal_(module.w_gate_up, mean=0.0, std=std)
            init.normal_(module.w_down_experts, mean=0.0, std=std)
        elif isinstance(module, PatchEmbed):
            # drawn without advancing the global RNG, so every other parameter of a seeded model gets the
            # values it had before vision existed
            with torch.random.fork_rng(devices=[]):
                init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
            init.constant_(module.pos_gain, std)  # the 2-D code starts at the token embeddings' scale


class OdysseyModel(OdysseyPreTrainedModel):
    """Backbone: embedding, decoder layers, final AttnRes read and RMSNorm. forward -> hidden [T, D]."""

    decoder_layer_class: type[OdysseyDecoderLayer] = OdysseyDecoderLayer

    def __init__(self, config: OdysseyConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_cls = self.decoder_layer_class
        self.layers = nn.ModuleList(layer_cls(config, l) for l in range(config.num_hidden_layers))
        self.final_read = AttnResRead(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe_layer_indices = [l for l, layer in enumerate(self.layers) if layer.is_moe]
        self.vision = None
        if config.vision_patch_size:
            with torch.random.fork_rng(devices=[]):  # its construction draws leave the global RNG untouched
                self.vision = PatchEmbed(config.vision_patch_size, config.hidden_size)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable()
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: OdysseyCache | None = None,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        images: ImagePatches | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: OdysseyHFCache | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> PackedRun | OdysseyModelOutput:
        """Two calling conventions.

        Packed (cu_seqlens given; the trainer, the engines, the vLLM plugin): input_ids [T], cu_seqlens
        int32 [N+1] -> (hidden [T, D], new layer caches | None, routed_experts [T, n_moe, k] | None,
        aux_loss | None).
        Inputs are assumed validated. A decode step (a cache, one new token per sequence) without autograd on
        fp32 CPU runs `decode_step`, the same layers through their fused small-batch paths.

        Hugging Face (cu_seqlens None): input_ids [B, T], attention_mask [B, T] or [B, past + T],
        position_ids, past_key_values (OdysseyHFCache), use_cache -> OdysseyModelOutput(last_hidden_state
        [B, T, D], past_key_values, aux_loss); see `forward_padded`.
        """
        if cu_seqlens is None:
            if images is not None:
                raise ValueError("images go with the packed call (cu_seqlens), not the padded one")
            if cache is not None:
                raise ValueError("cache (OdysseyCache) belongs to the packed call with cu_seqlens; a padded "
                                 "call takes past_key_values (OdysseyHFCache)")
            _check_hf_kwargs(kwargs)
            run = self.forward_padded(input_ids, attention_mask, position_ids, past_key_values,
                                      bool(use_cache), replay_experts, return_routed_experts)
            return OdysseyModelOutput(last_hidden_state=run.layout.unpack(run.hidden),
                                      past_key_values=run.past_key_values, aux_loss=run.aux_loss)
        return self._forward_packed(input_ids, cu_seqlens, cache, replay_experts, return_routed_experts,
                                    images)

    def forward_padded(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: OdysseyHFCache | None = None,
        use_cache: bool = False,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
    ) -> PaddedRun:
        """The packed forward on a Hugging Face-style batch (model/padding.py): the real tokens of each row
        are packed, run, and returned packed with their layout, so padded outputs equal packed ones exactly.

        input_ids [B, T] (or [T], one row). attention_mask [B, T] (the new columns) or [B, past + T]
        (transformers' convention with a cache: past columns first); 1 = real token, any padding pattern.
        position_ids [B, T]: unused by the model (NoPE: KDA and MLA take no positions), except without an
        attention_mask and cache, where a restart at 0 inside a row starts a new sequence (HF padding-free
        packing). past_key_values: an OdysseyHFCache (row b = batch row b); use_cache=True without one starts
        a new cache. replay_experts [B, T, n_moe, k] (R3) is packed the same way.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point:
            raise ValueError("input_ids must be an integer tensor of token ids [batch, seq_len]")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len] (or packed [T] with cu_seqlens), got shape "
                             f"{tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if past_key_values is not None and not isinstance(past_key_values, OdysseyHFCache):
            raise ValueError(f"past_key_values must be an OdysseyHFCache (model.model.new_cache() or None), "
                             f"got {type(past_key_values).__name__}: KDA's recurrent state and MLA's latents "
                             "do not fit a key/value cache")
        past = past_key_values
        if past is None and use_cache:
            past = OdysseyHFCache(self.config)
        seen = past.get_seq_length() if past is not None else 0
        cu_from_positions = None
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            if position_ids is not None:
                if position_ids.shape[-1] != T or position_ids.numel() != B * T:
                    raise ValueError(f"position_ids must be [batch, seq_len] = [{B}, {T}] like input_ids, "
                                     f"got {tuple(position_ids.shape)}")
                cu_from_positions = boundaries_from_position_ids(position_ids.reshape(B, T))
                if cu_from_positions is not None and seen:
                    raise ValueError("position_ids restarting at 0 (several sequences per row) cannot "
                                     "continue a cache: pass one sequence per row with an attention_mask")
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or \
                    attention_mask.shape[1] not in (T, seen + T):
                raise ValueError(f"attention_mask must be [batch, seq_len] = [{B}, {T}] or, with a cache "
                                 f"holding {seen} columns, [{B}, {seen + T}]; got "
                                 f"{tuple(attention_mask.shape)}")
            mask = attention_mask[:, attention_mask.shape[1] - T:]
        layout = PaddedLayout.from_mask(mask)
        ids = layout.pack(input_ids)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids hold ids in [{lo}, {hi}] but vocab_size is "
                                 f"{self.config.vocab_size}; was the tokenizer built for a different model?")
        replay = None
        if replay_experts is not None:
            n_moe, k = len(self.moe_layer_indices), self.config.num_experts_per_tok
            if tuple(replay_experts.shape) != (B, T, n_moe, k):
                raise ValueError(f"replay_experts must be [batch, seq_len, n_moe_layers, k] = [{B}, {T}, "
                                 f"{n_moe}, {k}], got {tuple(replay_experts.shape)}")
            replay = layout.pack(replay_experts)
        cu = layout.cu_seqlens if cu_from_positions is None else cu_from_positions
        if past is not None and cu_from_positions is not None:
            raise ValueError("position_ids restarting at 0 (several sequences per row) cannot build a cache: "
                             "call with use_cache=False")
        state = past.ensure_state(B, ids.device, self.dtype) if past is not None else None
        h, new_layers, routed, aux = self._forward_packed(ids, cu, state, replay, return_routed_experts)
        if past is not None:
            past.state = state.advanced(new_layers, layout.lens)
            past.seen_columns = seen + T
        return PaddedRun(h, layout, past, routed, aux)

    def new_cache(self) -> OdysseyHFCache:
        """An empty OdysseyHFCache for this model (its rows are created by the first forward)."""
        return OdysseyHFCache(self.config)

    def _forward_packed(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cache: OdysseyCache | None = None,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        images: ImagePatches | None = None,
    ) -> tuple[torch.Tensor, list[LayerCache] | None, torch.Tensor | None, torch.Tensor | None]:
        """The packed forward (see `forward`)."""
        has_images = images is not None and images.n > 0
        if cache is not None and not has_images and self._decode_eligible(input_ids, cu_seqlens, cache):
            return self.decode_step(input_ids, cu_seqlens, cache, replay_experts, return_routed_experts)
        stream = AttnResStream([self.embed(input_ids, images)])
        keep = cache is not None
        new_layers: list[LayerCache] | None = [] if keep else None
        checkpointed = self.gradient_checkpointing and not keep and torch.is_grad_enabled()
        routed, aux, j = [], None, 0  # j: index of the next MoE layer on the n_moe_layers axis
        for l, layer in enumerate(self.layers):
            replay = None
            if layer.is_moe and replay_experts is not None:
                replay = replay_experts[:, j]
            j += layer.is_moe
            if checkpointed:
                topk, layer_aux = self._checkpointed_layer(layer, stream, cu_seqlens, replay)
            else:
                layer_cache, topk = layer(stream, cu_seqlens, cache.layers[l] if keep else None, keep, replay)
                layer_aux = layer.mlp.aux_loss if layer.is_moe else None
            if keep:
                new_layers.append(layer_cache)
            if layer.is_moe:
                if return_routed_experts:
                    routed.append(topk)
                if layer_aux is not None:
                    aux = layer_aux if aux is None else aux + layer_aux
        h = self.final_read.read(stream, self.norm)
        routed_t = torch.stack(routed, dim=1) if routed else None
        return h, new_layers, routed_t, aux

    def embed(self, input_ids: torch.Tensor, images: ImagePatches | None = None) -> torch.Tensor:
        """x_0 [T, D]: token embeddings, with each image patch's embedding written over its <|image_pad|>."""
        x = self.embed_tokens(input_ids)
        if images is None or images.n == 0:
            return x
        e = self.vision(images.patches.to(x.device), images.grid_pos.to(x.device)).to(x.dtype)
        return x.index_copy(0, images.token_index.to(x.device), e)

    def _checkpointed_layer(self, layer: OdysseyDecoderLayer, stream: AttnResStream, cu_seqlens: torch.Tensor,
                            replay: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`layer` as a pure function of the AttnRes sources under `self._gradient_checkpointing_func`:
        it saves only the sources and recomputes the layer in the backward. Advances `stream` like
        `layer(stream, ...)`. Returns (topk_idx [T, k] | None, MoE aux loss | None)."""

        def run(partial, replay, *blocks):
            s = AttnResStream(list(blocks), partial)
            _, topk = layer(s, cu_seqlens, None, False, replay)
            out = s.partial if s.partial is not None else s.blocks[-1]  # the open block, or the one sealed
            return out, topk, layer.mlp.aux_loss if layer.is_moe else None

        out, topk, aux = self._gradient_checkpointing_func(run, stream.partial, replay, *stream.blocks)
        stream.set_open(out, seal=(layer.layer_idx + 1) % layer.attn_res.block_size == 0)
        return topk, aux

    def _decode_eligible(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: OdysseyCache
                         ) -> bool:
        """One token for each of the cache's rows, fp32 CPU without autograd, and every MLA layer attending
        to a cached latent (the absorbed form, as `GatedMLA.forward` picks it)."""
        n = input_ids.shape[0]
        if n == 0 or cache.n != n or fused_cpu.applies(self.embed_tokens.weight) is None:
            return False
        if seq_lens_from_cu(cu_seqlens, n) != [1] * n:
            return False
        return all(isinstance(c, MLALatentCache) and any(c.lens)
                   for t, c in zip(cache.layer_types, cache.layers) if t == "mla")

    def decode_step(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cache: OdysseyCache,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
    ) -> tuple[torch.Tensor, list[LayerCache], torch.Tensor | None, torch.Tensor | None]:
        """`forward` for one new token per cached sequence (input_ids [N], N = cache.n), layer by layer as in
        `OdysseyDecoderLayer.forward`, calling each sublayer's small-batch path directly: AttnRes read fused
        with the RMSNorm after it, `decode_step_fused` of KDA / MLA, `LatentMoE.forward_small`. A sublayer
        whose fused path does not apply runs its generic forward; the result is the same either way
        (tests/test_modeling.py checks decode_step against the layer-by-layer forward)."""
        stream = AttnResStream([self.embed_tokens(input_ids)])
        new_layers: list[LayerCache] = []
        routed, aux, j = [], None, 0
        for l, layer in enumerate(self.layers):
            past = cache.layers[l]
            x = layer.attn_res.read_attn(stream, layer.attn_norm)
            out = layer.mixer.decode_step_fused(x, past)
            a, new_cache = out if out is not None else layer.mix_normed(x, cu_seqlens, past, True)
            stream.add(a)
            new_layers.append(new_cache)
            x = layer.attn_res.read_ffn(stream, layer.ffn_norm)
            if layer.is_moe:
                replay = replay_experts[:, j] if replay_experts is not None else None
                j += 1
                small = layer.mlp.forward_small(x, replay)
                f, topk = small if small is not None else layer.mlp(x, replay)
                if return_routed_experts:
                    routed.append(topk)
                if layer.mlp.aux_loss is not None:
                    aux = layer.mlp.aux_loss if aux is None else aux + layer.mlp.aux_loss
            else:
                f = layer.mlp(x)
            stream.add(f)
            layer.attn_res.end_layer(stream)
        h = self.final_read.read(stream, self.norm)
        return h, new_layers, torch.stack(routed, dim=1) if routed else None, aux


def _is_zero(x: int | torch.Tensor) -> bool:
    return isinstance(x, int) and x == 0


def _kept_columns(logits_to_keep: int | torch.Tensor, T: int, device: torch.device) -> torch.Tensor | None:
    """HF's logits_to_keep: 0 = all columns (None), k > 0 = the last k, a 1-D tensor = those columns."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0 = all positions), got {logits_to_keep}")
        if logits_to_keep == 0:
            return None
        return torch.arange(max(T - logits_to_keep, 0), T, device=device)
    return logits_to_keep.to(device=device, dtype=torch.long).reshape(-1)


def _packed_loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                 aux: torch.Tensor | None, num_items_in_batch: int | torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Mean next-token NLL of packed logits [T, V] against labels [T] shifted inside each sequence of
    cu_seqlens (position t predicts labels[t+1] of its own sequence), -100 and image tokens masked, + aux.
    With num_items_in_batch: the summed NLL divided by it (HF trainers' gradient-accumulation
    normalisation)."""
    T = labels.shape[0]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    if T > 1:
        shifted[:-1] = labels[1:]
    ends = cu_seqlens[1:].long() - 1
    shifted[ends[ends >= 0]] = IGNORE_INDEX  # never predict across a sequence boundary
    shifted[is_image_token(shifted)] = IGNORE_INDEX  # image tokens carry no LM loss
    if num_items_in_batch is None:
        loss = F.cross_entropy(logits.float(), shifted, ignore_index=IGNORE_INDEX)
    else:
        loss = F.cross_entropy(logits.float(), shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / num_items_in_batch
    return loss + aux if aux is not None else loss


def _chunk_logprobs(h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """log softmax(W h)[target] in fp32 for one chunk: h [c, D], targets [c], W [V, D] -> [c]."""
    logits = F.linear(h, weight).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


class OdysseyForCausalLM(OdysseyPreTrainedModel, GenerationMixin):
    """Causal LM head over `OdysseyModel`. See the module docstring for the input layout.

    A transformers `GenerationMixin`: `generate`, `pipeline("text-generation")` and TRL use the padded
    convention of `forward` and an `OdysseyHFCache` (docs/hf.md).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_stateful = True  # recurrent KDA state: no cache rollback (assisted generation is refused by generate)

    def __init__(self, config: OdysseyConfig) -> None:
        super().__init__(config)
        self.model = OdysseyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # ---- HF plumbing ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> OdysseyForCausalLM:
        """`PreTrainedModel.from_pretrained`, then CPU tensors that safetensors left at unaligned (mmap)
        addresses are copied to fresh 64-byte-aligned storage: CPU matmul kernels pick their code path by
        alignment, so without this a reloaded model's logits differ from the saved model's in the last
        bits."""
        model = super().from_pretrained(*args, **kwargs)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.device.type == "cpu" and t.data_ptr() % 64:
                    t.data = t.data.clone()
        return model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head(h) for the few positions a decode step samples from, h [n, D] -> [n, V]: without autograd
        through a cached transposed head weight (about twice as fast for a few rows), else lm_head(h)."""
        grad = torch.is_grad_enabled() and (h.requires_grad or self.lm_head.weight.requires_grad)
        if h.dim() == 2 and not grad:
            return small_linear(h, self.lm_head)
        return self.lm_head(h)

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @property
    def moe_layer_indices(self) -> list[int]:
        """Layer ids with a LatentMoE FFN, in order: the n_moe_layers axis of replay/routed experts."""
        return list(self.model.moe_layer_indices)

    def moe_layers(self) -> list[nn.Module]:
        """The LatentMoE FFN modules, in moe_layer_indices order."""
        return [self.model.layers[l].mlp for l in self.model.moe_layer_indices]

    # ---- input handling -------------------------------------------------------------------------
    def _pack(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, extra: torch.Tensor | None,
        extra_name: str,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None, tuple | None]:
        """Validate and flatten to packed form. Returns (ids [T], cu_seqlens int32 [N+1], lens, extra packed,
        batch shape (B, T) for 2-D input or None)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point:
            raise ValueError("input_ids must be an integer tensor of token ids, [T] (packed) or [B, T]")
        batch_shape = None
        if input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens is only for packed 1-D input_ids [T]; for [B, T] input leave it "
                                 "None (each row is one sequence)")
            B, T = input_ids.shape
            batch_shape = (B, T)
            input_ids = input_ids.reshape(B * T)
            cu_seqlens = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=input_ids.device) if T else \
                torch.zeros(B + 1, dtype=torch.int32, device=input_ids.device)
            if extra is not None:
                extra = extra.reshape(B * T, *extra.shape[2:])
        elif input_ids.dim() == 1:
            if cu_seqlens is None:
                cu_seqlens = torch.tensor([0, input_ids.shape[0]], dtype=torch.int32, device=input_ids.device)
        else:
            raise ValueError(f"input_ids must be [T] (packed, with cu_seqlens) or [B, T], got shape "
                             f"{tuple(input_ids.shape)}")
        lens = seq_lens_from_cu(cu_seqlens, input_ids.shape[0])
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids hold ids in [{lo}, {hi}] but vocab_size is "
                                 f"{self.config.vocab_size}; was the tokenizer built for a different model?")
        if extra is not None and extra.shape[0] != input_ids.shape[0]:
            raise ValueError(f"{extra_name} must have one row per token ({input_ids.shape[0]}), got "
                             f"{tuple(extra.shape)}")
        return input_ids, cu_seqlens, lens, extra, batch_shape

    def _check_replay(self, replay: torch.Tensor | None, T: int) -> None:
        if replay is None:
            return
        n_moe, k = len(self.moe_layer_indices), self.config.num_experts_per_tok
        if n_moe == 0:
            raise ValueError("replay_experts given but this model has no MoE layers (n_routed_experts == 0)")
        if replay.shape != (T, n_moe, k):
            raise ValueError(f"replay_experts must be [T, n_moe_layers, k] = [{T}, {n_moe}, {k}] (for [B, T] "
                             f"input: [B, T, {n_moe}, {k}]), got {tuple(replay.shape)}")

    def _check_images(self, images: ImagePatches | None, ids: torch.Tensor) -> None:
        """Images must match the model and point at <|image_pad|> tokens of the packed input ids [T]."""
        if images is None:
            return
        if not isinstance(images, ImagePatches):
            raise ValueError(f"images must be a model.vision.ImagePatches (build it with "
                             f"ImagePatches.from_images), got {type(images).__name__}")
        p = self.config.vision_patch_size
        if p == 0:
            raise ValueError("images given but this model is text-only (vision_patch_size=0); use a preset "
                             "with vision settings or set vision_patch_size")
        P = images.n
        if images.patches.shape != (P, 3 * p * p) or images.grid_pos.shape != (P, 2):
            raise ValueError(f"images.patches must be [P, 3·p²] = [{P}, {3 * p * p}] and grid_pos [{P}, 2] "
                             f"for patch size {p}, got {tuple(images.patches.shape)} and "
                             f"{tuple(images.grid_pos.shape)}")
        if P == 0:
            return
        idx = images.token_index
        increasing = P == 1 or bool((idx.diff() > 0).all())
        if idx.dim() != 1 or int(idx.min()) < 0 or int(idx.max()) >= ids.shape[0] or not increasing:
            raise ValueError(f"images.token_index must be strictly increasing positions in "
                             f"[0, {ids.shape[0]}) of the packed input")
        bad = ids[idx.to(ids.device)] != IMAGE_PAD_ID
        if bool(bad.any()):
            t = int(idx[bad.cpu()][0])
            raise ValueError(f"image patch at token {t} sits on id {int(ids[t])}, not <|image_pad|> "
                             f"({IMAGE_PAD_ID}); build input ids with model.vision.image_token_ids and "
                             "patches with ImagePatches.from_images at the block's start position")

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: OdysseyCache | None = None,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = False,
        images: ImagePatches | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: OdysseyHFCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> OdysseyOutput:
        """Packed: input_ids [T] + cu_seqlens int32 [N+1] (or [B, T] equal-length rows) -> OdysseyOutput.

        cache: the N sequences' OdysseyCache (new tokens are appended to row n); use_cache=True with no
        cache starts from an empty one. The returned cache is new; the given one is left untouched.
        labels: same shape as input_ids; position t is trained to predict labels[t+1] of the same
        sequence (HF convention, shifted inside each packed sequence); IGNORE_INDEX (-100) masks a target,
        and image tokens (<|image_start|> .. <|image_end|>) are never targets.
        images: the patches of the images in the input (`ImagePatches`; token_index into the packed [T], or
        the flattened B·T positions for [B, T] input).

        Padded (Hugging Face): any of attention_mask, position_ids, past_key_values or logits_to_keep
        selects `forward_padded`: input_ids [B, T] with padding anywhere, logits [B, T, V] (zeros at padding
        positions), past_key_values an OdysseyHFCache advanced in place. Exactly the packed outputs of the
        rows' real tokens (model/padding.py). Images go with the packed form only.
        """
        padded = [name for name, v in (("attention_mask", attention_mask), ("position_ids", position_ids),
                                       ("past_key_values", past_key_values)) if v is not None]
        padded += [] if _is_zero(logits_to_keep) else ["logits_to_keep"]
        if padded or kwargs:
            if images is not None:
                raise ValueError("images go with the packed form (input_ids [T] + cu_seqlens, or [B, T] rows "
                                 "without padding), not with attention_mask / past_key_values")
            if cu_seqlens is not None or cache is not None:
                raise ValueError(f"pass either the packed form (cu_seqlens, cache) or the padded form "
                                 f"(attention_mask, position_ids, past_key_values, ...), not both; got "
                                 f"{', '.join(padded + sorted(kwargs))} with the packed form")
            _check_hf_kwargs(kwargs)
            return self.forward_padded(input_ids, attention_mask, position_ids, past_key_values,
                                       bool(use_cache), labels, logits_to_keep, replay_experts,
                                       return_routed_experts, kwargs.get("num_items_in_batch"))
        ids, cu, lens, replay, batch_shape = self._pack(input_ids, cu_seqlens, replay_experts,
                                                        "replay_experts")
        T = ids.shape[0]
        self._check_replay(replay, T)
        self._check_images(images, ids)
        if cache is None and use_cache:
            cache = OdysseyCache.empty(self.config, len(lens), device=ids.device, dtype=self.dtype)
        if cache is not None and cache.n != len(lens):
            raise ValueError(f"cache has {cache.n} rows but the input holds {len(lens)} sequences; row n of "
                             "the cache is sequence n of cu_seqlens (use cache.select / OdysseyCache.concat)")
        h, new_layers, routed, aux = self.model(ids, cu, cache, replay, return_routed_experts, images)
        logits = self.lm_head(h)
        new_cache = cache.advanced(new_layers, lens) if cache is not None else None

        loss = None
        if labels is not None:
            loss = _packed_loss(logits, labels.reshape(T).to(ids.device), cu, aux)

        hf_cache = None
        if batch_shape is not None:
            logits = logits.reshape(*batch_shape, -1)
            if routed is not None:
                routed = routed.reshape(*batch_shape, *routed.shape[1:])
            if new_cache is not None:  # the same state, for a Hugging Face-style next call
                hf_cache = OdysseyHFCache(self.config, new_cache, seen_columns=batch_shape[1])
        return OdysseyOutput(logits=logits, cache=new_cache, routed_experts=routed, aux_loss=aux, loss=loss,
                             past_key_values=hf_cache)

    def forward_padded(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: OdysseyHFCache | None = None,
        use_cache: bool = False,
        labels: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        replay_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> OdysseyOutput:
        """The padded (Hugging Face) forward: `OdysseyModel.forward_padded`, then the LM head on real tokens.

        Returns OdysseyOutput with logits [B, T', V] (T' = T, or the last logits_to_keep columns; an index
        tensor selects those columns), zeros at padding positions; past_key_values: the advanced cache (also
        returned by generate); routed_experts [B, T, n_moe, k] when asked.
        labels [B, T]: a real token predicts the label of the next real token of its row (with right or left
        padding that is HF's labels[:, t+1]); labels at padding positions are never targets; -100 masks.
        loss = mean NLL over the targets (sum / num_items_in_batch when given, as HF trainers pass it)
        + aux_loss.
        """
        run = self.model.forward_padded(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                                        replay_experts, return_routed_experts)
        layout, h = run.layout, run.hidden
        B, T = layout.shape
        loss = None
        if labels is not None:
            if labels.numel() != B * T or labels.shape[-1] != T:
                raise ValueError(f"labels must be [batch, seq_len] = [{B}, {T}] like input_ids, got "
                                 f"{tuple(labels.shape)}")
            lab = layout.pack(labels.reshape(B, T).to(h.device))
            logits_all = self.lm_head(h)
            loss = _packed_loss(logits_all, lab, layout.cu_seqlens, run.aux_loss, num_items_in_batch)
        cols = _kept_columns(logits_to_keep, T, h.device)
        if cols is None:
            logits = layout.unpack(self.lm_head(h) if labels is None else logits_all)
        else:  # the LM head only on the real tokens of the kept columns
            keep = torch.zeros_like(layout.keep)
            keep[:, cols] = layout.keep[:, cols]
            sel = keep.reshape(-1)[layout.index]  # [n] bool: packed token is in a kept column
            sub = self.lm_head(h[sel])
            full = sub.new_zeros(B * T, sub.shape[-1]).index_copy(0, layout.index[sel], sub)
            logits = full.reshape(B, T, -1)[:, cols]
        routed = layout.unpack(run.routed_experts) if run.routed_experts is not None else None
        return OdysseyOutput(logits=logits, routed_experts=routed, aux_loss=run.aux_loss, loss=loss,
                             past_key_values=run.past_key_values)

    # ---- generate -------------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict,
                                      *args: Any, **kwargs: Any) -> None:
        """generate's cache: an OdysseyHFCache (transformers would build a DynamicCache from layer_types,
        which has no KDA / latent-MLA layer)."""
        user = model_kwargs.get("past_key_values")
        if user is not None:
            if not isinstance(user, OdysseyHFCache):
                raise ValueError(f"past_key_values must be an OdysseyHFCache (model.model.new_cache()), got "
                                 f"{type(user).__name__}")
            user._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not "
                             "supported by OdysseyForCausalLM: leave it unset (it has its own cache)")
        model_kwargs["past_key_values"] = OdysseyHFCache(self.config)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        replay_experts: torch.Tensor | None = None,
        chunk_size: int = 1024,
        images: ImagePatches | None = None,
    ) -> torch.Tensor:
        """log p(targets[t] | tokens <= t of t's sequence), fp32, shaped like input_ids.

        targets: same shape as input_ids, the token to score at each position (usually the next token).
        The LM head and log-softmax run over chunks of `chunk_size` positions, under activation
        checkpointing when gradients are on, so at most one [chunk_size, V] logits block exists at a time
        (forward and backward). images: as in `forward`.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(targets.shape)}")
        ids, cu, _, replay, batch_shape = self._pack(input_ids, cu_seqlens, replay_experts, "replay_experts")
        T = ids.shape[0]
        self._check_replay(replay, T)
        self._check_images(images, ids)
        tg = targets.reshape(T).to(device=ids.device, dtype=torch.long)
        if T and (int(tg.min()) < 0 or int(tg.max()) >= self.config.vocab_size):
            raise ValueError(f"targets must be token ids in [0, {self.config.vocab_size}); mask positions "
                             "you do not score after the call instead of passing -100")
        h, _, _, _ = self.model(ids, cu, None, replay, False, images)
        w = self.lm_head.weight
        out = []
        for s in range(0, T, chunk_size):
            hc, tc = h[s:s + chunk_size], tg[s:s + chunk_size]
            if torch.is_grad_enabled() and (hc.requires_grad or w.requires_grad):
                out.append(checkpoint(_chunk_logprobs, hc, tc, w, use_reentrant=False))
            else:
                out.append(_chunk_logprobs(hc, tc, w))
        lp = torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)
        return lp.reshape(batch_shape) if batch_shape is not None else lp

    # ---- MoE hooks ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_router_biases(self) -> None:
        """Apply every MoE layer's pending balancing-bias update (call right after optimizer.step())."""
        for moe in self.moe_layers():
            moe.update_bias()

    def expert_load_metrics(self) -> dict[str, Any]:
        """Expert-load metrics of the last step for logging: per layer ("moe/layer{l}/<metric>", layer index l
        as in moe_layer_indices) plus summaries over layers (see model.moe.aggregate_load_metrics)."""
        if not self.moe_layer_indices:
            return {}
        per_layer = {l: self.model.layers[l].mlp.load_metrics() for l in self.moe_layer_indices}
        return aggregate_load_metrics(per_layer)


AutoConfig.register(OdysseyConfig.model_type, OdysseyConfig, exist_ok=True)
AutoModel.register(OdysseyConfig, OdysseyModel, exist_ok=True)
AutoModelForCausalLM.register(OdysseyConfig, OdysseyForCausalLM, exist_ok=True)
