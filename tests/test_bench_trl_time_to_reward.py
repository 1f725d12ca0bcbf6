"""bench/trl_time_to_reward.py's counting helpers against slow, obviously correct references (exact integers;
floats to 1e-12), and the config mapping's refusals."""

from __future__ import annotations

import random

import pytest

from bench import trl_time_to_reward as ttr


def _tokens_reference(rewards: list[float], tokens: list[int], g: int) -> tuple[int, int]:
    """All tokens, and tokens of groups with at least two distinct rewards (a set per group)."""
    all_, trained = 0, 0
    for start in range(0, len(rewards), g):
        group = range(start, start + g)
        n = 0
        for i in group:
            n += tokens[i]
        all_ += n
        if len({rewards[i] for i in group}) > 1:
            trained += n
    return all_, trained


def test_group_tokens_matches_reference_on_random_batches():
    rng = random.Random(0)
    for _ in range(200):
        g = rng.choice([1, 2, 4, 8])
        n = g * rng.randint(1, 6)
        rewards = [float(rng.random() < 0.2) for _ in range(n)]
        tokens = [rng.randint(40, 180) for _ in range(n)]
        out = ttr.group_tokens(rewards, tokens, g)
        assert (out["all"], out["trained"]) == _tokens_reference(rewards, tokens, g)
        assert out["groups"] == n // g
        assert out["tied_groups"] == sum(len(set(rewards[s : s + g])) == 1 for s in range(0, n, g))


def test_group_tokens_rejects_partial_groups():
    with pytest.raises(ValueError, match="not whole groups of 8"):
        ttr.group_tokens([0.0] * 12, [1] * 12, 8)


def test_rates_against_hand_computed_values():
    steps = [
        {"step": 1, "train_wall_s": 10.0, "tokens_all": 100, "tokens_trained": 50},
        {"step": 3, "train_wall_s": 40.0, "tokens_all": 300, "tokens_trained": 0},
        {"step": 2, "train_wall_s": 25.0, "tokens_all": 200, "tokens_trained": 100},
    ]
    r = ttr.rates(steps)
    assert r["tokens_all"] == 600 and r["tokens_trained"] == 150
    assert r["tokens_all_per_s"] == pytest.approx(600 / 40, abs=1e-12)
    assert r["tokens_all_per_s_steps_2_to_n"] == pytest.approx(500 / 30, abs=1e-12)
    assert r["tokens_trained_per_s_steps_2_to_n"] == pytest.approx(100 / 30, abs=1e-12)
    assert ttr.rates(steps[:1])["tokens_all_per_s_steps_2_to_n"] is None


def test_first_reaching_and_eval_excluded_walls():
    curve = [{"step": 0, "success": 0.1}, {"step": 2, "success": None}, {"step": 4, "success": 0.3},
             {"step": 6, "success": 0.5}]  # fmt: skip
    assert ttr.first_reaching(curve, 0.3)["step"] == 4
    assert ttr.first_reaching(curve, 0.6) is None
    metrics = [{"step": 1, "wall_s": 120.0}, {"step": 2, "wall_s": 250.0}, {"step": 3, "wall_s": 300.0}]
    evals = [{"step": 0, "wall_s": 100.0}, {"step": 2, "wall_s": 30.0}]
    assert ttr.eval_excluded_walls(metrics, evals) == {1: 20.0, 2: 120.0, 3: 170.0}


def test_unmappable_learner_settings_are_named():
    cfg = ttr.cell_config(4, 2, 4, 0, ["learner.ppo_epochs=2", "learner.loss_agg=seq_mean_token_sum"])
    with pytest.raises(ValueError) as e:
        ttr.check_mappable(cfg)
    assert "learner.ppo_epochs is 2" in str(e.value) and "seq_mean_token_sum" in str(e.value)
    ttr.check_mappable(ttr.cell_config(4, 2, 4, 0, []))  # the cell as shipped maps


def test_lora_cell_maps_to_the_same_peft_config():
    cfg = ttr.cell_config(4, 2, 4, 0, [], "grpo_pretrained_lora")
    ttr.check_mappable(cfg)
    lora, pc = cfg.learner.lora, ttr.peft_config(cfg.learner.lora)
    assert (pc.r, pc.lora_alpha, pc.lora_dropout, pc.bias) == (lora.rank, lora.alpha, lora.dropout, "none")
    assert set(pc.target_modules) == set(lora.target_modules) and len(lora.target_modules) == 7
    assert ttr.peft_config(None) is None  # full fine-tuning: no peft_config


class _Tok:
    """save_pretrained only (the tokenizer is copied beside the policy, not read by this test)."""

    def save_pretrained(self, d) -> None:
        (d / "tokenizer_saved").write_text("ok")


