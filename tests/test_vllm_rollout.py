"""`odyssey rollout configs/tiny.yaml rollout.engine=vllm`: episodes through a Ray worker running VllmEngine,
tools in real Docker sandboxes, trajectories in the store with rollout log-probs and routed experts.

The stored trajectories are checked against the trainer itself: the worker's policy is rebuilt from the
same preset and seed (`build_policy`), and on every stored trajectory the trainer's log-probs of the
sampled tokens (T = 1) match the rollout log-probs within 1e-4 and its routed experts match the stored
ones on >= 99.9% of (token, layer): R3 parity through the whole rollout path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rl.trajectory import TrajectoryStore
from tests.vllm_helpers import require_vllm, routing_agreement

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.docker, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_odyssey_rollout_with_vllm_engine(ray_session, docker_sandbox, tmp_path):
    require_vllm()
    from rl.config import load_config
    from rl.policy import build_policy
    from rl.rollout.cli import cli_main
    from rl.rollout.worker import WorkerSettings

    run_dir = tmp_path / "run"
    overrides = ["rollout.engine=vllm", "rollout.num_workers=1", "rollout.concurrent_episodes=2",
                 "rollout.sandbox_pool_size=1", "rollout.max_new_tokens=24", "rollout.max_turns=2"]
    rc = cli_main(["configs/tiny.yaml", "--episodes", "4", "--run-dir", str(run_dir), *overrides])
    assert rc == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_stored"] == 4 and summary["worker_failures"] == []
    trajs = TrajectoryStore(run_dir / "trajectories").read_all()
    assert sorted(t.metadata["sample_key"] for t in trajs) == [f"train/0/{j}" for j in range(4)]

    settings = WorkerSettings.from_config(load_config("configs/tiny.yaml", overrides))
    assert settings.engine == "vllm"
    policy = build_policy(settings)
    k, n_moe = policy.config.num_experts_per_tok, len(policy.moe_layer_indices)
    worst, agree = 0.0, 1.0
    for t in trajs:
        assert t.infra_error is None, t.infra_error
        assert t.n_generated > 0 and t.routed_experts is not None
        assert t.routed_experts.shape == (t.n_tokens, n_moe, k)
        sampled = t.loss_mask.astype(bool)
        assert np.isfinite(t.rollout_logprobs[sampled]).all()
        ids = torch.tensor(t.tokens, dtype=torch.long)
        with torch.no_grad():
            lp = policy.token_logprobs(ids[:-1], ids[1:]).numpy()
            routed = policy(ids, return_routed_experts=True).routed_experts.numpy()
        worst = max(worst, float(np.abs(lp[sampled[1:]] - t.rollout_logprobs[sampled]).max()))
        agree = min(agree, routing_agreement(t.routed_experts.astype(np.int64), routed))
    print(f"\nrollout through Ray: logprob max|diff| {worst:.2e}, routing agreement {agree:.5f}")
    assert worst <= 1e-4 and agree >= 0.999
