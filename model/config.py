"""`OdysseyConfig`: every dimension of the hybrid KDA/MLA sparse-MoE policy, and its presets.

Layer stack (DESIGN.md, "Model"): ``num_hidden_layers`` decoder layers, each

    h = AttnRes_attn(sources);  a = Mixer(RMSNorm(h))      Mixer = KDA or gated MLA (``layer_types[l]``)
    h = AttnRes_ffn(sources);   f = FFN(RMSNorm(h))        FFN = DenseFFN (l < first_k_dense) or LatentMoE

with Block Attention Residuals (``attn_res_block_size`` layers per block) instead of the plain residual sum.

Presets (``OdysseyConfig.from_preset(name, **overrides)``):

- ``tiny``: tests. 8 layers ([kda,kda,kda,mla] x 2), hidden 128, every head 32 wide (vLLM's CPU attention
  needs head size >= 32), 16 routed experts top-2 + 1 shared expert in a 64-wide latent.
- ``small``: benchmarks. 12 layers, hidden 512, 64 routed experts top-4.
- ``k3``: the full Kimi-K3-class model. It is only ever built on the meta device (``model.count``).

k3: public facts and the assumptions we had to make
----------------------------------------------------
Public: 93 layers = 23 x [KDA, KDA, KDA, MLA] + 1 MLA (69 KDA + 24 MLA), hidden 7168, 896 routed experts,
top-16, expert latent 3584, routed-expert intermediate 3072, 2 shared experts, first layer dense,
1M context, about 2.8T total / 104B active parameters.

Assumed (chosen from the Kimi K2 / Kimi Linear lineage, then the shared-expert width was set so that
``count_parameters`` lands on the public totals; see docs/model.md for the breakdown):

- vocab_size 163840 (Kimi K2 tokenizer), untied embedding and LM head;
- KDA: 64 heads x head_dim 128 (K = V = 128; Kimi Linear uses 128), short conv 4, g_min -5;
- MLA: 64 heads x head_dim 128 (NoPE, qk = v = 128), q_lora_rank 1536, kv_lora_rank 512 (K2 values);
- dense FFN (layer 0) intermediate 18432 (K2's dense intermediate);
- shared experts: 2 full-width SiTU-GLU experts, intermediate 6912 each (the free parameter we fitted);
- AttnRes: 12 layers per block (8 blocks for 93 layers, like the AttnRes paper's ~8 blocks);
- rms_norm_eps 1e-6.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

from model.balancing import BALANCING_METHODS as BALANCING

LAYER_TYPES = ("kda", "mla")
LAYER_PATTERN = ("kda", "kda", "kda", "mla")


def default_layer_types(num_layers: int) -> list[str]:
    """[kda, kda, kda, mla] repeated, truncated to ``num_layers``."""
    return [LAYER_PATTERN[i % len(LAYER_PATTERN)] for i in range(num_layers)]


@strict
class OdysseyConfig(PretrainedConfig):
    """Configuration of `OdysseyForCausalLM`. Defaults are the ``tiny`` preset.

    Field groups (shapes use D = hidden_size):

    - backbone: vocab_size, hidden_size (D), num_hidden_layers, layer_types ("kda" | "mla" per layer;
      derived from the [kda,kda,kda,mla] pattern when None), rms_norm_eps, tie_word_embeddings,
      initializer_range, max_position_embeddings (informational: no positional encoding anywhere).
    - KDA: kda_num_heads (H), kda_head_dim (K = V), kda_conv_size, kda_g_min (lower bound of log-decay),
      kda_chunk_size.
    - MLA: mla_num_heads, mla_q_lora_rank (0 = plain q projection), mla_kv_lora_rank (the cached latent
      width R), mla_head_dim (qk and v head dim; NoPE).
    - AttnRes: attn_res_block_size (decoder layers per block).
    - FFN: intermediate_size (dense SiTU-GLU of layers < first_k_dense), first_k_dense.
    - MoE: n_routed_experts (0 => every FFN dense), num_experts_per_tok (k), n_shared_experts,
      moe_latent_dim, moe_intermediate_size (per routed expert, in the latent),
      shared_expert_intermediate_size, balancing, bias_update_speed, aux_loss_coef,
      quantile_exact_max_tokens, quantile_hist_bins, routed_scaling_factor, moe_load_window (steps over
      which `expert_load_metrics()` reports experts that received no token).
    - vision (native patch embedding into the same backbone, model/vision.py): vision_patch_size (p; 0 = a
      text-only model with no patch embedding), vision_max_pixels (an image is resized so that its height
      and width are multiples of p and height·width <= vision_max_pixels; `model.vision.image_grid`).
    """

    model_type = "odyssey_moe"
    keys_to_ignore_at_inference = ["cache"]
    # no remote code: the classes register with the Auto classes on import (model.modeling). Tools that read
    # config.auto_map (TRL's create_model_from_path, AutoModel*.from_pretrained) find no entry and use the
    # registered AutoModelForCausalLM. A class attribute: never written to config.json.
    auto_map = MappingProxyType({})

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 8
    layer_types: list[str] | None = None
    rms_norm_eps: float | int = 1e-6
    initializer_range: float | int = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1_048_576
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_g_min: float | int = -5.0
    kda_chunk_size: int = 64
    # MLA
    mla_num_heads: int = 4
    mla_q_lora_rank: int = 0
    mla_kv_lora_rank: int = 64
    mla_head_dim: int = 32
    # AttnRes
    attn_res_block_size: int = 2
    # FFN
    intermediate_size: int = 384
    first_k_dense: int = 1
    # MoE
    n_routed_experts: int = 16
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_latent_dim: int = 64
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    balancing: str = "quantile"
    bias_update_speed: float | int = 1e-3
    aux_loss_coef: float | int = 1e-2
    quantile_exact_max_tokens: int = 65536
    quantile_hist_bins: int = 1024
    routed_scaling_factor: float | int = 1.0
    moe_load_window: int = 100
    # vision (model/vision.py)
    vision_patch_size: int = 8
    vision_max_pixels: int = 64 * 64
    # special tokens
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        else:
            self.layer_types = list(self.layer_types)
        # configs saved before vision carry the reserved ViT-tower fields at their defaults: drop those, and
        # read their vision_patch_size=14 (the reserved default, never wired) as what it meant: text only
        if "vision_hidden_size" in kwargs and self.vision_patch_size == 14:
            self.vision_patch_size = 0
        legacy = [n for n, d in LEGACY_VISION_FIELDS.items() if n in kwargs and kwargs.pop(n) != d]
        if legacy:
            raise ValueError(f"{', '.join(legacy)}: the reserved ViT-tower fields are gone (vision is a "
                             "native patch embedding, model/vision.py); use vision_patch_size / "
                             "vision_max_pixels")
        super().__post_init__(**kwargs)

    # ---- validation (run by @strict after __init__ and before save_pretrained) -------------------
    def validate_layer_type(self) -> None:
        """Our layer types are "kda" / "mla" (overrides transformers' attention-type check)."""
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad}; "
                             "leave layer_types unset for the default [kda,kda,kda,mla] pattern")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers="
                             f"{self.num_hidden_layers}; give one type per layer or leave layer_types unset")

    def validate_odyssey(self) -> None:
        """Shape and range checks with messages that name the field and the fix."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                    "kda_conv_size", "kda_chunk_size", "mla_num_heads", "mla_kv_lora_rank", "mla_head_dim",
                    "attn_res_block_size", "intermediate_size"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mla_q_lora_rank < 0:
            raise ValueError(f"mla_q_lora_rank must be >= 0 (0 = no q compression), "
                             f"got {self.mla_q_lora_rank}")
        if not self.kda_g_min < 0:
            raise ValueError(f"kda_g_min is the lower bound of the log-decay and must be < 0, "
                             f"got {self.kda_g_min}")
        if self.kda_chunk_size % 16 != 0:
            raise ValueError(f"kda_chunk_size must be a multiple of the 16-token tile, "
                             f"got {self.kda_chunk_size}")
        if not 0 <= self.first_k_dense <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                             f"got {self.first_k_dense}")
        if self.vision_patch_size < 0:
            raise ValueError(f"vision_patch_size must be >= 0 (0 = text only), got {self.vision_patch_size}")
        if self.vision_patch_size > 0:
            p = self.vision_patch_size
            if self.vision_max_pixels < p * p:
                raise ValueError(f"vision_max_pixels={self.vision_max_pixels} is smaller than one {p}x{p} "
                                 f"patch; set it to at least {p * p}")
            if self.hidden_size % 4:
                raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of 4 for the 2-D patch "
                                 "position code; or set vision_patch_size=0 (text only)")
        if self.balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {self.balancing!r}")
        if self.n_routed_experts < 0:
            raise ValueError(f"n_routed_experts must be >= 0 (0 = all FFNs dense), "
                             f"got {self.n_routed_experts}")
        if self.n_routed_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts="
                                 f"{self.n_routed_experts}], got {self.num_experts_per_tok}")
            for name in ("moe_latent_dim", "moe_intermediate_size"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1 when n_routed_experts > 0, "
                                     f"got {getattr(self, name)}")
            if self.n_shared_experts < 0:
                raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
            if self.n_shared_experts > 0 and self.shared_expert_intermediate_size < 1:
                raise ValueError("shared_expert_intermediate_size must be >= 1 when n_shared_experts > 0")

    # ---- derived -----------------------------------------------------------------------------------
    @property
    def moe_layer_indices(self) -> list[int]:
        """Layer ids whose FFN is a LatentMoE, in order (the n_moe_layers axis of routed/replayed experts)."""
        if self.n_routed_experts == 0:
            return []
        return list(range(self.first_k_dense, self.num_hidden_layers))

    @property
    def kda_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    # ---- presets -----------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> OdysseyConfig:
        """Build a preset ("tiny", "small", "k3") with field overrides.

        Example: ``OdysseyConfig.from_preset("tiny", n_routed_experts=0)``.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            fields.pop("layer_types", None)  # re-derive the pattern for the new depth
        fields.update(overrides)
        return cls(**fields)


