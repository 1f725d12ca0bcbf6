"""`odyssey rollout` for real on what users bring, YAML only (configs/quickstart.yaml and overrides): a jsonl
dataset with TRL-signature rewards (its rows forming the training loop's groups), a reasoning-gym dataset
(procedural) and a SkyRL-gym env whose tasks are dataset rows. Ray workers and the TorchEngine policy;
no Docker (these envs run no tools)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from envs.dataset import TaskDataset
from rl.rollout.cli import cli_main
from rl.trajectory import TrajectoryStore

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"
FAST = ["rollout.max_new_tokens=16", "rollout.concurrent_episodes=4"]


def _run(tmp_path, *args: str) -> list:
    run_dir = tmp_path / "run"
    assert cli_main([QUICKSTART, "--run-dir", str(run_dir), *FAST, *args]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = TrajectoryStore(run_dir / "trajectories").read_all()
    assert summary["episodes_stored"] == len(trajs) and summary["infra_errors"] == 0
    assert all(t.infra_error is None and t.reward_error is None and "total" in t.rewards for t in trajs)
    return trajs


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_jsonl_dataset_with_trl_rewards_forms_groups_of_rows(ray_session, tmp_path):
    trajs = _run(tmp_path, "--episodes", "8")
    assert len(trajs) == 8
    data = TaskDataset.load(REPO / "examples/quickstart/arith_qa.jsonl", eval_size=8, seed=0)
    groups = collections.defaultdict(list)
    for t in trajs:
        groups[t.metadata["group_id"]].append(t)
    assert len(groups) == 2  # 8 episodes = 2 rows x group_size 4
    for key, members in groups.items():
        (row,) = {t.metadata["dataset_row"]["index"] for t in members}
        assert key.endswith(f"@row={row}") and row in set(data.train.tolist())
        assert sorted(t.metadata["sample_index"] for t in members) == [0, 1, 2, 3]
        assert len({t.metadata["sample_seed"] for t in members}) == 4
        assert members[0].metadata["messages"][1]["content"] == data.rows[row]["prompt"]
    for t in trajs:  # both TRL-signature rewards and the verifier's outcome scored every episode
        assert {"outcome", "numeric_match", "brevity"} <= set(t.rewards) and t.outcome in (0.0, 1.0)
        assert t.metadata["env_id"] == "dataset-qa"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_skyrl_gym_env_on_dataset_rows(ray_session, tmp_path):
    trajs = _run(
        tmp_path,
        "--episodes",
        "4",
        "env.id=skyrl/gsm8k",
        "env.dataset.path=examples/quickstart/gsm8k_skyrl.jsonl",
        "env.dataset.eval_size=2",
        "env.kwargs={}",
        "rewards=[{name: outcome}, {name: env_reward}]",
    )
    assert len(trajs) == 4
    for t in trajs:
        assert t.metadata["env_id"] == "skyrl/gsm8k" and t.metadata["task_id"].startswith("skyrl/gsm8k/row-")
        assert t.metadata["dataset_row"]["columns"]["reward_spec"]["ground_truth"]
        assert t.terminated and t.n_assistant_turns == 1  # gsm8k is single-turn: SkyRL says done
        assert t.rewards["env_reward"] == t.step_infos[0].env_reward == t.outcome


@pytest.mark.timeout(600)
def test_reasoning_gym_env_through_odyssey_rollout(tmp_path):
    trajs = _run(
        tmp_path,
        "--episodes",
        "4",
        "--no-ray",
        "env.id=reasoning-gym/chain_sum",
        "env.dataset=null",
        "env.kwargs={config: {min_terms: 2, max_terms: 3}}",
        "rewards=[{name: outcome}]",
    )
    assert len(trajs) == 4
    assert {t.metadata["env_id"] for t in trajs} == {"reasoning-gym/chain_sum"}
    assert len({t.metadata["task_id"] for t in trajs}) == 1  # 4 samples of the first task
    for t in trajs:
        assert t.metadata["messages"][0]["content"].endswith(
            "only the final answer. When an example is "
            "provided, you should strictly follow the format "
            "of the output/answer in that example."
        )
        assert t.terminated and t.outcome is not None and t.rewards["total"] == t.outcome
