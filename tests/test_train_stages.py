"""Stage logic without Ray: each stage's effective config, the gates, config errors, and the stage kept in
the driver's checkpoint state. The real two-stage run (advance at the gate, resume in the stage) is
tests/test_train_observability.py."""

from __future__ import annotations

import json

import pytest

from rl.config import ConfigError, load_config
from rl.train.loop import DriverState, Trainer
from rl.train.stages import StageController, stage_config

TWO = (
    "stages=[{name: 8k, set: {rollout.max_tokens: 1024, learner.micro_batch_tokens: 1024,"
    " rewards.3.params.max_completion_len: 256}, until_steps: 2, until_eval_success: 0.5},"
    " {name: 64k, set: {rollout.max_tokens: 2048, rollout.episodes: 8}}]"
)


def _cfg(tmp_path, *overrides):
    return load_config(
        "configs/tiny.yaml", [f"logging.run_dir={tmp_path}", "orchestrator.eval_every=1", *overrides]
    )


def test_each_stage_runs_the_run_config_with_its_overrides(tmp_path):
    cfg = _cfg(tmp_path, TWO)
    a, b = stage_config(cfg, 0), stage_config(cfg, 1)
    assert (a.rollout.max_tokens, a.learner.micro_batch_tokens, a.rollout.episodes) == (1024, 1024, 16)
    assert a.rewards[3].params["max_completion_len"] == 256
    assert (b.rollout.max_tokens, b.learner.micro_batch_tokens, b.rollout.episodes) == (2048, 4096, 8)
    assert b.rewards[3].params["max_completion_len"] == 512  # the run's value: stages do not accumulate
    assert a.stages == [] and b.learner.lr == cfg.learner.lr
    t = Trainer(cfg)
    assert t.cfg.rollout.max_tokens == 1024 and t.groups_per_step == 4
    t._enter_stage(1)
    assert t.cfg.rollout.max_tokens == 2048 and t.groups_per_step == 2


def test_gates_steps_or_eval_success_whichever_first_and_the_last_stage_never_advances(tmp_path):
    ctl = StageController(_cfg(tmp_path, TWO).stages)
    assert not ctl.should_advance(0, 1, None) and not ctl.should_advance(0, 1, 0.49)
    assert ctl.should_advance(0, 1, 0.5)  # an eval in the stage reached the threshold
    assert ctl.should_advance(0, 2, None)  # until_steps reached
    assert not ctl.should_advance(1, 1000, 1.0)
    assert not StageController([]).should_advance(0, 1000, 1.0) and StageController([]).name(0) == "main"


@pytest.mark.parametrize(
    "stages,message",
    [
        ("[{name: a, set: {model.preset: small}, until_steps: 1}, {name: b}]", "set.model.preset: a stage"),
        ("[{name: a, set: {learner.group_size: 8}, until_steps: 1}, {name: b}]", "fixed for the whole run"),
        ("[{name: a, set: {learner.lora.rank: 4}, until_steps: 1}, {name: b}]",
         "set.learner.lora.rank: fixed for the whole run"),
        ("[{name: a}, {name: b}]", "every stage but the last needs a gate"),
        ("[{name: a, until_steps: 1}, {name: b, until_steps: 1}]", "the last stage runs until learner.steps"),
        ("[{name: a, until_steps: 1}, {name: a}]", "used twice"),
        ("[{name: a, until_steps: 1}, {name: b, set: {rollout.max_tokens: 64}}]",
         "stages.1 (b): rollout.max_new_tokens (128) exceeds rollout.max_tokens (64)"),
        ("[{name: a, set: {rollout.nope: 1}, until_steps: 1}, {name: b}]", "stages.0 (a): rollout.nope"),
    ],
)  # fmt: skip
def test_bad_stages_are_config_errors_naming_the_stage(tmp_path, stages, message):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, f"stages={stages}")
    assert message in str(e.value)


def test_eval_gate_needs_evaluations(tmp_path):
    with pytest.raises(ConfigError, match="until_eval_success needs held-out evaluations"):
        _cfg(tmp_path, "orchestrator.eval_every=0", "stages=[{name: a, until_eval_success: 0.5}, {name: b}]")


def test_stage_is_part_of_the_driver_checkpoint_state():
    s = DriverState(step=7, stage=1, stage_start=5)
    back = DriverState.from_json(s.to_json())
    assert (back.stage, back.stage_start) == (1, 5)
    old = json.loads(s.to_json())
    del old["stage"], old["stage_start"], old["samples_text_lines"]  # a checkpoint written before stages
    back = DriverState.from_json(json.dumps(old))
    assert (back.step, back.stage, back.stage_start) == (7, 0, 0)


def test_a_checkpoint_in_a_stage_the_config_no_longer_has_is_refused_before_anything_starts(tmp_path):
    from rl.train.checkpoint import write_checkpoint
    from rl.train.loop import BUFFER_FILE, DRIVER_STATE

    def fill(d):
        (d / BUFFER_FILE).write_bytes(b"")
        (d / DRIVER_STATE).write_text(DriverState(step=3, version=3, stage=2, stage_start=2).to_json())

    write_checkpoint(tmp_path, 3, fill, keep=2)
    t = Trainer(_cfg(tmp_path, TWO))
    with pytest.raises(ValueError, match=r"is in stage 2 \(0-based\), the config has 2 stages"):
        t.start()
    assert t.dispatcher is None and t.learner is None
