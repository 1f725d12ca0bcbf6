"""`odyssey report` on run dirs written by hand: what it reads (cut-off lines, stage boundaries, per-layer
matrices), a run without MoE metrics or trajectories, and the errors. The report of a real run is in
tests/test_train_observability.py."""

from __future__ import annotations

import json
import math

from rl.train.report import (
    PLOTS,
    cli_main,
    eval_wall_s,
    layer_matrix,
    read_jsonl,
    stage_boundaries,
    write_report,
)


def _write(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_reads_what_a_crash_leaves_and_finds_stage_boundaries(tmp_path):
    recs = [{"step": i, "stage": s} for i, s in zip(range(1, 7), [0, 0, 1, 1, 1, 2])]
    _write(tmp_path / "m.jsonl", recs, '{"step": 7, "sta')
    got, bad = read_jsonl(tmp_path / "m.jsonl")
    assert got == recs and bad == 1
    assert stage_boundaries(got) == [(3, 1), (6, 2)]
    assert read_jsonl(tmp_path / "missing.jsonl") == ([], 0)


def test_layer_matrix_by_step_with_gaps():
    recs = [
        {"step": 1, "moe/layer1/max_mean_load": 1.5, "moe/layer3/max_mean_load": 2.0,
         "learner/routing_agreement/layer1": 0.9},
        {"step": 2, "moe/layer3/max_mean_load": 1.25, "moe/layer1/load_cv": 0.1},
    ]  # fmt: skip
    layers, m = layer_matrix(recs, "moe", "max_mean_load")
    assert layers == [1, 3] and m[1] == [2.0, 1.25] and m[0][0] == 1.5 and math.isnan(m[0][1])
    layers, m = layer_matrix(recs, "learner/routing_agreement", "")
    assert layers == [1] and m[0][0] == 0.9 and math.isnan(m[0][1])


def test_a_dense_run_without_trajectories_still_gets_every_plot(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, "reward/total": 0.1 * i, "success": 0.5, "time/learner_s": 1.0, "wall_s": 2.0 * i}
            for i in (1, 2, 3)]  # fmt: skip
    _write(run / "metrics.jsonl", recs)
    _write(run / "eval.jsonl", [{"step": 0, "success": 0.25, "pass@4": 0.5}, {"step": 3, "success": 0.5}])
    md = write_report(run).read_text()
    for png in PLOTS:
        assert (run / "report" / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in md
    assert "| 3 | 6.000 | 0.500 | - |" in md and "Stages" not in md and "Skipped" not in md
    assert "| 0 | 0.000 | 0.250 | - |" in md  # held-out success against wall seconds: the evaluated step's


def test_eval_wall_seconds_are_the_evaluated_steps():
    recs = [{"step": 1, "wall_s": 5.0}, {"step": 2, "wall_s": 9.5}, {"step": 3}]
    evals = [{"step": 0, "success": 0.1}, {"step": 2, "success": 0.4}, {"step": 3, "success": 0.7}]
    assert eval_wall_s(recs, evals) == [(0.0, 0.1), (9.5, 0.4)]  # step 3 has no wall_s: not placed


def test_errors_name_the_problem(tmp_path, capsys):
    assert cli_main([str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew')  # killed during its first line
    assert cli_main([str(tmp_path)]) == 2
    assert "holds no step records yet" in capsys.readouterr().out
