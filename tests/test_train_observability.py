"""What a user sees of a training run: TensorBoard and JSONL hold the same records, the expert-load metrics
are the counts of the experts the rollouts routed to (R3), `odyssey report` draws every plot (also on a
crashed run's cut-off JSONL), and a two-stage run advances at its gate and resumes in its stage.

One real run (the module's `staged_run`): the `tiny` policy with the learner on Ray (the session's
`ray_session` cluster), the budgets of tests/test_train_ray.py, routing replay on (the default), two
stages (max_new_tokens 8, then 4, the first gated at 1 step), 2 steps; then the same config resumed to 3
steps from its last checkpoint.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.test_train_ray import DETERMINISTIC, TINY, kill_learner_after_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STAGES = (
    "stages=[{name: long, set: {rollout.max_new_tokens: 8}, until_steps: 1},"
    " {name: short, set: {rollout.max_new_tokens: 4}}]"
)


# groups never tie, so every step trains all its episodes (the expert-load test counts them all)
DISTINCT_REWARDS = "rewards=[{name: 'tests.custom_rewards:even_tokens_distinct'}]"


def _trainer(run_dir: Path, steps: int):
    from rich.console import Console

    from rl.config import load_config
    from rl.train.loop import Trainer

    cfg = load_config(
        "configs/tiny.yaml",
        [f"logging.run_dir={run_dir}", *TINY, *DETERMINISTIC, f"learner.steps={steps}", STAGES,
         "logging.sample_rollouts=2", DISTINCT_REWARDS],
    )  # fmt: skip
    out = io.StringIO()
    return Trainer(cfg, config_path="configs/tiny.yaml", console=Console(file=out, width=200)), out


@pytest.fixture(scope="module")
def staged_run(ray_session, tmp_path_factory):
    """(run dir, log of the first run, log of the resumed run). The first run (3 steps) advances to stage
    `short` after step 1; its learner rank is SIGKILLed once checkpoint 2 is written, so it stops; the
    same config is then run again and resumes from checkpoint 2."""
    from rl.train.loop import TrainingStopped

    run_dir = tmp_path_factory.mktemp("obs") / "run"
    trainer, out = _trainer(run_dir, 3)
    t = kill_learner_after_checkpoint(run_dir, 2)
    with pytest.raises(TrainingStopped, match="the learner actor died"):
        trainer.run()
    t.join(timeout=10)
    first_log = out.getvalue()
    assert not (run_dir / "checkpoints" / "step-000003").exists(), first_log[-3000:]
    trainer, out = _trainer(run_dir, 3)
    assert trainer.run()["steps"] == 3, out.getvalue()[-3000:]
    return run_dir, first_log, out.getvalue()


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trained(run_dir: Path) -> dict[int, list]:
    """{step: the trajectories it trained} (ledger keys -> final, stored attempts)."""
    from rl.trajectory import TrajectoryStore

    ledger = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    by_key = {}
    for t in TrajectoryStore(run_dir / "trajectories").iter():
        if not t.infra_error:
            by_key[t.metadata["sample_key"]] = t
    return {e["step"]: [by_key[k] for k in e["trained"]] for e in ledger if e["step"] is not None}


@pytest.mark.timeout(900)
def test_tensorboard_and_jsonl_hold_the_same_records(staged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = staged_run
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for rec in recs:
        numeric = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
        assert {"reward/total", "success", "learner/loss", "time/learner_s", "time/reward_s", "length/mean",
                "turns/mean", "tool_calls", "stage", "moe/n_dead_experts", "moe/bias_range_max",
                "learner/routing_agreement", "learner/replay_changed",
                "throughput/rollout_tokens_per_s"} <= set(numeric)  # fmt: skip
        assert set(numeric) <= tags, set(numeric) - tags
        for key, value in numeric.items():
            events = {e.step: e.value for e in acc.Scalars(key)}
            # TensorBoard keeps float32; the resumed run's step 3 replaces nothing (purge_step), so one value
            assert events[rec["step"]] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    # every tag is a key of some record (no sink-only metrics)
    assert tags <= {k for r in recs for k in r}
    texts = acc.Tags()["tensors"]
    assert "samples/text_summary" in texts
    table = acc.Tensors("samples/text_summary")
    assert sorted(e.step for e in table) == [1, 2, 3]
    rows = [json.loads(ln) for ln in (run_dir / "samples_text.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert all(r["text"].startswith("[system]") or r["text"].startswith("[user]") for r in rows)
    first_table = table[0].tensor_proto.string_val[0].decode()
    assert rows[0]["sample"] in first_table


def _load_metrics(counts: np.ndarray, history: list[np.ndarray], k: int) -> dict[str, float]:
    """The expert-load metrics by their definitions (model/expert_load.py), from a plain count [n]."""
    load = counts.astype(np.float64)
    mean = load.mean()
    frac = load / load.sum()
    nz = frac[frac > 0]
    dead = int((np.sum(history, axis=0) == 0).sum())
    return {
        "max_mean_load": load.max() / mean,
        "load_cv": load.std() / mean,
        "load_entropy": float(-(nz * np.log(nz)).sum() / math.log(len(load))),
        "n_dead_experts": dead,
        "tokens": load.sum() / k,
    }


@pytest.mark.timeout(900)
def test_expert_load_is_the_count_of_the_stored_routed_experts(staged_run):
    """R3 on: the learner runs the experts the rollouts recorded, so each step's moe/layer<l>/... metrics
    are those of a plain count of Trajectory.routed_experts (all positions but the last, which no forward
    sees) over the step's trained trajectories; dead experts: zero tokens in every step of the window
    (model.moe_load_window = 100 steps, so here every step so far)."""
    run_dir, _, _ = staged_run
    policy = run_dir / "checkpoints" / "step-000003" / "learner" / "policy"
    cfg = json.loads((policy / "config.json").read_text())
    n, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    recs = {r["step"]: r for r in _records(run_dir)}
    trained = _trained(run_dir)
    layers = sorted({int(key.split("/")[1][5:]) for key in recs[1] if key.startswith("moe/layer")})
    assert layers, "no per-layer expert-load metrics"
    history: dict[int, list[np.ndarray]] = {l: [] for l in layers}
    for step in sorted(recs):
        rec = recs[step]
        assert rec["learner/trained_trajectories"] == len(trained[step]) == rec["episodes"]
        for j, layer in enumerate(layers):
            counts = np.zeros(n, dtype=np.int64)
            for t in trained[step]:
                counts += np.bincount(np.asarray(t.routed_experts)[:-1, j].reshape(-1), minlength=n)
            if step == 3:
                history[layer] = []  # the resumed learner process starts a new window
            history[layer].append(counts)
            want = _load_metrics(counts, history[layer], k)
            for name, value in want.items():
                assert rec[f"moe/layer{layer}/{name}"] == pytest.approx(value, rel=1e-9), (step, layer, name)
        assert rec["moe/n_dead_experts"] == sum(rec[f"moe/layer{l}/n_dead_experts"] for l in layers)


@pytest.mark.timeout(900)
def test_two_stages_advance_at_the_gate_and_resume_in_their_stage(staged_run):
    run_dir, first_log, resumed_log = staged_run
    recs = _records(run_dir)
    assert [r["stage"] for r in recs] == [0, 1, 1]
    assert "stage long done at step 1" in first_log and "entering stage short" in first_log
    assert "resuming from checkpoint" in resumed_log and "(step 2," in resumed_log
    assert "stage 2/2 (short) since step 1" in resumed_log
    driver = json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())
    assert driver["stage"] == 1 and driver["stage_start"] == 1
    trained = _trained(run_dir)

    def longest_turn(step: int) -> int:  # sampled tokens of an assistant turn (its closing token is not)
        return max(
            int(t.loss_mask[s.start : s.end].sum())
            for t in trained[step]
            for s in t.turns
            if s.role == "assistant"
        )

    assert longest_turn(1) > 4  # stage `long`: max_new_tokens 8
    assert longest_turn(2) <= 4 and longest_turn(3) <= 4  # stage `short`, also after the resume


@pytest.mark.timeout(600)
def test_report_draws_every_plot_also_on_a_cut_off_metrics_file(staged_run, tmp_path):
    from rl.train.report import PLOTS, cli_main, read_jsonl

    run_dir, _, _ = staged_run
    assert cli_main([str(run_dir), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    for png in PLOTS:
        data = (tmp_path / "r" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
        assert f"]({png})" in md
    assert "stage 1 from step 2" in md
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed, ignore=shutil.ignore_patterns("checkpoints", "report"))
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/tot')  # the driver was killed mid-write
    assert read_jsonl(crashed / "metrics.jsonl")[1] == 1
    assert cli_main([str(crashed)]) == 0
    md = (crashed / "report" / "report.md").read_text()
    assert "Skipped 1 unreadable metrics line" in md and "steps 1-3" in md
    assert all((crashed / "report" / p).stat().st_size > 5000 for p in PLOTS)
