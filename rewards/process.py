"""`process`: a per-turn score for how each assistant turn was carried out.

Validity mode (default). Assistant turn i is judged from step_infos[i]:
    invalid  if it recorded tool_errors (malformed call, unknown tool, bad arguments, tool raised)
    valid    if it made >= 1 tool call and no tool error
    no call, no error: valid if it is the last step of a terminated episode (the final answer),
             or if require_call is false; otherwise invalid (the model neither acted nor answered)
    neutral (0) if step_infos[i] is missing (the env never consumed the turn) or reports infra_error
    per_turn[i] = valid_reward | invalid_reward | 0

Process-reward-model mode: `scorer="pkg.module:fn"`, called as fn(traj, i) -> float for every
assistant turn i;  per_turn[i] = scale * fn(traj, i).

reduce="mean" (the default) divides every per_turn entry by the number of assistant turns n, so the value
is the mean: it lies in [invalid_reward, valid_reward] however many turns the episode takes.
reduce="sum" leaves them: value = sum_i per_turn[i]. A sum pays for every extra well-formed turn, so a
policy earns more by taking more turns (a long-docs reader of every page scores 20.8 against the
outcome's 1.0), and RAFT's best-of-group ranking picks a success with a wasted turn over a clean one
(docs/training.md, "Does it learn?").
"""

from __future__ import annotations

import inspect

from envs.dotted import resolve_name
from envs.trajectory import Trajectory
from rewards.base import RewardResult, param_check


def _check(
    valid_reward: float,
    invalid_reward: float,
    require_call: bool,
    scorer: str | None,
    scale: float,
    reduce: str,
) -> None:
    if reduce not in ("sum", "mean"):
        raise ValueError(f"process: reduce must be 'sum' or 'mean', got {reduce!r}")
    if scorer is not None:
        fn = resolve_name(scorer, what="process scorer")
        try:
            inspect.signature(fn).bind(None, 0)
        except TypeError as e:
            raise ValueError(f"process scorer {scorer!r} must accept (traj, turn_index): {e}") from e
        except ValueError:
            pass  # builtins without a signature: checked when called


def turn_validity(traj: Trajectory, require_call: bool = True) -> list[bool | None]:
    """Per assistant turn: True (valid), False (invalid) or None (not judged: no step info / infra error)."""
    out: list[bool | None] = []
    n_steps = len(traj.step_infos)
    for i in range(traj.n_assistant_turns):
        if i >= n_steps or traj.step_infos[i].infra_error:
            out.append(None)
            continue
        info = traj.step_infos[i]
        if info.tool_errors:
            out.append(False)
        elif info.tool_calls:
            out.append(True)
        else:
            final_answer = traj.terminated and i == n_steps - 1
            out.append(final_answer or not require_call)
    return out


@param_check(_check)
def process(
    traj: Trajectory,
    *,
    valid_reward: float = 0.1,
    invalid_reward: float = -0.1,
    require_call: bool = True,
    scorer: str | None = None,
    scale: float = 1.0,
    reduce: str = "mean",
) -> RewardResult:
    n = traj.n_assistant_turns
    components: dict[str, float] = {}
    if scorer is None:
        validity = turn_validity(traj, require_call)
        per_turn = [0.0 if v is None else (valid_reward if v else invalid_reward) for v in validity]
        components["n_valid"] = float(sum(v is True for v in validity))
        components["n_invalid"] = float(sum(v is False for v in validity))
    else:
        fn = resolve_name(scorer, what="process scorer")
        per_turn = [scale * float(fn(traj, i)) for i in range(n)]
    if reduce == "mean" and n:
        per_turn = [x / n for x in per_turn]
    elif reduce not in ("sum", "mean"):
        raise ValueError(f"process: reduce must be 'sum' or 'mean', got {reduce!r}")
    return RewardResult.from_per_turn(per_turn, components)