def test_trl_lora_policy_is_saved_merged_and_training_keeps_its_adapters(tmp_path):
    """TRL's peft model saved by save_policy loads as a plain Llama whose logits equal the adapted model's
    (merge oracle, 1e-5), and the model being trained still carries its unmerged adapters afterwards."""
    import torch
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_hf_policy import make_llama

    base = AutoModelForCausalLM.from_pretrained(make_llama(tmp_path / "base"), dtype=torch.float32)
    lora = ttr.cell_config(4, 2, 4, 0, [], "grpo_pretrained_lora").learner.lora
    model = get_peft_model(base, ttr.peft_config(lora))
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero: make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        base_only = model.get_base_model().model.embed_tokens.weight.clone()
    ttr.save_policy(model, _Tok(), tmp_path / "saved")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert not isinstance(saved, PeftModel) and (tmp_path / "saved" / "tokenizer_saved").exists()
    with torch.no_grad():
        got, after = saved(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (after - want).abs().max().item() == 0.0  # the trained model is untouched (not merged in place)
    assert isinstance(model, PeftModel) and any("lora_A" in n for n, _ in model.named_parameters())
    assert torch.equal(model.get_base_model().model.embed_tokens.weight, base_only)
    assert (got - saved.__class__.from_pretrained(tmp_path / "base", dtype=torch.float32)(input_ids=ids)
            .logits).abs().max().item() > 1e-3  # and the adapters are in the saved weights


def test_trl_record_from_an_earlier_race_is_reused_only_for_the_same_cell(tmp_path):
    import argparse
    import json

    args = argparse.Namespace(variant="grpo_pretrained_lora", seed=0, steps=20, eval_every=10)
    cell = {"variant": "grpo_pretrained_lora", "seed": 0, "steps": 20, "eval_every": 10}
    trl = {"steps": [{"step": 1}], "curve": [{"step": 0, "success": 0.1}]}
    race = tmp_path / "race.json"
    race.write_text(json.dumps({"cell": cell, "smoke": False, "finished_utc": "T", "trl": trl}))
    got = ttr.adopted_trl(race, args)
    assert got["curve"] == trl["curve"] and "race.json" in got["adopted_from"]
    for bad in ({**cell, "seed": 1}, {**cell, "variant": "grpo_pretrained"}, {**cell, "steps": 40}):
        race.write_text(json.dumps({"cell": bad, "trl": trl}))
        with pytest.raises(SystemExit, match="not this cell"):
            ttr.adopted_trl(race, args)
    record = tmp_path / "trl_record.json"  # a plain training record: evaluated afterwards, returned as is
    record.write_text(json.dumps({"steps": [], "checkpoints": []}))
    assert ttr.adopted_trl(record, args) == {"steps": [], "checkpoints": []}


def test_trl_is_seeded_by_the_race_seed_not_learner_seed(tmp_path):
    """--seed sets rollout.seed; TRL's GRPOConfig.seed must follow it (it once followed learner.seed, 0 in
    every cell, so every seed replayed TRL's seed-0 training)."""
    from bench.trl_time_to_reward import trl_config
    from rl.config.loader import load_config

    cfg = load_config("configs/smollm2_arith_qa.yaml", ["rollout.seed=3", "learner.seed=0"])
    args = trl_config(cfg, str(tmp_path), 2, cfg.rollout.episodes)
    assert args.seed == 3 and args.data_seed == 3


def test_trl_first_child_command_parses_as_a_trl_only_race_of_the_same_cell(tmp_path):
    """A TRL-first race hands its own arguments + --trl-only --results to a child (`train_trl_in_child`, run
    for real by tests/test_bench_trl_tools_race.py's smoke test): the child must parse them as the same cell,
    TRL only, writing to the child's results file, never to the race's."""
    race = ["--seed", "2", "--order", "trl-first", "--variant", "grpo_pretrained_lora", "--steps", "20",
            "--odyssey-steps", "40", "--out", str(tmp_path)]  # fmt: skip
    parent = ttr.parse_args(race)
    child = ttr.parse_args([*race, "--trl-only", "--results", str(tmp_path / "trl_side.json")])
    assert (parent.trl_only, parent.results) == (False, ttr.RESULTS)
    assert (child.trl_only, child.results) == (True, tmp_path / "trl_side.json")
    for k in ("seed", "variant", "steps", "eval_every", "eval_episodes", "trl_threads", "trl_micro_batch"):
        assert getattr(child, k) == getattr(parent, k), k
    assert ttr.parse_args(["--smoke"]).results == ttr.SMOKE_RESULTS


def test_ours_counts_tied_groups_in_its_normaliser_as_trl_does_unless_told_dapo(tmp_path):
    """--normaliser trl (the default): ours runs the cell with learner.equal_groups_in_normaliser, TRL's
    dapo normaliser (tests/test_learner_advantages.py: the same loss as TRL's over every group); the cell
    config carries it, so `fairness` reports it."""
    args = ttr.parse_args(["--variant", "grpo_pretrained_lora", "--out", str(tmp_path)])
    assert args.normaliser == "trl"
    assert ttr.ours_overrides(args) == ["learner.equal_groups_in_normaliser=true"]
    cfg = ttr.cell_config(4, 2, 8, 0, ttr.ours_overrides(args), args.variant)
    assert cfg.learner.equal_groups_in_normaliser and cfg.learner.loss_agg == "token_mean"
    assert any(k.startswith("equal_groups_in_normaliser") and v is True
               for k, v in ttr.fairness(cfg, 2).items())  # fmt: skip
    assert ttr.ours_overrides(ttr.parse_args(["--normaliser", "dapo"])) == []
