"""Dataset-backed tasks (envs/dataset.py, rl/rollout/tasks.py): files read with `datasets`, the deterministic
train/eval split, the seeded per-epoch order, rows as tasks of the training loop (groups of group_size
samples per row, through the ExperienceBuffer), and the config's load-time checks of env.dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs.dataset import DatasetError, DatasetRow, TaskDataset, read_rows, split_rows
from rl.config import ConfigError, load_config
from rl.rollout.tasks import Sample, Task, TaskStream, task_stream
from rl.train.buffer import ExperienceBuffer
from tests.traj_factory import make_traj

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
ARITH_QA = ROOT / "examples" / "quickstart" / "arith_qa.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(n)]


# ---- files --------------------------------------------------------------------------------------------


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    rows = qa_rows(5) + [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "level": 0}]
    j = write_jsonl(tmp_path / "d.jsonl", rows[:5])
    pq.write_table(pa.Table.from_pylist(rows[:5]), tmp_path / "d.parquet")
    assert read_rows(j) == read_rows(tmp_path / "d.parquet") == rows[:5]
    conv = write_jsonl(tmp_path / "c.jsonl", rows[5:])
    (row,) = read_rows(conv)
    r = DatasetRow(0, row)
    assert r.messages("SYS") == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    assert DatasetRow(1, rows[0]).messages("SYS")[1] == {"role": "user", "content": "What is 0 + 1?"}


def test_a_changed_file_is_read_again(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(3))
    assert len(read_rows(p)) == 3
    write_jsonl(p, qa_rows(4))
    assert len(read_rows(p)) == 4


def test_bad_files_name_the_problem(tmp_path):
    with pytest.raises(DatasetError, match="unsupported file type '.csv'; use .jsonl or .parquet"):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DatasetError, match="cannot read .*bad.jsonl as json"):
        read_rows(tmp_path / "bad.jsonl")
    p = write_jsonl(tmp_path / "noprompt.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(
        DatasetError, match="row 0: no prompt in column 'prompt' .*set env.dataset.prompt_field"
    ):
        TaskDataset.load(p)
    assert TaskDataset.load(p, eval_size=0, prompt_field="question").task_row("train", 0).prompt == "q"
    p = write_jsonl(tmp_path / "num.jsonl", [{"prompt": 3, "answer": "1"}])
    with pytest.raises(DatasetError, match="must hold a string or a list of"):
        TaskDataset.load(p)


# ---- split and order ----------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_complete():
    train, held = split_rows(100, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(100))
    again = split_rows(100, 0.1, seed=3)
    np.testing.assert_array_equal(again[1], held)
    assert not np.array_equal(split_rows(100, 0.1, seed=4)[1], held)  # the seed picks the rows
    assert len(split_rows(100, 7, seed=0)[1]) == 7  # a count
    assert len(split_rows(100, 0.001, seed=0)[1]) == 1  # a positive fraction holds out at least one row
    assert len(split_rows(100, 0, seed=0)[1]) == 0
    with pytest.raises(DatasetError, match="leaves none to train on"):
        split_rows(5, 5, 0)
    with pytest.raises(DatasetError, match="must be a whole number"):
        split_rows(50, 2.5, 0)


def test_train_order_visits_every_row_once_per_epoch_in_a_seeded_order(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(20))
    data = TaskDataset.load(p, eval_size=4, seed=1)
    n = data.n_rows("train")
    epochs = [[data.row_number("train", e * n + i) for i in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == sorted(data.train.tolist())
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != sorted(epochs[0])  # shuffled, not file order
    other = TaskDataset.load(p, eval_size=4, seed=2)
    assert [other.row_number("train", i) for i in range(n)] != epochs[0]
    assert [data.row_number("eval", i) for i in range(6)] == [*data.eval.tolist(), *data.eval[:2].tolist()]
    assert not set(data.eval.tolist()) & set(data.train.tolist())
    empty = TaskDataset.load(p, eval_size=0)
    with pytest.raises(DatasetError, match="the eval split is empty; set env.dataset.eval_size > 0"):
        empty.row_number("eval", 0)


# ---- rows as tasks of the training loop ---------------------------------------------------------------


def test_dataset_tasks_carry_their_row_and_round_trip(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(12))
    data = TaskDataset.load(p, eval_size=2, seed=0)
    stream = TaskStream(5, "train", dataset=data)
    task = stream.task(3)
    r = data.row_number("train", 3)
    assert task.key == f"train/3@row={r}" and task.row.index == r and task.row.columns == qa_rows(12)[r]
    assert task.reset_options() == {"row": task.row}  # what the env's reset gets
    assert task.seed == TaskStream(5, "train").task(3).seed  # seeds as for a generated task
    back = Task.from_dict(json.loads(json.dumps(task.to_dict())))
    assert back == task and back.row.columns == task.row.columns
    sample = stream.samples(task, 4)[2]
    meta = sample.metadata()
    assert meta["dataset_row"]["columns"] == qa_rows(12)[r] and meta["task_options"] == {"row": r}
    json.dumps(meta)  # stored as JSON with the trajectory
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))).task.row.index == r
    held = TaskStream(5, "eval", dataset=data)
    assert {held.task(i).row.index for i in range(4)} == set(data.eval.tolist())


def test_rows_form_groups_of_group_size_through_the_experience_buffer(tmp_path):
    """A row is a task like a seed: group_size samples of one row make one group of the loop's buffer."""
    p = write_jsonl(tmp_path / "d.jsonl", qa_rows(10))
    overrides = [
        f"env.dataset.path={p}",
        "env.dataset.eval_size=2",
        "learner.group_size=3",
        "rollout.episodes=9",
    ]
    cfg = load_config(QUICKSTART, overrides)
    stream = task_stream(cfg, "train")
    samples = stream.first_samples(9, group_size=3)
    buf = ExperienceBuffer(group_size=3, order="fifo")
    groups = []
    for s in reversed(samples):  # finishing order does not matter
        traj = make_traj([("prompt", 3), ("assistant", 2)], outcome=1.0, metadata=s.metadata())
        traj.rewards = {"total": float(s.index)}
        g = buf.add(s, traj)
        if g is not None:
            groups.append(g)
    assert len(groups) == 3
    for g in groups:
        rows = {t.metadata["dataset_row"]["index"] for t in g.trajectories}
        assert len(g.members) == 3 and len(rows) == 1 and g.key.endswith(f"@row={rows.pop()}")
    assert len({g.key for g in groups}) == 3


