"""Where the config's checks run: the schema (rl/config/schema.py) reads no file, `load_config` runs every
meaning check (rl/config/checks.py), and `stage_config` re-runs only the checks that read nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import envs.dataset
from rl.config import ConfigError, RunConfig, load_config, stage_config

ROOT = Path(__file__).resolve().parents[1]
ARITH_QA = ROOT / "examples" / "quickstart" / "arith_qa.jsonl"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"  # dataset-qa on env.dataset


def test_constructing_a_run_config_reads_no_dataset(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    cfg = RunConfig.model_validate({"env": {"id": "dataset-qa", "dataset": missing}})
    assert cfg.env.dataset.path == missing
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"env.dataset={missing}"])
    assert any(p.startswith("env.dataset: ") for p in info.value.problems)


def test_stage_config_reads_no_file(tmp_path, monkeypatch):
    data = tmp_path / "qa.jsonl"
    shutil.copy(ARITH_QA, data)
    stages = ("stages=[{name: a, set: {rollout.max_tokens: 1024}, until_steps: 1}, "
              "{name: b, set: {rollout.max_tokens: 2048}}]")
    cfg = load_config(QUICKSTART, [f"env.dataset={data}", stages])
    reads = []
    monkeypatch.setattr(envs.dataset.TaskDataset, "load", lambda *a, **k: reads.append(a))
    data.unlink()  # a stage built during training must not need the file again
    assert [stage_config(cfg, i).rollout.max_tokens for i in range(2)] == [1024, 2048]
    assert reads == []
    with pytest.raises(ConfigError, match="stages.1 \\(b\\): rollout.max_new_tokens"):
        bad = cfg.model_copy(deep=True)
        bad.stages[1].set = {"rollout.max_tokens": 8, "rollout.max_new_tokens": 16}
        stage_config(bad, 1)  # the checks that read nothing still run
