"""Parameter counting on the meta device (model/count.py) and `odyssey model params`."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import OdysseyConfig
from model.count import COMPONENTS, cli_main, count_parameters
from model.modeling import OdysseyForCausalLM


@pytest.mark.parametrize("overrides", [{}, {"n_routed_experts": 0}, {"tie_word_embeddings": True}])
def test_meta_count_equals_a_real_model_and_active_formula(overrides):
    cfg = OdysseyConfig.from_preset("tiny", **overrides)
    pc = count_parameters(cfg)
    real = OdysseyForCausalLM(cfg)
    assert pc.total == sum(p.numel() for p in real.parameters())  # parameters() de-duplicates tied weights
    assert set(pc.breakdown) == set(COMPONENTS)
    assert pc.total == sum(c.total for c in pc.breakdown.values())
    # active = total minus the routed experts a token does not select: routed counts k/n of its size
    routed = pc.breakdown["routed_experts"].total
    # [gate|up] + down of 16 experts (latent 64, intermediate 64) in 7 MoE layers
    expected_routed = (3 * 64 * 64 * 16) * 7 if cfg.n_routed_experts else 0
    assert routed == expected_routed
    assert pc.active == pc.total - routed + routed * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
    if overrides.get("tie_word_embeddings"):
        assert pc.breakdown["head"].total == 0  # the LM head is the embedding matrix


def test_k3_lands_on_the_public_totals_without_allocating():
    cfg = OdysseyConfig.from_preset("k3")
    assert cfg.layer_types.count("kda") == 69 and cfg.layer_types.count("mla") == 24
    assert cfg.layer_types[-5:] == ["kda", "kda", "kda", "mla", "mla"]  # 23 x [K,K,K,M] + 1 M
    pc = count_parameters(cfg)  # a real build would need ~11 TB in fp32: meta device only
    assert abs(pc.total / 2.8e12 - 1) < 0.03, pc.total
    assert abs(pc.active / 104e9 - 1) < 0.03, pc.active
    # the routed experts alone: 92 MoE layers x 896 experts x 3 x 3584 x 3072
    assert pc.breakdown["routed_experts"].total == 92 * 896 * 3 * 3584 * 3072
    assert pc.breakdown["routed_experts"].active == 92 * 16 * 3 * 3584 * 3072


def test_cli_table_and_json(capsys):
    assert cli_main(["params", "--preset", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["preset"] == "tiny"
    assert data["total"] == count_parameters(OdysseyConfig.from_preset("tiny")).total
    assert cli_main(["params", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    for comp in ("embedding", "kda", "mla", "attn_res", "dense_ffn", "shared_experts", "routed_experts",
                 "router", "head", "TOTAL"):
        assert comp in out
    with pytest.raises(SystemExit):
        cli_main(["params", "--preset", "nope"])


def test_meta_build_allocates_no_storage():
    with torch.device("meta"):
        m = OdysseyForCausalLM(OdysseyConfig.from_preset("small"))
    assert all(p.device.type == "meta" for p in m.parameters())