def test_eval_samples_use_the_held_out_rows():
    from rl.train.eval import eval_samples

    cfg = load_config(QUICKSTART)
    data = TaskDataset.load(ARITH_QA, cfg.env.dataset.eval_size, cfg.env.dataset.seed)
    samples = eval_samples(cfg, 8, 4)
    assert {s.task.row.index for s in samples} <= set(data.eval.tolist())
    assert {s.task.split for s in samples} == {"eval"}


# ---- config -------------------------------------------------------------------------------------------


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, overrides)
    return info.value.problems


def test_config_dataset_shorthand_and_checks(tmp_path):
    cfg = load_config(QUICKSTART, [f"env.dataset={ARITH_QA}"])
    assert cfg.env.dataset.path == str(ARITH_QA) and cfg.env.dataset.eval_size == 0.1
    assert problems([f"env.dataset={tmp_path / 'nope.jsonl'}"]) == [
        f"env.dataset: dataset {str(tmp_path / 'nope.jsonl')!r} does not exist; give the path of a .jsonl or "
        ".parquet file"
    ]
    no_answer = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}, {"prompt": "b", "answer": "1"}])
    (msg,) = problems([f"env.dataset.path={no_answer}", "env.dataset.eval_size=0"])
    assert msg.startswith(
        "env.dataset: dataset-qa needs a ground truth in column 'answer', missing in 1 rows"
    )
    (msg,) = problems(["env.id=arith", "env.kwargs={}", "rewards=[{name: outcome}]"])
    assert msg.startswith(
        "env.dataset: ArithEnv generates its tasks from seeds and does not take dataset rows"
    )
    msgs = problems(["env.dataset=null"])
    assert (
        "env.dataset: DatasetQAEnv takes its tasks from dataset rows; set env.dataset (a .jsonl or .parquet)"
        in msgs
    )
    assert any("numeric_match): this TRL-form reward needs ['answer'] as dataset columns" in m for m in msgs)
    renamed = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "solution": "1"}] * 10)
    msgs = problems([f"env.dataset.path={renamed}", "env.dataset.answer_field=solution"])
    assert msgs == [
        "rewards[1] (examples.quickstart.rewards:numeric_match): this TRL-form reward needs ['answer'] as "
        "dataset columns (TRL passes every column by name), but the tasks have the columns of env.dataset "
        "(prompt, solution); add the columns, give them in params, or give the arguments defaults"
    ]
    both = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "solution": "1", "answer": "1"}] * 10)
    assert load_config(QUICKSTART, [f"env.dataset.path={both}", "env.dataset.answer_field=solution"])
