"""rl/rollout/tasks.py: task identity vs sample seeds, disjoint train/eval seeds, serialisation."""

from __future__ import annotations

import pytest

from rl.rollout.tasks import Sample, Task, TaskStream, task_seed


def test_group_shares_the_task_and_draws_distinct_seeds():
    stream = TaskStream(base_seed=3)
    task = stream.task(5)
    group = stream.samples(task, 4)
    assert [s.task for s in group] == [task] * 4 and [s.index for s in group] == [0, 1, 2, 3]
    assert len({s.seed for s in group}) == 4 and len({s.key for s in group}) == 4
    assert {s.metadata()["group_id"] for s in group} == {"train/5"}
    assert stream.samples(task, 4) == group  # deterministic
    assert TaskStream(base_seed=3).task(5) == task and TaskStream(base_seed=4).task(5).seed != task.seed
    (greedy,) = stream.samples(task, 4, greedy=True)
    assert greedy.greedy and greedy.key == "train/5/0/greedy"


def test_train_and_eval_task_seeds_are_disjoint_by_construction():
    train = {TaskStream(b, "train").task(i).seed for b in range(3) for i in range(2000)}
    held_out = {TaskStream(b, "eval").task(i).seed for b in range(3) for i in range(2000)}
    assert not train & held_out
    assert all(s % 2 == 0 for s in train) and all(s % 2 == 1 for s in held_out)
    with pytest.raises(ValueError, match="split"):
        task_seed(0, "test", 1)
    with pytest.raises(ValueError, match="index"):
        task_seed(0, "train", -1)


def test_first_samples_fill_whole_groups_in_order():
    samples = TaskStream(0).first_samples(10, group_size=4)
    assert [s.key for s in samples] == [f"train/{i // 4}/{i % 4}" for i in range(10)]
    assert sorted(samples, key=lambda s: s.order) == samples


def test_roundtrip_and_retry():
    task = TaskStream(1, "eval", {"difficulty": 2}).task(7)
    assert task.reset_options() == {"difficulty": 2} and task.key == "eval/7@difficulty=2"
    s = Sample(task, 2, 99, greedy=False, attempt=0)
    assert Sample.from_dict(s.to_dict()) == s and Task.from_dict(task.to_dict()) == task
    r = s.retry()
    assert r.attempt == 1 and r.key == s.key and r.seed == s.seed
