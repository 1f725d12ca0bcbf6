"""The Odyssey model as a vLLM plugin (entry point group ``vllm.general_plugins``, see pyproject.toml).

vLLM calls `register` in every process it starts (driver, engine core, workers). It registers the
``odyssey_moe`` config with transformers' AutoConfig and the architecture ``OdysseyForCausalLM`` (what
`OdysseyForCausalLM.save_pretrained` writes into config.json) with vLLM's ModelRegistry, pointing at
`model.vllm_plugin.modeling.OdysseyVllmForCausalLM`. Registration is idempotent and imports vLLM's
model code lazily (the class is named by a string).

Layer mapping (docs/vllm.md): KDA -> a vLLM hybrid-state ("mamba") layer whose recurrent and conv states
live in vLLM's state cache (`kda.py`); gated MLA -> MQA over the compressed latent through vLLM's paged
`Attention` (`mla.py`); LatentMoE -> our own dispatch with routing capture (`moe.py`); Block AttnRes,
norms, embeddings and the decoder loop are `model.modeling`'s, unchanged.
"""

from __future__ import annotations

ARCHITECTURE = "OdysseyForCausalLM"
MODEL_CLASS = "model.vllm_plugin.modeling:OdysseyVllmForCausalLM"


def register() -> None:
    """Register the config with AutoConfig and the model with vLLM's ModelRegistry (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from model.config import OdysseyConfig

    AutoConfig.register(OdysseyConfig.model_type, OdysseyConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


def attention_hf_overrides(config: dict) -> dict[str, int]:
    """The attention shape vLLM's generic code reads from the HF config (block-size alignment of the
    hybrid cache): the MLA layers are MQA over the latent, mla_num_heads query heads, one KV head of size
    mla_kv_lora_rank. Pass as ``hf_overrides`` (``--hf-overrides`` for `vllm serve`)."""
    return {"num_attention_heads": int(config["mla_num_heads"]), "num_key_value_heads": 1,
            "head_dim": int(config["mla_kv_lora_rank"])}
