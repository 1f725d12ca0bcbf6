"""Importing a Kimi Linear checkpoint (transformers' `kimi_linear`) into Odyssey's own model: what maps.

Layer by layer, against model/config.py's OdysseyConfig:

    maps     KDA token mixing (q/k/v projections, ShortConv4, L2-normed q/k, beta, the delta-rule recurrence,
             the gated RMSNorm output): Odyssey's KDA equals transformers' KimiDeltaAttention (4e-7 in fp32)
             once both use the same decay gate;
             MLA without its rope slot: low-rank KV (kv_lora_rank), optional q_lora_rank, NoPE heads, and no
             output gate (Odyssey's per-channel gate sigmoid(W_g x) becomes the constant 1/2 with W_g = 0 and
             W_o doubled);
             the sigmoid router with a selection bias (e_score_correction_bias) and routed_scaling_factor.
    does not the decay gate: Kimi's g = -exp(A) * softplus(W x + b) is unbounded below; Odyssey's is
             g = g_min * sigmoid(exp(A) * z), bounded by kda_g_min (a required negative number: no switch
             turns the bound off);
             the MLA key's shared rope slot (qk_rope_head_dim > 0 rotary dims; Odyssey is NoPE);
             qk and v head dims that differ (Odyssey has one mla_head_dim);
             DeepSeek-style MoE: full-width experts (hidden -> moe_intermediate -> hidden), where Odyssey's
             LatentMoE runs its experts in a latent (W_down, RMSNorm, W_up) around them; grouped top-k
             (n_group > 1); one shared expert of width moe_intermediate_size * n_shared_experts;
             the activation: SiLU-GLU (hidden_act) against Odyssey's SiTU-GLU in every FFN;
             the residual stream: Kimi's plain residual sum, Odyssey's Block Attention Residuals (always
             on: attn_res_block_size >= 1; zero-initialised queries give the mean of the sources, not their
             sum).

`kimi_import_differences(config)` lists the differences one checkpoint's config.json shows (the gate and the
residual stream are structural: every checkpoint with KDA layers shows them). `import_kimi_linear(path)`
refuses with a ValueError listing them; none of them has a switch in OdysseyConfig today, so every Kimi
Linear checkpoint is refused. Train one as it is with `model.hf_path` (model/hf_policy.py: its KDA layers run
Odyssey's kernels; routing replay: model/hf_routing.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def kimi_import_differences(config: dict[str, Any]) -> list[str]:
    """The differences between a Kimi Linear config.json (dict) and what Odyssey's model can represent, one
    sentence each (module docstring); empty only for a config Odyssey's model could load faithfully."""
    layer_types = config.get("layer_types") or []
    mlp_types = config.get("mlp_layer_types")
    if mlp_types is None:  # transformers' default: the first first_k_dense_replace FFNs dense, then sparse
        k = int(config.get("first_k_dense_replace", 1))
        mlp_types = ["dense" if i < k else "sparse" for i in range(int(config.get("num_hidden_layers", 0)))]
    out = []
    n_kda = sum(t == "linear_attention" for t in layer_types)
    n_mla = sum(t == "full_attention" for t in layer_types)
    if n_kda:
        out.append(f"KDA decay gate: the checkpoint's {n_kda} KDA layers use the unbounded gate "
                   "g = -exp(A)*softplus(Wx + b); Odyssey's KDA is lower-bounded, "
                   "g = kda_g_min*sigmoid(exp(A)*z) "
                   "with kda_g_min < 0 required, and has no switch for the unbounded form")
    rope = int(config.get("qk_rope_head_dim") or 0)
    if n_mla and rope:
        out.append(f"MLA rope slot: the keys of the checkpoint's {n_mla} MLA layers carry a shared rotary "
                   "slot "
                   f"of qk_rope_head_dim={rope} dims; Odyssey's MLA is NoPE (no positions)")
    nope, v = config.get("qk_nope_head_dim"), config.get("v_head_dim")
    if n_mla and nope != v:
        out.append(f"MLA head dims: qk_nope_head_dim={nope} and v_head_dim={v} differ; Odyssey's MLA has one "
                   "mla_head_dim for both")
    n_sparse = sum(t == "sparse" for t in mlp_types)
    if n_sparse:
        out.append(f"MoE experts: the checkpoint's {n_sparse} MoE layers run full-width experts "
                   f"(hidden {config.get('hidden_size')} -> moe_intermediate_size "
                   f"{config.get('moe_intermediate_size')}); Odyssey's LatentMoE runs its experts inside a "
                   "latent (W_down, RMSNorm, W_up), which no weights make the identity")
        if int(config.get("n_group") or 1) > 1:
            out.append(f"MoE routing: grouped top-k (n_group={config.get('n_group')}, "
                       f"topk_group={config.get('topk_group')}); Odyssey's router takes a plain top-k")
    if config.get("hidden_act", "silu") != "situ":
        out.append(f"FFN activation: {config.get('hidden_act', 'silu')}-GLU; Odyssey's FFNs are SiTU-GLU "
                   "(4 tanh(G/4) sigmoid(G) * 25 tanh(U/25))")
    out.append("residual stream: Kimi Linear adds each layer to a plain residual sum; Odyssey's layers read "
               "Block "
               "Attention Residuals (softmax-weighted sources, always on)")
    return out


def import_kimi_linear(path: str | Path) -> None:
    """Refuse to import the Kimi Linear checkpoint at `path` (a save_pretrained directory) into Odyssey's
    model, with a ValueError listing exactly the differences its config.json shows (kimi_import_differences).
    A directory without config.json, or of another model_type, is a ValueError too."""
    cfg_path = Path(path).expanduser() / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{path} holds no config.json: give a Kimi Linear checkpoint directory written by "
                         "save_pretrained")
    config = json.loads(cfg_path.read_text())
    if config.get("model_type") != "kimi_linear":
        raise ValueError(f"{path} is a {config.get('model_type')!r} checkpoint, not 'kimi_linear'")
    diffs = kimi_import_differences(config)
    raise ValueError(
        f"{path}: a Kimi Linear checkpoint does not map onto Odyssey's model ({len(diffs)} difference(s)):\n"
        + "\n".join(f"- {d}" for d in diffs)
        + f"\nTrain it as it is with model.hf_path={path} (docs/hf.md: its KDA layers run Odyssey's kernels, "
        "and its MoE replays the rollout's routing)")


__all__ = ["import_kimi_linear", "kimi_import_differences"]
