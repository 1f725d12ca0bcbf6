"""Admission (rl/train/admission.py): the staleness bound on groups ahead of the learner, open groups
tracked as Task objects, and the group filter of dynamic sampling (built-in or a user's pkg.module:fn);
and the training loop drawing and discarding through it."""

from __future__ import annotations

import pytest

from rl.config import ConfigError, load_config
from rl.rollout.dispatch import Finished
from rl.rollout.tasks import TaskStream
from rl.train.admission import Admission
from rl.train.buffer import ExperienceBuffer
from tests.test_train_unit import _group, _trainer

STREAM = TaskStream(base_seed=0)
TINY = "configs/tiny.yaml"


def only_solved(group) -> bool:
    """A user's group filter: keep groups where every valid member scored 1."""
    return bool((group.rewards() == 1.0).all())


def keep_all(group) -> bool:
    """A user's group filter that keeps every group (tests/test_config_keys.py's probe)."""
    return True


def _complete(task_index: int, rewards: list[float]):
    buf = ExperienceBuffer(group_size=len(rewards))
    for s, t in _group(task_index, rewards):
        g = buf.add(s, t)
    return g


@pytest.mark.parametrize(
    "k,busy,room", [(0, False, 2), (0, True, 0), (1, True, 2), (1, False, 4), (2, True, 4)]
)
def test_staleness_bound_limits_groups_ahead(k, busy, room):
    """(k + 1 - busy) x G useful groups ahead of the learner (G = 2 groups per batch here)."""
    adm = Admission(max_staleness=k, groups_per_step=2)
    assert adm.room(buffered=0, busy=busy) == room
    adm.opened(STREAM.task(0))
    assert adm.room(buffered=1, busy=busy) == max(0, room - 2)


def test_open_groups_are_tasks_with_their_index():
    adm = Admission(max_staleness=1, groups_per_step=2)
    tasks = [STREAM.task(17), TaskStream(split="train", options={"difficulty": 2}).task(42)]
    for t in tasks:
        adm.opened(t)
    assert adm.open_indices() == {17, 42}
    adm.closed(tasks[1].key)
    assert adm.open_indices() == {17}
    adm.reset()
    assert adm.open_indices() == set()


def test_zero_variance_groups_are_discarded_up_to_the_cap():
    """dynamic_sampling_cap 2 with G = 2: at most (2 - 1) x 2 rejected groups per step, later ones kept;
    groups with variance are always kept; a step starts the budget again."""
    cfg = load_config(TINY, ["orchestrator.dynamic_sampling=true", "orchestrator.dynamic_sampling_cap=2.0"])
    adm = Admission.from_config(cfg, groups_per_step=2)
    groups = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]]
    kept = [adm.admit(_complete(i, r)) for i, r in enumerate(groups)]
    assert kept == [False, True, False, True] and adm.counter == "discarded/zero_variance"
    adm.step_taken()
    assert not adm.admit(_complete(4, [1.0, 1.0]))


def test_without_dynamic_sampling_every_group_is_kept():
    adm = Admission.from_config(load_config(TINY), groups_per_step=2)
    assert all(adm.admit(_complete(i, [1.0, 1.0])) for i in range(8))


def test_a_users_group_filter():
    cfg = load_config(TINY, ["orchestrator.dynamic_sampling=true",
                             "orchestrator.group_filter=tests.test_train_admission:only_solved"])
    adm = Admission.from_config(cfg, groups_per_step=4)
    assert [adm.admit(_complete(i, r)) for i, r in enumerate([[1.0, 1.0], [0.0, 1.0]])] == [True, False]
    assert adm.counter == "discarded/only_solved"
    with pytest.raises(ConfigError, match="orchestrator.group_filter: unknown group filter 'bogus'"):
        load_config(TINY, ["orchestrator.group_filter=bogus"])


def test_the_loop_draws_and_discards_through_admission(tmp_path):
    t = _trainer(tmp_path, "orchestrator.dynamic_sampling=true", "orchestrator.dynamic_sampling_cap=2.0")
    t._draw(busy=False)  # k = 1 (tiny.yaml), G = 2: four groups ahead
    assert [s.key for s in t.dispatcher.samples][:2] == ["train/0/0", "train/0/1"]
    assert t.admission.open_indices() == {0, 1, 2, 3}
    for i, rewards in enumerate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]]):
        for s, traj in _group(i, rewards):
            t._on_finished(Finished(s, traj, 0, final=True))
    assert sorted(t.buffer.ready) == ["train/1", "train/3"] and t.admission.open_indices() == set()
    assert t.state.counters["discarded/zero_variance"] == 2
    assert t.ledger_discarded == ["train/0/0", "train/0/1", "train/2/0", "train/2/1"]
    assert len(t.store) == 8  # every finished episode is stored, discarded ones too
