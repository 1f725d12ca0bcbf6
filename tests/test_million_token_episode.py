"""The million-token episode's pipeline at a CI-sized length (issue 15): bench/million_token_episode.py runs
a scripted long-docs reader, teacher-forced through TorchEngine, in a real Docker sandbox; the episode is
scored, stored, read back, validated and packed. The oracle: every stored log-prob and routed expert equals
the trainer's own forward over the stored tokens (token_logprobs, return_routed_experts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from rl.trajectory import TrajectoryStore

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_scripted_reader_episode_is_produced_scored_stored_and_packed(docker_sandbox, sandbox_leak_check,
                                                                       tmp_path):
    torch.manual_seed(3)
    policy = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    policy.save_pretrained(tmp_path / "policy")
    target, out = 12_000, tmp_path / "episode.json"
    proc = subprocess.Popen(
        [sys.executable, "bench/million_token_episode.py", "--target-tokens", str(target), "--run-dir",
         str(tmp_path / "run"), "--out", str(out), f"model.init_from={tmp_path / 'policy'}",
         "env.kwargs.difficulty=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    sandbox_leak_check.track_pid(proc.pid)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    res = json.loads(out.read_text())
    t = res["trajectory"]
    assert t["tokens"] > target and t["infra_error"] is None and t["outcome"] == 1.0 and t["turns"] >= 3
    assert t["has_logprobs_and_routes"] and res["production"]["engine"]["prefill_tokens"] == t["tokens"]
    assert res["learner_batch"] == {"advantage": "raft", "samples": 1, "scored_tokens": t["generated_tokens"]}
    p = res["packed"]
    assert p["micro_batches"] == 1 and p["input_tokens"] == t["tokens"] - 1
    assert p["cu_seqlens"] == [0, t["tokens"] - 1]
    assert p["windows"] == math.ceil(p["input_tokens"] / p["sequence_chunk_tokens"]) > 1
    assert p["replay_shape"] == [t["tokens"] - 1, len(policy.moe_layer_indices), 2]

    (traj,) = TrajectoryStore(tmp_path / "run" / "trajectories").read_all()
    ids = torch.from_numpy(traj.tokens.astype(np.int64))
    gen = np.flatnonzero(traj.loss_mask[1:]) + 1  # generated (forced) tokens, all but the first token
    assert len(gen) == t["generated_tokens"] > 0
    with torch.no_grad():
        lp = policy.token_logprobs(ids[:-1], ids[1:])
        routed = policy(ids, return_routed_experts=True).routed_experts
    err = (lp[gen - 1] - torch.from_numpy(traj.rollout_logprobs[gen].astype(np.float32))).abs().max().item()
    assert err < 1e-4, err
    assert np.array_equal(traj.routed_experts.astype(np.int64), routed.numpy())
