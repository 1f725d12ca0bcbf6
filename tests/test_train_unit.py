"""rl/train pure logic (no Ray): experience buffer, checkpoints, metrics records, placement, pass@k.

The Ray side (the loop itself, resume, worker / learner failures, placement on two nodes, job submission)
is in tests/test_train_ray.py.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from rl.config import ConfigError, load_config
from rl.placement import actor_options, fit_problems, torch_threads
from rl.rollout.tasks import TaskStream
from rl.train.buffer import ExperienceBuffer, staleness
from rl.train.checkpoint import MARKER, latest_checkpoint, list_checkpoints, write_checkpoint
from rl.train.eval import pass_at_k, policy_dir, summarize
from rl.train.metrics import MetricsLog, batch_stats, step_record
from tests.traj_factory import make_traj, step

STREAM = TaskStream(base_seed=0)


def _traj(
    sample, reward: float, *, version: int = 0, n_tokens: int = 5, infra: str | None = None, outcome=None
):
    t = make_traj(
        [("prompt", 4), ("assistant", n_tokens)],
        [step()],
        seed=sample.seed % 1000,
        rewards={} if infra else {"total": reward, "outcome": reward},
        outcome=outcome,
        infra_error=infra,
        metadata={**sample.metadata(), "policy_version": version},
    )
    t.token_versions = np.where(t.loss_mask == 1, version, -1).astype(np.int32)
    return t


def _group(task_index: int, rewards, **kw):
    task = STREAM.task(task_index)
    return [(s, _traj(s, r, **kw)) for s, r in zip(STREAM.samples(task, len(rewards)), rewards)]


# ----------------------------------------------------------------------------- buffer
def test_groups_complete_only_with_every_member_and_duplicates_are_refused():
    buf = ExperienceBuffer(group_size=3)
    members = _group(0, [1.0, 0.0, 1.0])
    for s, t in reversed(members[1:]):
        assert buf.add(s, t) is None
    g = buf.add(*members[0])
    assert g is not None and [s.index for s, _ in g.members] == [0, 1, 2] and len(buf) == 1
    assert g.has_variance and g.priority == pytest.approx(np.mean(np.abs(np.array([1, 0, 1]) - 2 / 3)))
    with pytest.raises(ValueError, match="already complete"):
        buf.add(*members[0])
    buf2 = ExperienceBuffer(group_size=3)
    buf2.add(*members[0])
    with pytest.raises(ValueError, match="duplicate"):
        buf2.add(*members[0])


def test_infra_failed_members_do_not_count_for_variance():
    buf = ExperienceBuffer(group_size=3)
    task = STREAM.task(0)
    s0, s1, s2 = STREAM.samples(task, 3)
    buf.add(s0, _traj(s0, 1.0))
    buf.add(s1, _traj(s1, 1.0))
    g = buf.add(s2, _traj(s2, 0.0, infra="sandbox died"))
    assert not g.has_variance and g.rewards().tolist() == [1.0, 1.0]  # the failed member is masked, not 0


def test_fifo_waits_for_the_next_tasks_in_order_and_returns_sample_order():
    buf = ExperienceBuffer(group_size=2, order="fifo")
    for s, t in _group(1, [0.0, 1.0]) + _group(2, [1.0, 0.0]):
        buf.add(s, t)
    assert not buf.batch_ready(2, open_tasks={0})  # task 0 still playing: 1 and 2 are not the next batch
    assert buf.batch_ready(2, open_tasks={3})
    for s, t in reversed(_group(0, [1.0, 1.0])):
        buf.add(s, t)
    batch, dropped = buf.take(2, learner_version=0, max_staleness=0)
    assert [s.key for s, _ in batch] == ["train/0/0", "train/0/1", "train/1/0", "train/1/1"] and not dropped
    assert list(buf.ready) == ["train/2"]


def test_orders_length_freshness_priority():
    def filled(order):
        buf = ExperienceBuffer(group_size=2, order=order)
        specs = {0: (10, 0, [0, 1]), 1: (50, 2, [0, 0]), 2: (52, 1, [0, 0.5]), 3: (11, 3, [1, 1])}
        for i, (n, v, r) in specs.items():
            for s, t in _group(i, r, n_tokens=n, version=v):
                buf.add(s, t)
        return buf

    def tasks(batch):
        return sorted({s.task.index for s, _ in batch})

    assert tasks(filled("length").take(2, 3, 9)[0]) == [0, 3]  # the tightest length window (10, 11)
    assert tasks(filled("freshness").take(2, 3, 9)[0]) == [1, 3]  # newest oldest-versions: 3 then 2
    assert tasks(filled("priority").take(2, 3, 9)[0]) == [0, 2]  # largest |r - mean r|: 0.5 then 0.25


def test_stale_members_are_dropped_and_returned():
    buf = ExperienceBuffer(group_size=2)
    (s0, t0), (s1, t1) = _group(0, [0.0, 1.0], version=3)
    t1.token_versions[t1.loss_mask == 1] = 1  # one member's oldest token is version 1
    buf.add(s0, t0)
    buf.add(s1, t1)
    assert staleness(t0, 5) == 2 and staleness(t1, 5) == 4
    batch, dropped = buf.take(1, learner_version=5, max_staleness=2)
    assert [s.key for s, _ in batch] == [s0.key] and [s.key for s, _ in dropped] == [s1.key]


def test_buffer_persists_ready_and_partial_groups(tmp_path):
    buf = ExperienceBuffer(group_size=2, order="priority")
    full, half = _group(0, [0.0, 1.0], version=2), _group(1, [0.5, 0.5])
    for s, t in full + half[:1]:
        buf.add(s, t)
    assert buf.save(tmp_path / "b.arrow") == 3
    back = ExperienceBuffer(group_size=2, order="priority")
    back.load(tmp_path / "b.arrow")
    assert list(back.ready) == ["train/0"] and list(back.partial) == ["train/1"] and back.keys() == buf.keys()
    (s, t), _ = back.ready["train/0"].members
    assert (
        s == full[0][0]
        and t.metadata == full[0][1].metadata
        and t.token_versions.tolist() == (full[0][1].token_versions.tolist())
    )
    assert back.add(*half[1]) is not None  # the partial group completes after the restore
    empty = ExperienceBuffer(group_size=2)
    assert empty.save(tmp_path / "e.arrow") == 0
    empty.load(tmp_path / "e.arrow")
    assert len(empty) == 0


# ----------------------------------------------------------------------------- checkpoints
def _fill(tmp):
    (tmp / "payload.txt").write_text("state")


def test_checkpoints_are_atomic_complete_only_and_pruned(tmp_path):
    for s in (1, 2, 3):
        write_checkpoint(tmp_path, s, _fill, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]

    def dies(tmp):
        _fill(tmp)
        raise KeyboardInterrupt  # killed while writing

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 4, dies, keep=2)
    assert latest_checkpoint(tmp_path).name == "step-000003"
    root = tmp_path / "checkpoints"
    # what a SIGKILL mid-write leaves: a temp dir, and (worse) a step dir without or with a wrong marker
    (root / ".step-000005.tmp-123").mkdir()
    (root / "step-000006").mkdir()
    (root / "step-000007").mkdir()
    (root / "step-000007" / MARKER).write_text(json.dumps({"step": 8}))
    (root / "step-000008").mkdir()
    (root / "step-000008" / MARKER).write_text("{trunc")
    assert latest_checkpoint(tmp_path).name == "step-000003"
    write_checkpoint(tmp_path, 3, lambda t: (t / "payload.txt").write_text("again"), keep=2)  # same step
    assert (latest_checkpoint(tmp_path) / "payload.txt").read_text() == "again"
    assert not (root / ".step-000005.tmp-123").exists()  # stale temp dirs are cleaned up


# ----------------------------------------------------------------------------- metrics
def test_step_record_is_flat_and_numeric(tmp_path):
    batch = _group(0, [0.0, 1.0], version=1) + _group(1, [0.5, 0.5], version=2)
    s, t = batch[1]
    batch[1] = (s, _traj(s, 0.0, infra="boom", version=2))  # group 0's second member: an infra failure
    stats = batch_stats(batch, learner_version=2)
    assert stats["episodes"] == 4 and stats["groups"] == 2 and stats["masked/infra"] == 1
    assert stats["reward/total"] == pytest.approx((0.0 + 0.5 + 0.5) / 3)  # the masked member is not a 0
    assert stats["staleness/max"] == 1 and stats["staleness/mean"] == pytest.approx(1 / 4)
    rec = step_record(
        step=3,
        policy_version=3,
        wall_s=1.23456,
        batch=stats,
        learner={"loss": np.float32(0.5), "grad_norm": float("nan"), "tokens": 12},
        timings={"rollout": 1.0, "learner": 2.0},
        counters={"dropped/stale": 2},
        evaluation={"success": 0.25},
    )
    assert all(isinstance(v, (int, float)) or v is None for v in rec.values())
    assert rec["learner/loss"] == 0.5 and rec["learner/grad_norm"] is None and rec["eval/success"] == 0.25
    assert rec["time/learner_s"] == 2.0 and rec["dropped/stale"] == 2
    log = MetricsLog(tmp_path)
    for i in range(5):
        log.append({**rec, "step": i})
    assert log.keep_first(3) == 2 and [r["step"] for r in log.read()] == [0, 1, 2]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- placement
def test_placement_options_and_fit_problems():
    assert actor_options({"CPU": 2, "GPU": 1, "rollout_node": 0.01}) == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"rollout_node": 0.01},
    }
    assert torch_threads({"CPU": 0.5}) == 1 and torch_threads({"CPU": 3}) == 3
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "orchestrator.rollout_resources={CPU: 1, rollout_node: 1}",
            "orchestrator.learner_resources={GPU: 1}",
        ],
    )
    problems = fit_problems(cfg, {"CPU": 8.0, "learner_node": 1.0})
    assert len(problems) == 2
    assert "orchestrator.rollout_resources" in problems[0] and "'rollout_node'" in problems[0]
    assert "orchestrator.learner_resources" in problems[1] and "'GPU'" in problems[1]
    assert fit_problems(cfg, {"CPU": 8.0, "GPU": 4.0, "rollout_node": 2.0}) == []
    # evaluation starts no learner: only the rollout workers' requests count
    (only,) = fit_problems(cfg, {"CPU": 8.0, "learner_node": 1.0}, with_learner=False)
    assert "orchestrator.rollout_resources" in only
    assert fit_problems(cfg, {"CPU": 8.0, "rollout_node": 2.0}, with_learner=False) == []


def test_orchestrator_config_errors():
    with pytest.raises(ConfigError, match="eval_episodes .* multiple of orchestrator.eval_pass_k"):
        load_config("configs/tiny.yaml", ["orchestrator.eval_episodes=10", "orchestrator.eval_pass_k=4"])
    with pytest.raises(ConfigError, match="CPU and GPU"):
        load_config("configs/tiny.yaml", ["orchestrator.learner_resources={gpu: 1}"])
    with pytest.raises(ConfigError, match="buffer_order"):
        load_config("configs/tiny.yaml", ["orchestrator.buffer_order=random"])


# ----------------------------------------------------------------------------- evaluation
def test_pass_at_k_matches_brute_force_over_subsets():
    """Oracle: the probability that a uniformly drawn k-subset of the n samples holds a success."""
    for n, c, k in itertools.product(range(1, 7), range(0, 7), range(1, 7)):
        if c > n:
            continue
        outcomes = [1] * c + [0] * (n - c)
        kk = min(k, n)
        subsets = list(itertools.combinations(outcomes, kk))
        ref = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12), (n, c, k)
    assert math.isnan(pass_at_k(0, 0, 1))


def test_summarize_by_difficulty_excludes_infra_failures(tmp_path):
    samples, results = [], {}
    for d, outs in ((0, [[1, 0, 0], [1, 1, 1]]), (1, [[0, 0, "infra"], [1, 0, 0]])):
        stream = TaskStream(0, "eval", {"difficulty": d})
        for i, task_outs in enumerate(outs):
            task = stream.task(i)
            group = stream.samples(task, 2) + stream.samples(task, 1, greedy=True)
            for s, o in zip(group, task_outs):
                samples.append(s)
                infra = "died" if o == "infra" else None
                results[s.key] = _traj(s, 0.0, infra=infra, outcome=None if infra else float(o))
    m = summarize(samples, results, k=2, env_id="arith")
    assert m["arith/d0/success"] == pytest.approx(3 / 4) and m["arith/d0/greedy"] == pytest.approx(1 / 2)
    assert m["arith/d0/pass@2"] == pytest.approx((1 + 1) / 2)
    assert m["arith/d1/greedy"] == pytest.approx(0.0) and m["arith/d1/infra_errors"] == 1  # masked, not 0
    assert m["arith/d1/success"] == pytest.approx(1 / 4) and m["pass@2"] == pytest.approx(3 / 4)
    assert m["infra_errors"] == 1 and m["episodes"] == 12
    with pytest.raises(ValueError, match="no policy there"):
        policy_dir(tmp_path)
    (tmp_path / "learner" / "policy").mkdir(parents=True)
    (tmp_path / "learner" / "policy" / "config.json").write_text("{}")
    assert policy_dir(tmp_path) == (tmp_path / "learner" / "policy").resolve()


# ----------------------------------------------------------------------------- loop logic without Ray
class _Queue:
    """Stands in for the Dispatcher where only `put` is called (the loop's drawing logic)."""

    def __init__(self):
        self.samples = []

    def put(self, samples, front=False):
        self.samples += list(samples)


def _trainer(tmp_path, *overrides):
    from rl.train.loop import Trainer

    cfg = load_config(
        "configs/tiny.yaml",
        [f"logging.run_dir={tmp_path}", "rollout.episodes=4", "learner.group_size=2", *overrides],
    )
    t = Trainer(cfg)
    t.dispatcher = _Queue()
    return t


def test_infra_failures_are_rerun_then_kept_masked():
    """Dispatcher bookkeeping: an infra-failed attempt below max_infra_retries goes back to the front of the
    queue (final=False); the last attempt is final and stays marked."""
    from rl.rollout.dispatch import Dispatcher

    d = Dispatcher(lambda i: (object(), None), num_workers=1, slots=1, max_infra_retries=1)
    (s0, s1) = STREAM.samples(STREAM.task(0), 2)
    d.put([s1])
    first = d._finished(s0, _traj(s0, 0.0, infra="sandbox died"), 0)
    assert not first.final and d.infra_retries == 1 and [s.key for s in d.queue] == [s0.key, s1.key]
    assert d.queue[0].attempt == 1
    last = d._finished(d.queue.popleft(), _traj(s0, 0.0, infra="sandbox died again"), 0)
    assert last.final and last.traj.infra_error and d.infra_retries == 1
    ok = d._finished(s1, _traj(s1, 1.0), 0)
    assert ok.final


def test_infra_guard_stops_a_batch_an_env_failed_on(tmp_path):
    """rollout.max_infra_fraction 0.5: a batch where the env failed on 3 of 4 episodes is not trained."""
    from rl.rollout.health import BatchUnhealthy

    t = _trainer(tmp_path, "rollout.max_infra_fraction=0.5")
    batch = _group(0, [1.0, 0.0]) + _group(1, [1.0, 0.0])
    for i in (0, 1, 2):
        s, _ = batch[i]
        batch[i] = (s, _traj(s, 0.0, infra="env.step: ValueError: parser choked"))
        batch[i][1].metadata.update(env_id="arith", infra_source="env")
    with pytest.raises(BatchUnhealthy, match="'arith' ended 3 of the batch's 4 episodes.*Sources: env 3"):
        t._check_infra(batch)
    t._check_infra(batch[2:])  # 1 of 2: not more than half


def test_out_of_memory_stops_with_one_line_and_the_resume_command(monkeypatch, capsys):
    """Ray's memory monitor killing an actor (seen when the node is short of memory) ends `odyssey train`
    with exit 1 and a line that names the cause, the knobs and the resume command, not a traceback."""
    import ray.exceptions

    from rl.train import cli
    from rl.train.loop import Trainer

    def run(self):
        raise ray.exceptions.OutOfMemoryError("3 worker(s) were killed: the node ran low on memory.")

    monkeypatch.setattr(Trainer, "run", run)
    assert cli.cli_main(["configs/tiny.yaml", "logging.run_dir=/tmp/odyssey-oom-probe"]) == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the line at the terminal width
    assert "ran out of memory" in err and "rollout.num_workers" in err
    assert "odyssey train configs/tiny.yaml logging.run_dir=/tmp/odyssey-oom-probe" in err
