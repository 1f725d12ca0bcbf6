"""Hand-built trajectories for unit tests of rl/trajectory.py and rewards/."""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.trajectory import Trajectory, TurnSpan


def step(
    tool_calls: int = 1,
    tool_errors: list[str] | None = None,
    subgoals: list[str] | None = None,
    infra_error: str | None = None,
) -> dict:
    """One env step info with the contract's keys."""
    return {
        "tool_calls": [{"name": "calc", "arguments": {"expr": "1+1"}} for _ in range(tool_calls)],
        "tool_results": ["2"] * tool_calls,
        "tool_errors": list(tool_errors or []),
        "subgoals": list(subgoals or []),
        "env_reward": 0.0,
        "infra_error": infra_error,
    }


def make_traj(
    layout: list[tuple[str, int]],
    step_infos: list[dict] | None = None,
    n_moe_layers: int | None = None,
    topk: int = 2,
    seed: int = 0,
    generated_tail: int | None = None,
    **fields: Any,
) -> Trajectory:
    """Trajectory whose turns follow `layout` [(role, n_tokens), ...], assistant tokens generated.

    generated_tail: if set, only the first `len - generated_tail` tokens of each assistant span are
    generated (mask 1) and the last `generated_tail` are not (e.g. a template token appended after).
    """
    rng = np.random.default_rng(seed)
    T = sum(n for _, n in layout)
    tokens = rng.integers(0, 4096, T, dtype=np.int32)
    mask = np.zeros(T, dtype=np.uint8)
    turns, pos = [], 0
    for role, n in layout:
        turns.append(TurnSpan(role, pos, pos + n))
        if role == "assistant":
            mask[pos : pos + n - (generated_tail or 0)] = 1
        pos += n
    logprobs = np.full(T, np.nan, dtype=np.float32)
    logprobs[mask == 1] = -rng.random(int(mask.sum())).astype(np.float32) * 5
    routed = None
    if n_moe_layers is not None:
        routed = rng.integers(0, 64, (T, n_moe_layers, topk), dtype=np.uint16)
    return Trajectory(
        tokens=tokens,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        routed_experts=routed,
        turns=turns,
        step_infos=list(step_infos or []),
        **fields,
    )


def assert_traj_equal(a: Trajectory, b: Trajectory) -> None:
    """Field-by-field equality (NaN == NaN for logprobs; arrays compared with their dtypes)."""
    for name in ("tokens", "loss_mask", "rollout_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    if a.routed_experts is None:
        assert b.routed_experts is None
    else:
        assert b.routed_experts.dtype == np.uint16
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    for name in (
        "turns",
        "step_infos",
        "outcome",
        "terminated",
        "truncated",
        "infra_error",
        "reward_error",
        "rewards",
        "turn_rewards",
        "metadata",
    ):
        assert getattr(a, name) == getattr(b, name), name
