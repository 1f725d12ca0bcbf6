"""Few-shot demonstrations (envs/demonstrations.py): worked turns between the system message and the task,
in the prompt the engine sees, never scored; bad ones refused with the problem named, at env construction
and at config load."""

from __future__ import annotations

import asyncio

import pytest

import envs
from model.tokenizer import load_tokenizer
from rl.config import ConfigError, load_config
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from tests.scripted_engine import ScriptedEngine

DEMOS = [
    {"role": "user", "content": "Compute 2+3."},
    {"role": "assistant",
     "content": '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": '<tool_call>{"name": "answer", "arguments": {"value": 5}}</tool_call>'},
    {"role": "tool", "content": "correct"},
]


def test_demonstrations_sit_between_the_system_message_and_the_task():
    plain = envs.make("arith", difficulty=1, use_sandbox=False)
    shown = envs.make("arith", difficulty=1, use_sandbox=False, demonstrations=DEMOS)
    base, _ = plain.reset(seed=4)
    msgs, _ = shown.reset(seed=4)
    assert msgs == [base[0], *DEMOS, base[1]]
    DEMOS[0]["content"] = "changed after construction"  # the env holds its own copy
    try:
        assert shown.reset(seed=4)[0][1]["content"] == "Compute 2+3."
    finally:
        DEMOS[0]["content"] = "Compute 2+3."
    # every generated-task env takes them (the task alone: no sandbox is leased)
    for env_id in ("code-repair", "long-docs"):
        env = envs.make(env_id, demonstrations=DEMOS[:2])
        env.task = env.generate_task(0, {})
        first = env.first_messages()
        assert first[1:3] == DEMOS[:2] and first[0]["role"] == "system" and first[3]["role"] == "user"


def test_a_demonstrated_episode_is_scored_on_its_own_turns_only():
    """The oracle still solves the task after the demonstrations; their tokens are prompt (mask 0), and
    the episode's generated tokens are exactly the oracle's turns."""
    codec = ChatCodec(load_tokenizer())
    probe = envs.make("arith", difficulty=1, use_sandbox=False, tools_in_prompt=False)
    probe.reset(seed=3)
    oracle = probe.oracle_actions()
    env = envs.make("arith", difficulty=1, use_sandbox=False, tools_in_prompt=False, demonstrations=DEMOS)
    eng = ScriptedEngine(codec, oracle)
    traj = asyncio.run(run_episode(eng, env, codec, EpisodeConfig(max_new_tokens=64), seed=3))
    assert traj.outcome == 1.0 and traj.infra_error is None
    first_prompt = codec.decode(eng.prompts[0])
    for m in DEMOS:
        assert m["content"] in first_prompt
    assert first_prompt.index("Compute 2+3.") < first_prompt.index(probe.task.prompt)
    generated = codec.decode(traj.tokens[traj.loss_mask == 1].tolist())
    assert "Compute 2+3." not in generated and '"expression": "2+3"' not in generated
    assert generated == "".join(oracle)


@pytest.mark.parametrize("bad, needle", [
    ("Compute 2+3.", "must be a list of chat messages, got str"),
    ([["user", "hi"]], "demonstrations[0] must be a message"),
    ([{"role": "system", "content": "x"}], "demonstrations[0].role is 'system'"),
    ([{"role": "user", "content": ""}], "demonstrations[0].content must be a non-empty string"),
    ([{"role": "user", "content": "x", "name": "y"}], "unknown keys ['name']"),
    ([{"role": "assistant", "content": "x"}], "must start with a user message"),
])
def test_bad_demonstrations_are_refused_with_the_problem_named(bad, needle):
    with pytest.raises(ValueError, match="env.kwargs.demonstrations") as e:
        envs.make("arith", use_sandbox=False, demonstrations=bad)
    assert needle in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("configs/smollm2_arith_tools.yaml", [f"env.kwargs.demonstrations={bad!r}"])
    assert needle in str(e.value)


def test_the_tool_config_ships_demonstrations_that_load():
    cfg = load_config("configs/smollm2_arith_tools.yaml")
    demos = cfg.env.kwargs["demonstrations"]
    assert len(demos) == 15 and demos[0]["role"] == "user"
    env = envs.make(cfg.env.id, use_sandbox=False, **cfg.env.kwargs)
    assert env.reset(seed=0)[0][1:16] == demos
