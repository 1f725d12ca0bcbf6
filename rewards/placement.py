"""Where rewards land in the token stream, for per-token learners (GAE, turn-level credit).

    r = zeros(T)
    r[last_gen(turn i)] += turn_rewards[i]                   for each assistant turn i
    r[last_gen(traj)]   += rewards["total"] - sum(turn_rewards)   (the outcome-type scalars)

last_gen(span) is the last token with loss_mask == 1 inside the span (the end-of-turn token
when the model emitted it), or the span's last token if it holds no generated token;
last_gen(traj) is the last generated token of the episode. So sum(r) == rewards["total"].
"""

from __future__ import annotations

import numpy as np

from envs.trajectory import Trajectory


def token_rewards(traj: Trajectory) -> np.ndarray:
    """Per-token rewards float32 [T] (formula above). ValueError if traj was not scored."""
    if "total" not in traj.rewards:
        why = traj.reward_error or traj.infra_error or "rewards.compose(traj, specs) was not called"
        raise ValueError(f"trajectory has no composed rewards ({why}); it cannot be trained on")
    spans = traj.assistant_spans()
    if len(traj.turn_rewards) != len(spans):
        raise ValueError(
            f"{len(traj.turn_rewards)} turn_rewards for {len(spans)} assistant turns; re-run compose"
        )
    r = np.zeros(traj.n_tokens, dtype=np.float64)
    for span, v in zip(spans, traj.turn_rewards, strict=True):
        idx = traj.last_generated_index(span)
        r[span.end - 1 if idx is None else idx] += v
    scalar = traj.rewards["total"] - float(np.sum(traj.turn_rewards, dtype=np.float64))
    last = traj.last_generated_index()
    if last is None:
        raise ValueError(
            "trajectory has no generated tokens (loss_mask is all 0): nowhere to place its reward"
        )
    r[last] += scalar
    return r.astype(np.float32)
