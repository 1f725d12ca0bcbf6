"""The decoded text of an episode, for reward functions of either form.

    from rewards.text import messages, prompt_messages, completion_messages, completion_text, dataset_row

    completion_text(traj)        # the last assistant turn's text (what a single-turn answer is)
    completion_messages(traj)    # every message after the prompt: assistant turns and observations
    dataset_row(traj)            # the dataset row's columns (env.dataset), or {} for a generated task

The rollout's agent loop records the conversation it played in `traj.metadata["messages"]` (system and
user messages from the env, then each assistant turn's text as decoded from its generated tokens, without
the end-of-turn token, and each observation message) and how many of them form the prompt in
`traj.metadata["n_prompt_messages"]`. A task from a dataset row records the row in
`traj.metadata["dataset_row"]` ({index, columns, prompt_field, answer_field}).
"""

from __future__ import annotations

from typing import Any

from envs.trajectory import Trajectory


class NoTextError(ValueError):
    """The trajectory carries no decoded conversation (recorded before text was stored, or built by hand)."""


def messages(traj: Trajectory) -> list[dict[str, str]]:
    """The whole conversation: prompt messages, then assistant turns and observations in order."""
    msgs = traj.metadata.get("messages")
    if msgs is None:
        raise NoTextError(
            "trajectory has no decoded text (metadata['messages']): it was not recorded by the rollout's "
            "agent loop; re-run the rollout, or pass the text into metadata['messages'] and "
            "metadata['n_prompt_messages'] yourself"
        )
    return msgs


def prompt_messages(traj: Trajectory) -> list[dict[str, str]]:
    """The messages the first turn answered (system and user)."""
    return messages(traj)[: int(traj.metadata.get("n_prompt_messages", 0))]


def completion_messages(traj: Trajectory) -> list[dict[str, str]]:
    """Every message after the prompt: assistant turns and the env's observations, in order."""
    return messages(traj)[int(traj.metadata.get("n_prompt_messages", 0)) :]


def completion_text(traj: Trajectory) -> str:
    """The text of the last assistant turn ("" when the episode has none)."""
    turns = [m["content"] for m in completion_messages(traj) if m.get("role") == "assistant"]
    return turns[-1] if turns else ""


def dataset_row(traj: Trajectory) -> dict[str, Any]:
    """The columns of the dataset row the task came from; {} for a task generated from a seed."""
    row = traj.metadata.get("dataset_row")
    return dict(row["columns"]) if row else {}


def completion_ids(traj: Trajectory) -> list[int]:
    """Token ids after the prompt span: every assistant turn and observation, as the model saw them."""
    prompt_end = traj.turns[0].end if traj.turns and traj.turns[0].role == "prompt" else 0
    return [int(t) for t in traj.tokens[prompt_end:]]
