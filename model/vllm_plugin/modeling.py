"""`OdysseyVllmForCausalLM`: the Odyssey policy as a vLLM hybrid model (attention + recurrent state).

It is `model.modeling.OdysseyModel` (embedding, Block AttnRes, decoder loop, final norm) with three layer
classes swapped for their vLLM versions (`OdysseyDecoderLayer.mixer_classes` / `moe_class`):

    KDA   -> `VllmKDA`        state in vLLM's state cache (MambaBase, LINEAR backend metadata)
    MLA   -> `VllmGatedMLA`   MQA over the latent through vLLM's paged Attention
    MoE   -> `VllmLatentMoE`  the trainer's routing and dispatch, no statistics

vLLM packs the tokens of all scheduled requests into one batch [T] with query_start_loc [N+1]; that is
exactly the trainer's packed layout (cu_seqlens), so the forward is the trainer's. AttnRes and FFNs are
per token; KDA keeps one state slot per request, attention is per request: sequences never mix.
Parameter names are the checkpoint's (`OdysseyForCausalLM.save_pretrained`), so weights load 1:1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from model.config import OdysseyConfig
from model.fused_weights import clear_weight_caches
from model.modeling import OdysseyDecoderLayer, OdysseyModel
from model.vllm_plugin.kda import VllmKDA, kda_layer_name, kda_state_dtypes, kda_state_shapes, new_step
from model.vllm_plugin.mla import VllmGatedMLA, mla_attention_name
from model.vllm_plugin.moe import VllmLatentMoE
from model.vllm_plugin.routing import RoutedExpertsLog


class VllmDecoderLayer(OdysseyDecoderLayer):
    mixer_classes = {"kda": VllmKDA, "mla": VllmGatedMLA}
    moe_class = VllmLatentMoE


class VllmOdysseyModel(OdysseyModel):
    decoder_layer_class = VllmDecoderLayer


def checkpoint_names(model: nn.Module) -> set[str]:
    """Names a checkpoint provides: every parameter and persistent buffer, except vLLM's attention
    internals (`.attn.`: KV-cache scales and the like, which no checkpoint of ours has)."""
    return {n for n in model.state_dict() if ".attn." not in n}


class OdysseyVllmForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM model class of architecture ``OdysseyForCausalLM`` (see the module docstring)."""

    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not isinstance(config, OdysseyConfig):
            raise ValueError(f"OdysseyVllmForCausalLM needs an OdysseyConfig (model_type 'odyssey_moe'), got "
                             f"{type(config).__name__}; is model.vllm_plugin registered?")
        self.config = config
        self.model = VllmOdysseyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kda_names = [kda_layer_name(l) for l in config.kda_layer_indices]
        self.mla_names = [mla_attention_name(l) for l in config.mla_layer_indices]
        self.has_moe = bool(config.moe_layer_indices)
        self.routed_experts_log = RoutedExpertsLog()
        self._step_routing: tuple[np.ndarray, np.ndarray] | None = None
        # seconds in this model's forward and in the runner's execute_model (input preparation + forward;
        # added by routing.install), for bench/vllm_engine.py's "where the time goes"
        self.timing = {"forward_s": 0.0, "execute_model_s": 0.0, "forwards": 0}

    # ---- vLLM hybrid-state interface --------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return kda_state_shapes(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return kda_state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # ---- forward ----------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _batch_layout(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """query_start_loc [N+1] int32 of the scheduled requests (their real tokens: cu[-1] <= T).
        Profile / warm-up runs carry no metadata: all T tokens form one sequence."""
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            for name in self.kda_names:
                m = meta.get(name)
                if m is not None:
                    return m.query_start_loc[: m.num_prefills + m.num_decodes + 1].to(torch.int32)
            for name in self.mla_names:
                m = meta.get(name)
                if m is not None:
                    return m.query_start_loc.to(torch.int32)
        return torch.tensor([0, num_tokens], dtype=torch.int32, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: object = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("OdysseyVllmForCausalLM takes token ids, not inputs_embeds")
        t0 = time.perf_counter()
        new_step()
        T = input_ids.shape[0]
        cu = self._batch_layout(T, input_ids.device)
        n = int(cu[-1])
        h, _, routed, _ = self.model(input_ids[:n], cu, None, None, self.has_moe)
        if routed is not None:
            self._step_routing = (positions[:n].cpu().numpy().astype(np.int64),
                                  routed.cpu().numpy().astype(np.uint16))
        if n < T:
            h = torch.cat([h, h.new_zeros(T - n, h.shape[-1])])
        self.timing["forward_s"] += time.perf_counter() - t0
        self.timing["forwards"] += 1
        return h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def take_step_routing(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions, experts) of the last forward's real tokens, once (see model/vllm_plugin/routing.py)."""
        step, self._step_routing = self._step_routing, None
        return step

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in place (parameters and buffers, same names as the trainer's
        state_dict). Unknown names and shape mismatches raise, naming the tensor."""
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        wanted = checkpoint_names(self)
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in wanted:
                    raise ValueError(f"checkpoint tensor {name!r} is not a parameter of the Odyssey vLLM "
                                     "model; was it saved from a different config?")
                dst = targets[name]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                     f"expects {tuple(dst.shape)}; was it saved from a different config?")
                # vLLM's loader convention: a parameter's own weight_loader (reload_weights wraps it to
                # buffer the tensor while the layer is being re-materialised); buffers are copied
                loader = getattr(dst, "weight_loader", None)
                if loader is not None:
                    loader(dst, tensor)
                elif isinstance(dst, nn.Parameter):
                    default_weight_loader(dst, tensor)
                else:
                    dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
                loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        clear_weight_caches(self)  # the loaders write through aliases the caches cannot see
        return loaded
