"""Reward functions users already have: TRL's batched signature next to the per-trajectory form (same totals
on the same episodes), decoded text for both, async rewards awaited concurrently with timeouts (a timeout is
a reward_error, never a 0), and the spec checks of both forms."""

from __future__ import annotations

import asyncio
import time

import pytest

from rewards import RewardMetrics, acompose, acompose_batch, compose, compose_batch, validate_reward_specs
from rewards.text import NoTextError, completion_messages, completion_text, dataset_row, prompt_messages
from tests import custom_rewards
from tests.traj_factory import make_traj


def episode(
    answer_text: str, truth: str = "5", prompt: object = "What is 2+3?", level: int = 1, turns: int = 1
):
    """A finished episode with its decoded conversation and dataset row, as the rollout records them."""
    layout = [("prompt", 4)]
    messages = [{"role": "system", "content": "Solve."}, {"role": "user", "content": "What is 2+3?"}]
    for i in range(turns):
        layout.append(("assistant", 3 + i))
        messages.append({"role": "assistant", "content": answer_text if i == turns - 1 else "hmm"})
        if i < turns - 1:
            layout.append(("observation", 2))
            messages.append({"role": "user", "content": "Try again."})
    row = {
        "index": 3,
        "columns": {"prompt": prompt, "answer": truth, "level": level},
        "prompt_field": "prompt",
        "answer_field": "answer",
    }
    return make_traj(
        layout,
        outcome=1.0,
        terminated=True,
        metadata={"messages": messages, "n_prompt_messages": 2, "dataset_row": row},
    )


def test_text_accessors():
    t = episode("so it is 5", turns=2)
    assert prompt_messages(t)[-1]["content"] == "What is 2+3?" and completion_text(t) == "so it is 5"
    assert [m["role"] for m in completion_messages(t)] == ["assistant", "user", "assistant"]
    assert dataset_row(t) == {"prompt": "What is 2+3?", "answer": "5", "level": 1}
    with pytest.raises(NoTextError, match="no decoded text"):
        completion_text(make_traj([("prompt", 2), ("assistant", 2)]))


def test_trl_form_and_trajectory_form_give_the_same_totals():
    trajs = [
        episode("it is 5"),
        episode("it is 6"),
        episode("5", truth="5"),
        episode("", truth="1"),
        episode("x 12", truth="12", turns=3),
    ]
    specs = [
        {"name": "tests.custom_rewards:trl_numeric", "key": "trl", "weight": 0.5},
        {"name": "tests.custom_rewards:traj_numeric", "key": "traj", "weight": 0.5},
    ]
    custom_rewards.TRL_CALLS.clear()
    compose_batch(trajs, specs)
    assert custom_rewards.TRL_CALLS == [5]  # one batched call for the five episodes
    assert (
        [t.rewards["trl"] for t in trajs] == [t.rewards["traj"] for t in trajs] == [1.0, 0.0, 1.0, 0.0, 1.0]
    )
    alone = [episode("it is 5"), episode("it is 6")]
    for t in alone:
        compose(t, [{"name": "tests.custom_rewards:trl_numeric"}])  # a batch of one each
    assert [t.rewards["total"] for t in alone] == [1.0, 0.0] and custom_rewards.TRL_CALLS[-2:] == [1, 1]


def test_trl_form_inputs_follow_trls_conventions():
    custom_rewards.TRL_SEEN.clear()
    plain, chat = episode("it is 5"), episode("ok", prompt=[{"role": "user", "content": "hi"}], turns=2)
    compose_batch([plain, chat], [{"name": "tests.custom_rewards:trl_echo"}])
    (seen,) = custom_rewards.TRL_SEEN
    assert seen["prompts"] == ["What is 2+3?", [{"role": "user", "content": "hi"}]]  # as written in the file
    assert seen["completions"][0] == "it is 5"  # a string prompt: the last assistant turn's text
    assert [m["role"] for m in seen["completions"][1]] == ["assistant", "user", "assistant"]  # chat: messages
    assert seen["ids"][0] == plain.tokens[4:].tolist()  # every token after the prompt span
    assert seen["answer"] == ["5", "5"] and seen["level"] == [1, 1] and "prompt" not in seen
    assert plain.rewards["total"] == float(len(plain.tokens) - 4)
    custom_rewards.TRL_SEEN.clear()
    generated = make_traj(
        [("prompt", 2), ("assistant", 2)],
        metadata={
            "messages": [{"role": "user", "content": "Compute 1+1."}, {"role": "assistant", "content": "2"}],
            "n_prompt_messages": 1,
        },
    )
    compose(generated, [{"name": "tests.custom_rewards:trl_echo"}])
    (seen,) = custom_rewards.TRL_SEEN
    assert seen["prompts"] == [
        [{"role": "user", "content": "Compute 1+1."}]
    ]  # a generated task: its messages
    assert set(seen) == {"prompts", "completions", "ids"}  # no dataset columns


def test_trl_none_wrong_length_and_errors_are_reward_errors_never_zero():
    a, b, c = episode("1"), episode("2"), episode("3")
    m = compose_batch([a, b, c], [{"name": "tests.custom_rewards:trl_none_for_odd"}])
    assert a.rewards["total"] == 1.0 and c.rewards["total"] == 1.0
    assert b.rewards == {} and "returned None for this completion" in b.reward_error
    assert m.n_reward_errors == 1 and m.n_scored == 2
    trajs = [episode("1"), episode("2")]
    compose_batch(trajs, [{"name": "tests.custom_rewards:trl_short"}])
    assert all("returned 1 rewards for 2 completions" in t.reward_error for t in trajs)
    t = episode("1")
    t.metadata.pop("messages")
    compose(t, [{"name": "tests.custom_rewards:trl_numeric"}])
    assert "raised NoTextError" in t.reward_error and t.rewards == {}


