"""Custom reward functions used by tests/test_rewards.py through "tests.custom_rewards:<name>" paths."""

from __future__ import annotations

import threading

from envs.trajectory import Trajectory
from rewards import RewardResult


def brevity(traj: Trajectory, *, target: int = 10, scale: float = 0.01) -> RewardResult:
    """-scale per generated token beyond `target`, per assistant turn."""
    per_turn = [-scale * max(0, len(s) - target) for s in traj.assistant_spans()]
    return RewardResult.from_per_turn(per_turn, {"target": float(target)})


def half(traj: Trajectory) -> float:
    """A custom reward may return a plain float."""
    return 0.5


def explode(traj: Trajectory, *, message: str = "boom") -> RewardResult:
    raise RuntimeError(message)


def wrong_length(traj: Trajectory) -> RewardResult:
    return RewardResult.from_per_turn([1.0] * (traj.n_assistant_turns + 1))


def nan_value(traj: Trajectory) -> float:
    return float("nan")


def turn_index_scorer(traj: Trajectory, turn: int) -> float:
    """A stand-in process reward model: scores turn i as (i + 1) / 10."""
    return (turn + 1) / 10


def no_args() -> float:
    return 1.0


NOT_CALLABLE = 3


def even_tokens(traj: Trajectory) -> float:
    """Fraction of generated tokens with an even id: varies between samples of an untrained policy, so
    GRPO groups of the training-loop tests have non-zero reward variance."""
    gen = traj.tokens[traj.loss_mask.astype(bool)]
    return float((gen % 2 == 0).mean()) if gen.size else 0.0


def even_tokens_distinct(traj: Trajectory) -> float:
    """`even_tokens` + 1e-3 x the sample's index in its group: the samples of a group never tie (even
    fractions of <= 8 tokens differ by >= 0.125 or not at all), so no group is dropped for equal rewards
    and a step trains every episode whatever the sampled tokens (tests/test_train_observability.py)."""
    return even_tokens(traj) + 1e-3 * int(traj.metadata.get("sample_index", 0))


# ---- TRL's signature and async rewards (tests/test_reward_forms.py, tests/test_judge_rollout.py) ------

TRL_CALLS: list[int] = []  # batch sizes of trl_numeric calls
IN_FLIGHT = {"now": 0, "max": 0}


def trl_numeric(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """TRL form: 1.0 when the completion's last word equals the answer column."""
    TRL_CALLS.append(len(completions))
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.split()[-1] == a if t.split() else False) for t, a in zip(texts, answer)]


def traj_numeric(traj: Trajectory) -> float:
    """The same reward in the per-trajectory form, on the decoded text (rewards.text)."""
    from rewards.text import completion_text, dataset_row

    words = completion_text(traj).split()
    return float(bool(words) and words[-1] == dataset_row(traj)["answer"])


def trl_echo(prompts, completions, completion_ids, **columns) -> list[float]:
    """Records what it was called with (TRL_SEEN) and returns len(completion_ids[i])."""
    TRL_SEEN.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **columns})
    return [float(len(ids)) for ids in completion_ids]


TRL_SEEN: list[dict] = []


def trl_none_for_odd(completions, **kwargs) -> list[float | None]:
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def trl_short(completions, **kwargs) -> list[float]:
    return [1.0] * (len(completions) - 1)


def trl_with_param(completions, scale: float = 1.0, **kwargs) -> list[float]:
    return [scale] * len(completions)


async def async_traj_len(traj: Trajectory, *, delay_s: float = 0.05) -> float:
    """Async per-trajectory reward that records how many calls overlap."""
    import asyncio

    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    try:
        await asyncio.sleep(delay_s)
    finally:
        IN_FLIGHT["now"] -= 1
    return float(traj.n_generated)


async def async_hangs(traj: Trajectory) -> float:
    import asyncio

    await asyncio.sleep(3600)
    return 1.0


RELEASE_SYNC_HANG = threading.Event()


def sync_hangs(traj: Trajectory) -> float:
    """A plain-def reward that blocks its thread until the test releases it (a hung user reward)."""
    RELEASE_SYNC_HANG.wait()
    return 1.0


async def trl_async_hangs(prompts, completions, **kwargs) -> list[float]:
    import asyncio

    await asyncio.sleep(3600)
    return [1.0] * len(completions)


async def judge(prompts, completions, completion_ids, answer, *, url: str, **kwargs) -> list[float]:
    """An LLM-judge-style reward in TRL's form: one HTTP request per completion, concurrently (httpx).
    The stub server in tests/test_judge_rollout.py answers {"score": ...} after a delay, or never."""
    import asyncio

    import httpx

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    async with httpx.AsyncClient(timeout=None) as client:
        replies = await asyncio.gather(
            *(client.post(url, json={"completion": t, "answer": a}) for t, a in zip(texts, answer))
        )
    return [float(r.json()["score"]) for r in replies]


def blocking_judge(prompts, completions, completion_ids, answer, *, url: str, **kwargs) -> list[float]:
    """The same judge as a plain def with blocking HTTP calls, one after another (bench/rewards.py's
    baseline: what a sync judge does to the event loop that serves the engine)."""
    import json
    import urllib.request

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    out = []
    for t, a in zip(texts, answer):
        req = urllib.request.Request(
            url, json.dumps({"completion": t, "answer": a}).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req) as r:
            out.append(float(json.loads(r.read())["score"]))
    return out
