"""Which trajectories a policy step trains on. Masking, never fake rewards: nothing is scored as zero.

In order, with every exclusion counted (the counts become `learner/...` metrics):

1. A trajectory that is not trainable (`rewards.compose.untrainable_reason`: an infrastructure error, a
   reward error, never scored, or no generated token) is excluded from group statistics and from the loss.
2. Group baselines (grpo, rloo): trajectories are grouped by `metadata["group_id"]`, else
   `metadata["task_id"]`. A group left with fewer than 2 valid members is dropped (no baseline exists).
3. A group whose members' rewards are all equal is dropped (DAPO's dynamic sampling: every advantage would
   be 0). With turn credit the group stays when any member has a non-zero per-turn reward, since those
   reach the tokens through returns-to-go even when the episode rewards tie.
   raft instead (RAFT's reward ranking): of a group's successful members (outcome, the env's success,
   >= 1.0) only those with the group's highest total reward are kept (`below_best` counts the others: a
   success whose process reward is lower, e.g. it made a malformed tool call on the way, is not imitated
   while a clean one exists), and a group without a success is dropped (`no_success_groups`); no size
   limit, since raft needs no baseline.
4. Overlong filtering (DAPO): a truncated episode keeps its place in its group's statistics (step 2 and 3
   and the baseline) but is kept out of the loss.

GAE (PPO) has no groups: only steps 1 and 4 apply.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from rewards.compose import infra_error_of, untrainable_reason
from rl.trajectory import Trajectory


def describe(traj: Trajectory, index: int) -> str:
    """How error messages name a trajectory: its batch index plus the metadata that locates it."""
    m = traj.metadata
    keys = ("episode_index", "task_id", "group_id", "worker_id", "seed")
    where = ", ".join(f"{k}={m[k]!r}" for k in keys if m.get(k) is not None)
    return f"trajectory {index}" + (f" ({where})" if where else "")


def group_key(traj: Trajectory, index: int) -> Hashable:
    """The baseline group of `traj`: metadata["group_id"], else metadata["task_id"]."""
    for key in ("group_id", "task_id"):
        value = traj.metadata.get(key)
        if value is not None:
            return value if isinstance(value, Hashable) else repr(value)
    raise ValueError(
        f"{describe(traj, index)} has neither metadata['group_id'] nor metadata['task_id']: group advantages "
        "need to know which episodes share a task; set metadata['group_id'] when rolling out, or use "
        "learner.advantage=gae"
    )


def baseline_reward(traj: Trajectory, turn_credit: bool) -> float:
    """The scalar a group baseline compares: rewards["total"], or without the per-turn part when the per-turn
    rewards are credited to their turns instead (turn_credit)."""
    total = traj.rewards["total"]
    return total - sum(traj.turn_rewards) if turn_credit else total


def succeeded(traj: Trajectory) -> bool:
    """raft's criterion: the env reported full success (outcome >= 1.0)."""
    return traj.outcome is not None and traj.outcome >= 1.0


@dataclass
class Selection:
    """kept: batch indices trained on (sorted); groups: group key -> kept-or-filtered indices whose group
    survived (the members that define its baseline); counts: exclusions by reason; equal: the members of the
    all-equal groups dropped in step 3 that step 4 would not filter (what learner.equal_groups_in_normaliser
    counts in the normalisers)."""

    kept: list[int]
    groups: dict[Hashable, list[int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    equal: list[int] = field(default_factory=list)


def select(
    trajs: Sequence[Trajectory],
    *,
    grouped: bool,
    group_size: int,
    turn_credit: bool = False,
    overlong_filter: bool = False,
    successes_only: bool = False,
) -> Selection:
    """Apply the rules of the module docstring. `grouped`: grpo/rloo/raft (True) or gae (False);
    `successes_only`: raft's step 3."""
    counts = {
        "infra_errors": 0,
        "reward_errors": 0,
        "unscored": 0,
        "no_generated": 0,
        "small_groups": 0,
        "small_group_members": 0,
        "equal_groups": 0,
        "equal_group_members": 0,
        "no_success_groups": 0,
        "unsuccessful": 0,
        "below_best": 0,
        "overlong_filtered": 0,
    }
    valid = []
    for i, t in enumerate(trajs):
        why = untrainable_reason(t)
        if why is None:
            valid.append(i)
        elif infra_error_of(t) is not None:
            counts["infra_errors"] += 1
        elif t.reward_error:
            counts["reward_errors"] += 1
        elif "total" not in t.rewards:
            counts["unscored"] += 1
        else:
            counts["no_generated"] += 1
    groups: dict[Hashable, list[int]] = {}
    equal: list[int] = []
    if grouped:
        members: dict[Hashable, list[int]] = {}
        valid_set = set(valid)
        for i in range(len(trajs)):  # every trajectory counts towards the size limit, valid or not
            m = trajs[i].metadata
            if i in valid_set or m.get("group_id", m.get("task_id")) is not None:
                members.setdefault(group_key(trajs[i], i), []).append(i)
        for g, idx in members.items():
            if len(idx) > group_size:
                raise ValueError(
                    f"group {g!r} has {len(idx)} trajectories "
                    f"({', '.join(describe(trajs[i], i) for i in idx[:3])}{', ...' if len(idx) > 3 else ''}) "
                    f"but learner.group_size is {group_size}: the rollout "
                    "mixed several groups under one id; give each group its own metadata['group_id']"
                )
        for g, idx in members.items():
            ok = [i for i in idx if i in valid_set]
            if not ok:
                continue
            if successes_only:
                won = [i for i in ok if succeeded(trajs[i])]
                counts["unsuccessful"] += len(ok) - len(won)
                if not won:
                    counts["no_success_groups"] += 1
                    continue
                best_total = max(trajs[i].rewards["total"] for i in won)
                best = [i for i in won if trajs[i].rewards["total"] >= best_total - 1e-9]
                counts["below_best"] += len(won) - len(best)
                groups[g] = best
                continue
            if len(ok) < 2:
                counts["small_groups"] += 1
                counts["small_group_members"] += len(ok)
                continue
            rewards = {baseline_reward(trajs[i], turn_credit) for i in ok}
            turn_signal = turn_credit and any(any(x != 0.0 for x in trajs[i].turn_rewards) for i in ok)
            if len(rewards) == 1 and not turn_signal:
                counts["equal_groups"] += 1
                counts["equal_group_members"] += len(ok)
                equal += [i for i in ok if not (overlong_filter and trajs[i].truncated)]
                continue
            groups[g] = ok
        in_groups = sorted(i for idx in groups.values() for i in idx)
    else:
        in_groups = valid
    kept = []
    for i in in_groups:
        if overlong_filter and trajs[i].truncated:
            counts["overlong_filtered"] += 1
        else:
            kept.append(i)
    return Selection(kept=kept, groups=groups, counts=counts, equal=sorted(equal))


__all__ = ["Selection", "select", "group_key", "baseline_reward", "describe"]