def test_async_rewards_run_concurrently_and_time_out_into_reward_errors():
    trajs = [episode(str(i)) for i in range(8)]
    custom_rewards.IN_FLIGHT.update(now=0, max=0)
    asyncio.run(
        acompose_batch(trajs, [{"name": "tests.custom_rewards:async_traj_len", "params": {"delay_s": 0.2}}])
    )
    assert custom_rewards.IN_FLIGHT["max"] == 8  # all eight awaited at once, not one after another
    assert [t.rewards["total"] for t in trajs] == [float(t.n_generated) for t in trajs]
    specs = [
        {"name": "outcome"},
        {"name": "tests.custom_rewards:async_hangs", "key": "judge", "timeout_s": 0.2},
    ]
    t = asyncio.run(acompose(episode("5"), specs))
    assert t.rewards == {} and "total" not in t.rewards
    assert (
        t.reward_error
        == "reward 'judge' (tests.custom_rewards:async_hangs) timed out after 0.2 s (timeout_s); not scored"
    )
    assert t.metadata["reward_failed"] == ["judge"]
    m = RewardMetrics.from_trajectories([t])
    assert m.n_reward_errors == 1 and m.errors_by_key == {"judge": 1} and m.n_trainable == 0
    trajs = [episode("1"), episode("2")]
    asyncio.run(acompose_batch(trajs, [{"name": "tests.custom_rewards:trl_async_hangs", "timeout_s": 0.1}]))
    assert all("timed out after 0.1 s" in t.reward_error for t in trajs)


def test_a_hung_plain_def_reward_never_holds_the_event_loop():
    """In a rollout worker (acompose) a plain-def reward runs on a thread of its own: one that hangs is a
    reward error after its timeout_s, never a 0, and the event loop (the engine, other episodes) keeps
    running meanwhile; the other rewards of the spec list still score."""
    custom_rewards.RELEASE_SYNC_HANG.clear()
    ticks = []

    async def run():
        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        tick = asyncio.ensure_future(ticker())
        hung = {"name": "tests.custom_rewards:sync_hangs", "key": "slow", "timeout_s": 0.5}
        specs = [{"name": "outcome"}, hung]
        t = await acompose(episode("5"), specs)
        tick.cancel()
        return t

    try:
        t = asyncio.run(run())
    finally:
        custom_rewards.RELEASE_SYNC_HANG.set()
    assert t.rewards == {} and t.metadata["reward_failed"] == ["slow"]
    assert t.reward_error == (
        "reward 'slow' (tests.custom_rewards:sync_hangs) timed out after 0.5 s (timeout_s); not scored")
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) >= 10 and max(gaps) < 0.4, (len(ticks), max(gaps, default=None))


def test_sync_entry_points_with_async_specs():
    t = compose(episode("5"), [{"name": "tests.custom_rewards:async_traj_len", "params": {"delay_s": 0.0}}])
    assert t.rewards["total"] == float(t.n_generated)  # no running loop: compose runs one

    async def inside_a_loop():
        compose(episode("5"), [{"name": "tests.custom_rewards:async_traj_len"}])

    with pytest.raises(RuntimeError, match="use `await rewards.acompose"):
        asyncio.run(inside_a_loop())

    async def sync_specs_inside_a_loop():  # plain specs need no loop: compose keeps working in async code
        return compose(episode("5"), [{"name": "outcome"}])

    assert asyncio.run(sync_specs_inside_a_loop()).rewards["total"] == 1.0


def test_spec_checks_of_both_forms():
    (spec,) = validate_reward_specs([{"name": "tests.custom_rewards:trl_numeric"}])
    assert (spec.form, spec.is_async, spec.timeout_s) == ("trl", False, 60.0)
    (spec,) = validate_reward_specs([{"name": "tests.custom_rewards:judge", "timeout_s": 5}])
    assert (spec.form, spec.is_async, spec.timeout_s) == ("trl", True, 5.0)
    (spec,) = validate_reward_specs([{"name": "tests.custom_rewards:async_traj_len"}])
    assert (spec.form, spec.is_async, spec.timeout_s) == ("trajectory", True, 60.0)
    (spec,) = validate_reward_specs([{"name": "outcome", "timeout_s": 3}])  # plain defs are limited too
    assert (spec.is_async, spec.timeout_s) == (False, 3.0)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got -1"):
        validate_reward_specs([{"name": "tests.custom_rewards:judge", "timeout_s": -1}])
    with pytest.raises(ValueError, match=r"param scale='x' \(str\) does not match its annotation float"):
        validate_reward_specs([{"name": "tests.custom_rewards:trl_with_param", "params": {"scale": "x"}}])
    (spec,) = validate_reward_specs(
        [{"name": "tests.custom_rewards:trl_with_param", "params": {"scale": 2.0}}]
    )
    assert compose(episode("5"), [spec]).rewards["total"] == 2.0
    t = compose(episode("5"), [{"name": "tests.custom_rewards:trl_numeric", "params": {"level": 3}}])
    assert "param 'level' shadows the dataset column 'level'" in t.reward_error