#: fields of the former reserved ViT-tower design; configs saved before vision (all at their defaults) still
#: load, as the text-only models they were (vision_patch_size 0): the defaults are dropped, any other value
#: is an error (`OdysseyConfig.__post_init__`)
LEGACY_VISION_FIELDS: dict[str, Any] = {
    "vision_hidden_size": 0,
    "vision_num_layers": 0,
    "vision_num_heads": 0,
    "image_token_id": None,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=4096, hidden_size=128, num_hidden_layers=8,
        kda_num_heads=4, kda_head_dim=32,
        mla_num_heads=4, mla_head_dim=32, mla_q_lora_rank=0, mla_kv_lora_rank=64,
        attn_res_block_size=2, intermediate_size=384, first_k_dense=1,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
        moe_latent_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        max_position_embeddings=65536,
        vision_patch_size=8, vision_max_pixels=64 * 64,
    ),
    "small": dict(
        vocab_size=32768, hidden_size=512, num_hidden_layers=12,
        kda_num_heads=8, kda_head_dim=64,
        mla_num_heads=8, mla_head_dim=64, mla_q_lora_rank=256, mla_kv_lora_rank=128,
        attn_res_block_size=3, intermediate_size=1536, first_k_dense=1,
        n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1,
        moe_latent_dim=256, moe_intermediate_size=256, shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        vision_patch_size=16, vision_max_pixels=256 * 256,
    ),
    "k3": dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
        layer_types=default_layer_types(92) + ["mla"],  # 23 x [kda,kda,kda,mla] + 1 mla
        kda_num_heads=64, kda_head_dim=128,
        mla_num_heads=64, mla_head_dim=128, mla_q_lora_rank=1536, mla_kv_lora_rank=512,
        attn_res_block_size=12, intermediate_size=18432, first_k_dense=1,
        n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2,
        moe_latent_dim=3584, moe_intermediate_size=3072, shared_expert_intermediate_size=6912,
        max_position_embeddings=1_048_576,
        vision_patch_size=16, vision_max_pixels=1024 * 1024,
    ),
}
