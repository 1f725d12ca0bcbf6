"""Metric sinks without Ray: records reach JSONL and TensorBoard identically, a resumed run hides the steps
it redoes (purge_step), W&B configured without the package is a clear error, sampled rollouts as text.
The real run is tests/test_train_observability.py."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from rl.train.metrics import batch_stats, sample_rows
from rl.train.sinks import SAMPLES_TEXT_FILE, MetricSinks, samples_markdown
from tests.test_train_unit import _group


def _logging(**kw):
    return SimpleNamespace(**{"tensorboard": True, "wandb_project": None, **kw})


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("counter_rolls_over", [False, True])
def test_jsonl_and_tensorboard_get_the_same_record_and_resume_purges_redone_steps(
    tmp_path, counter_rolls_over
):
    """counter_rolls_over: the two runs' event files get writer counters 9 and 10 (TensorBoard sorts the
    names as text, so within one second "...10" came first and purged nothing; it failed under load)."""
    if counter_rolls_over:
        from tensorboard.summary.writer.event_file_writer import _global_uid

        while _global_uid.get() % 10 != 9:  # get() returns the next counter and advances it
            pass
        _global_uid._value -= 1  # the first run's writer takes ...9, the resumed run's ...10
    sinks = MetricSinks(tmp_path, _logging())
    sinks.open(first_step=1)
    for step in (1, 2, 3):
        sinks.write({"step": step, "reward/total": 0.25 * step, "learner/kl": None, "episodes": 4})
    sinks.close()
    # the run resumes from its step-1 checkpoint: steps 2 and 3 are done again, with other values
    sinks = MetricSinks(tmp_path, _logging())
    sinks.jsonl.keep_first(1)
    sinks.open(first_step=2)
    for step in (2, 3):
        sinks.write({"step": step, "reward/total": -1.0 * step, "learner/kl": 0.5, "episodes": 4})
    sinks.close()
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tb = _scalars(tmp_path / "tensorboard")
    assert set(tb) == {"reward/total", "learner/kl", "episodes"}  # null values are not scalars
    for rec in recs:
        for key, value in rec.items():
            if key != "step" and value is not None:
                assert tb[key][rec["step"]] == pytest.approx(value), (key, rec["step"])
    assert tb["reward/total"] == {1: 0.25, 2: -2.0, 3: -3.0}


def test_wandb_configured_but_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError
    sinks = MetricSinks(tmp_path, _logging(tensorboard=False, wandb_project="my-proj"))
    with pytest.raises(RuntimeError, match="wandb_project is set .'my-proj'. but the `wandb` package"):
        sinks.open(first_step=1)


def test_tensorboard_off_writes_jsonl_only(tmp_path):
    sinks = MetricSinks(tmp_path, _logging(tensorboard=False))
    sinks.open(first_step=1)
    sinks.write({"step": 1, "x": 1.0})
    sinks.close()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_sampled_rollouts_best_and_worst_first_with_text_and_a_table(tmp_path):
    batch = _group(0, [0.0, 1.0, 0.5]) + _group(1, [0.25, 0.75])
    batch[2][1].metadata["messages"] = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4|"},
    ]
    rows = sample_rows(batch, 3)
    # the best, the worst, then the rest in sample order
    assert [r["sample"] for r in rows] == ["train/0/1", "train/0/0", "train/0/2"]
    assert rows[2]["text"] == "[user] 2+2?\n[assistant] 4|" and rows[0]["reward"] == 1.0
    assert sample_rows(batch, 0) == [] and len(sample_rows(batch, 10)) == 5
    md = samples_markdown(rows)
    assert "4\\|" in md and md.count("\n") == 4  # header, rule, 3 rows; the cell's | is escaped
    sinks = MetricSinks(tmp_path, _logging(tensorboard=False))
    sinks.write_samples(7, rows)
    lines = [json.loads(ln) for ln in (tmp_path / SAMPLES_TEXT_FILE).read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [7, 7, 7] and lines[0]["sample"] == "train/0/1"


def test_batch_stats_lengths_turns_and_worker_time():
    batch = _group(0, [0.0, 1.0], n_tokens=3) + _group(1, [0.5, 0.5], n_tokens=7)
    for i, (_, t) in enumerate(batch):
        t.metadata.update(wall_s=1.0 + i, reward_s=0.5, n_turns=i + 1)
    st = batch_stats(batch, learner_version=0)
    assert st["length/mean"] == pytest.approx(5.0) and st["length/max"] == 7
    assert st["turns/mean"] == pytest.approx(2.5) and st["turns/max"] == 4
    assert st["time/episodes_s"] == pytest.approx(10.0) and st["time/reward_s"] == pytest.approx(2.0)
    assert st["infra/env"] == st["infra/sandbox"] == 0


def test_train_help_says_how_to_open_tensorboard_and_the_report():
    from rl.train.cli import _parser

    text = " ".join(_parser().format_help().split())
    assert "tensorboard --logdir RUN_DIR/tensorboard" in text and "odyssey report RUN_DIR" in text


def test_a_long_conversation_keeps_its_head_and_tail():
    from rl.train.metrics import SAMPLE_TEXT_CHARS

    batch = _group(0, [0.0, 1.0])
    long = "x" * 10 + "y" * (3 * SAMPLE_TEXT_CHARS) + "z" * 10
    for _, t in batch:
        t.metadata["messages"] = [{"role": "user", "content": long}]
    text = sample_rows(batch, 1)[0]["text"]
    assert text.startswith("[user] xxxxxxxxxx") and text.endswith("z" * 10)
    assert f"[... {len('[user] ' + long) - SAMPLE_TEXT_CHARS} characters cut ...]" in text
    assert len(text) < SAMPLE_TEXT_CHARS + 100


class _FakeWandb:
    """Stands in for the `wandb` module (not installed here): records what the sink calls."""

    def __init__(self):
        self.calls = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def Table(self, columns, data):  # noqa: N802 (wandb's name)
        return {"columns": columns, "data": data}

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_the_records_keys_and_values_at_their_step(tmp_path, monkeypatch):
    """Only the mapping (a fake module; no W&B run was made here): the record without nulls, at its step."""
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sinks = MetricSinks(tmp_path, _logging(tensorboard=False, wandb_project="proj"), {"learner": {"lr": 1.0}})
    sinks.open(first_step=1)
    sinks.write({"step": 2, "reward/total": 0.5, "learner/kl": None})
    sinks.write_samples(2, [{"sample": "train/0/0", "rewards": {"total": 0.5}, "text": "hi"}])
    sinks.close()
    init = {"project": "proj", "dir": str(tmp_path), "config": {"learner": {"lr": 1.0}}, "resume": "allow",
            "name": tmp_path.name}
    assert fake.calls[0] == ("init", init)
    assert fake.calls[1] == ("log", {"reward/total": 0.5}, 2)
    table = fake.calls[2][1]["samples"]
    assert fake.calls[2][2] == 2 and table["columns"] == ["sample", "rewards", "text"]
    assert table["data"] == [["train/0/0", '{"total": 0.5}', "hi"]] and fake.calls[3] == ("finish",)
