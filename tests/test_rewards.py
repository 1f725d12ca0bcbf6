"""rewards/: every built-in on hand-built trajectories, composition, placement, errors, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from trl.rewards import get_soft_overlong_punishment

from rewards import (
    RewardMetrics,
    RewardResult,
    compose,
    compose_batch,
    is_trainable,
    specs_from_yaml,
    token_rewards,
    untrainable_reason,
    validate_reward_specs,
)
from rewards.budget import token_budget, turn_penalty
from rewards.outcome import outcome
from rewards.overlong import overlong
from rewards.process import process, turn_validity
from rewards.subgoal import subgoal
from tests.traj_factory import make_traj, step

# prompt 6 | A0 4 | obs 5 | A1 3 | obs 2 | A2 5   (T = 25, assistant spans [6,10) [15,18) [20,25))
LAYOUT = [
    ("prompt", 6),
    ("assistant", 4),
    ("observation", 5),
    ("assistant", 3),
    ("observation", 2),
    ("assistant", 5),
]


def traj3(step_infos=None, **kw):
    return make_traj(LAYOUT, step_infos=step_infos, **kw)


# ---- built-ins -----------------------------------------------------------------------------------


def test_outcome():
    assert outcome(traj3(outcome=1.0, terminated=True)).value == 1.0
    assert outcome(traj3(outcome=0.0, terminated=True)).value == 0.0
    assert outcome(traj3(outcome=0.25), success_value=1.0, fail_value=-1.0).value == -0.5
    assert outcome(traj3(outcome=0.75), threshold=0.5, fail_value=-1.0).value == 1.0
    assert outcome(traj3(outcome=0.25), threshold=0.5, fail_value=-1.0).value == -1.0
    r = outcome(traj3(outcome=None, truncated=True), fail_value=-1.0)
    assert r.value == -1.0 and r.per_turn is None and r.components == {"terminated": 0.0}
    assert outcome(traj3(outcome=None), unterminated_value=-0.2).value == -0.2


def test_subgoal_credits_each_milestone_once_at_first_turn():
    infos = [step(subgoals=["a", "b"]), step(subgoals=["a", "c"]), step(subgoals=["b", "c", "d"])]
    r = subgoal(traj3(infos))
    assert r.per_turn == [2.0, 1.0, 1.0] and r.value == 4.0 and r.components["n_achieved"] == 4
    r = subgoal(traj3(infos), weights={"a": 0.5, "d": 3.0}, default_weight=0.25)
    assert r.per_turn == [0.75, 0.25, 3.0]
    r = subgoal(traj3(infos), cap=2.5)
    assert r.per_turn == [2.0, 0.5, 0.0] and r.value == 2.5
    # fewer step_infos than turns (last turn never reached the env): that turn gets 0
    assert subgoal(traj3(infos[:1])).per_turn == [2.0, 0.0, 0.0]


def test_process_validity():
    infos = [step(tool_calls=1), step(tool_calls=1, tool_errors=["bad arguments"]), step(tool_calls=0)]
    # last turn: no call, no error; it is the final answer only if the episode terminated there
    assert turn_validity(traj3(infos, terminated=True)) == [True, False, True]
    assert turn_validity(traj3(infos, truncated=True)) == [True, False, False]
    assert turn_validity(traj3(infos, truncated=True), require_call=False) == [True, False, True]
    # missing step info / infra error: not judged
    assert turn_validity(traj3(infos[:2])) == [True, False, None]
    assert turn_validity(traj3([step(), step(infra_error="sandbox died")])) == [True, None, None]

    r = process(traj3(infos, terminated=True), valid_reward=0.2, invalid_reward=-0.3, reduce="sum")
    assert r.per_turn == [0.2, -0.3, 0.2] and r.components == {"n_valid": 2.0, "n_invalid": 1.0}
    r = process(traj3(infos, terminated=True), valid_reward=0.3, invalid_reward=-0.3)  # the default: mean
    assert r.per_turn == pytest.approx([0.1, -0.1, 0.1]) and r.value == pytest.approx(0.1)
    # the default does not pay for extra turns: six valid turns score what three do
    six = make_traj([("prompt", 4)] + [("assistant", 2), ("observation", 2)] * 5 + [("assistant", 2)],
                    step_infos=[step(tool_calls=1)] * 5 + [step(tool_calls=0)], terminated=True)  # fmt: skip
    assert process(six).value == pytest.approx(0.1) and process(six, reduce="sum").value == pytest.approx(0.6)


def test_process_reward_model_scorer():
    r = process(traj3([step()] * 3), scorer="tests.custom_rewards:turn_index_scorer", scale=2.0, reduce="sum")
    assert r.per_turn == pytest.approx([0.2, 0.4, 0.6])


@pytest.mark.parametrize("max_len, cache", [(100, 20), (64, 0), (50, 50), (1024, 256), (7, 3)])
def test_overlong_equals_trl(max_len, cache):
    """Oracle: trl.rewards.get_soft_overlong_punishment on the same lengths (tolerance 1e-12)."""
    trl_fn = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
    lengths = sorted(
        {
            0,
            1,
            max_len - cache - 1,
            max_len - cache,
            max_len - cache + 1,
            max_len - 1,
            max_len,
            max_len + 1,
            2 * max_len,
            *range(max(1, max_len - cache - 3), max_len + 4),
        }
        - {-1}
    )
    lengths = [n for n in lengths if n >= 0]
    ours = []
    for n in lengths:
        layout = [("prompt", 3)] + ([("assistant", n)] if n else [])
        t = make_traj(layout)
        assert t.n_generated == n
        ours.append(overlong(t, max_completion_len=max_len, soft_punish_cache=cache).value)
    ref = trl_fn([[0] * n for n in lengths])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)


def test_overlong_counts_generated_tokens_across_turns():
    t = traj3(generated_tail=1)  # 3 + 2 + 4 = 9 generated tokens of 25
    assert overlong(t, max_completion_len=10, soft_punish_cache=4).value == pytest.approx(-0.75)
    assert overlong(t, max_completion_len=10, soft_punish_cache=4, count="total").value == -1.0


def test_turn_penalty():
    r = turn_penalty(traj3(), penalty=0.1, free_turns=1)
    assert r.per_turn == [0.0, -0.1, -0.1] and r.value == pytest.approx(-0.2)


def test_token_budget():
    t = traj3()  # generated per turn 4, 3, 5 -> cumulative 4, 7, 12
    r = token_budget(t, budget=5, penalty_per_token=0.1)
    assert r.per_turn == pytest.approx([0.0, -0.2, -0.5]) and r.components == {"used": 12.0, "over": 7.0}
    r = token_budget(t, budget=5, penalty_per_token=0.1, max_penalty=0.4)
    assert r.per_turn == pytest.approx([0.0, -0.2, -0.2])
    # total: context length when the next assistant turn starts: 15, 20, 25
    r = token_budget(t, budget=18, penalty_per_token=1.0, count="total")
    assert r.per_turn == pytest.approx([0.0, -2.0, -5.0])


# ---- composition and placement -------------------------------------------------------------------

SPECS = [
    {"name": "outcome", "weight": 2.0, "params": {"fail_value": -1.0}},
    {"name": "subgoal", "weight": 0.5},
    {"name": "turn_penalty", "weight": 1.0, "params": {"penalty": 0.1}},
    {"name": "overlong", "weight": 1.0, "params": {"max_completion_len": 12, "soft_punish_cache": 4}},
]


def test_compose_weights_and_per_turn():
    t = traj3([step(subgoals=["a"]), step(subgoals=["b", "a"]), step()], outcome=1.0, terminated=True)
    out = compose(t, SPECS)
    assert out is t and t.reward_error is None and is_trainable(t)
    # outcome 1 (w 2), subgoal [1,1,0] (w .5), turn_penalty [-.1]*3, overlong: 12 gen > 8 -> (8-12)/4 = -1
    assert t.rewards["outcome"] == 1.0 and t.rewards["subgoal"] == 2.0 and t.rewards["overlong"] == -1.0
    assert t.rewards["total"] == pytest.approx(2.0 + 1.0 - 0.3 - 1.0)
    assert t.turn_rewards == pytest.approx([0.4, 0.4, -0.1])
    assert t.rewards["subgoal/n_achieved"] == 2.0 and t.rewards["overlong/length"] == 12.0
    assert t.metadata["reward_status"] == "ok"


def _reference_token_rewards(t) -> np.ndarray:
    """Slow obvious placement: walk the tokens, remember each turn's last generated token."""
    r = np.zeros(t.n_tokens)
    last_of_traj = None
    turn = -1
    last_in_turn: dict[int, int] = {}
    for pos in range(t.n_tokens):
        span = next((s for s in t.turns if s.start <= pos < s.end), None)
        if span is not None and span.role == "assistant":
            turn = [s.start for s in t.assistant_spans()].index(span.start)
            if t.loss_mask[pos]:
                last_in_turn[turn] = pos
                last_of_traj = pos
    for i, v in enumerate(t.turn_rewards):
        r[last_in_turn[i]] += v
    r[last_of_traj] += t.rewards["total"] - sum(t.turn_rewards)
    return r


@pytest.mark.parametrize("tail", [None, 1])
def test_token_rewards_placement(tail):
    t = traj3(
        [step(subgoals=["a"]), step(subgoals=["b"]), step()],
        outcome=1.0,
        terminated=True,
        generated_tail=tail,
    )
    compose(t, SPECS)
    r = token_rewards(t)
    assert r.dtype == np.float32 and r.shape == (25,)
    last = [9, 17, 24] if tail is None else [8, 16, 23]  # last generated token of each assistant turn
    nz = np.flatnonzero(r)
    assert set(nz) <= set(last)
    np.testing.assert_allclose(r[last[:2]], t.turn_rewards[:2], atol=1e-6)
    scalar = t.rewards["total"] - sum(t.turn_rewards)
    np.testing.assert_allclose(r[last[2]], t.turn_rewards[2] + scalar, atol=1e-6)
    np.testing.assert_allclose(r.sum(), t.rewards["total"], atol=1e-5)
    np.testing.assert_allclose(r, _reference_token_rewards(t), atol=1e-6)  # oracle, float32 tolerance


def test_token_rewards_requires_compose():
    with pytest.raises(ValueError, match="compose"):
        token_rewards(traj3())


def test_custom_dotted_rewards():
    specs = validate_reward_specs(
        [
            {"name": "tests.custom_rewards:brevity", "weight": 1.0, "params": {"target": 3, "scale": 0.5}},
            {"name": "tests.custom_rewards:half", "weight": 4.0},
        ]
    )
    assert [s.key for s in specs] == ["brevity", "half"]
    t = compose(traj3(), specs)
    assert t.turn_rewards == pytest.approx([-0.5, 0.0, -1.0])  # spans 4, 3, 5 tokens over target 3
    assert t.rewards["total"] == pytest.approx(-1.5 + 2.0)
    assert t.rewards["brevity/target"] == 3.0


def test_specs_from_yaml():
    specs = specs_from_yaml(
        """
        rewards:
          - name: outcome
            weight: 1
          - name: process
            weight: 0.5
            key: validity
            params: {valid_reward: 0.05, invalid_reward: -0.1}
          - name: process
            weight: 0.5
            key: prm
            params: {scorer: "tests.custom_rewards:turn_index_scorer"}
        """
    )
    assert [(s.name, s.key, s.weight) for s in specs] == [
        ("outcome", "outcome", 1.0),
        ("process", "validity", 0.5),
        ("process", "prm", 0.5),
    ]
    assert specs[1].params == {"valid_reward": 0.05, "invalid_reward": -0.1}


# ---- errors ----------------------------------------------------------------------------------------


def test_raising_reward_marks_error_excludes_and_counts():
    specs = [{"name": "outcome"}, {"name": "tests.custom_rewards:explode", "params": {"message": "kaboom"}}]
    good, bad = traj3(outcome=1.0), traj3(outcome=1.0)
    m = compose_batch([bad], specs)  # no exception
    assert "explode" in bad.reward_error and "RuntimeError: kaboom" in bad.reward_error
    assert bad.rewards == {} and bad.turn_rewards == []  # never a silent zero
    assert not is_trainable(bad) and untrainable_reason(bad).startswith("reward_error")
    with pytest.raises(ValueError, match="kaboom"):
        token_rewards(bad)
    m = m.merge(compose_batch([good], [{"name": "outcome"}]))
    d = m.as_dict()
    assert d["reward/n"] == 2 and d["reward/reward_errors"] == 1 and d["reward/errors/explode"] == 1
    assert d["reward/n_scored"] == 1 and d["reward/outcome/mean"] == 1.0 and d["reward/trainable_frac"] == 0.5


@pytest.mark.parametrize(
    "name, match",
    [
        ("tests.custom_rewards:wrong_length", "4 per_turn values but the trajectory has 3 assistant turns"),
        ("tests.custom_rewards:nan_value", "non-finite"),
    ],
)
def test_invalid_return_values_are_reward_errors(name, match):
    t = compose(traj3(), [{"name": name}])
    assert t.reward_error is not None and match in t.reward_error and not is_trainable(t)


def test_infra_error_trajectories_are_skipped_not_failed():
    a = traj3(
        [step(), step(infra_error="SandboxCrashed: container died")], infra_error="SandboxCrashed: died"
    )
    b = traj3([step(), step(infra_error="SandboxCrashed: container died")])  # only the step says so
    m = compose_batch([a, b, traj3(outcome=0.0)], [{"name": "outcome"}])
    for t in (a, b):
        assert (
            t.rewards == {}
            and t.reward_error is None
            and t.metadata["reward_status"] == "skipped_infra_error"
        )
        assert not is_trainable(t) and untrainable_reason(t).startswith("infra_error")
    d = m.as_dict()
    assert d["reward/infra_errors"] == 2 and d["reward/reward_errors"] == 0 and d["reward/n_scored"] == 1


def test_no_generated_tokens_is_not_trainable():
    t = compose(make_traj([("prompt", 5)]), [{"name": "outcome"}])
    assert untrainable_reason(t) == "no generated tokens"


def test_compose_needs_rewards():
    with pytest.raises(ValueError, match="at least one reward"):
        compose(traj3(), [])
    assert validate_reward_specs([]) == [] and validate_reward_specs(None) == []


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ({"name": "outcom"}, ["unknown built-in reward 'outcom'", "did you mean 'outcome'"]),
        ({"name": "my_rewards.brevity"}, ["unknown built-in", "pkg.module:function"]),
        ({"name": "no_such_pkg_xyz.mod:fn"}, ["module 'no_such_pkg_xyz.mod' not found", "PYTHONPATH"]),
        (
            {"name": "tests.custom_rewards:brevityy"},
            ["has no attribute 'brevityy'", "did you mean 'brevity'"],
        ),
        ({"name": "tests.custom_rewards:NOT_CALLABLE"}, ["is a int, not a callable"]),
        ({"name": "tests.custom_rewards:"}, ["malformed", "'pkg.module:function'"]),
        ({"name": "tests.custom_rewards:no_args"}, ["first positional argument"]),
        ({"name": "overlong", "params": {"max_completion_len": 10}}, ["soft_punish_cache", "do not fit"]),
        ({"name": "turn_penalty", "params": {"penalti": 0.1}}, ["'penalti'", "did you mean 'penalty'"]),
        (
            {"name": "tests.custom_rewards:brevity", "params": {"targt": 1}},
            ["Accepted params: target, scale"],
        ),
        (
            {"name": "overlong", "params": {"max_completion_len": "4096", "soft_punish_cache": 10}},
            ["max_completion_len='4096'", "annotation"],
        ),
        (  # pydantic checks inside containers and refuses bool for a number
            {"name": "subgoal", "params": {"weights": {"a": 1, "b": "x"}}},
            ["rewards[0] (subgoal)", "weights.b='x'", "annotation dict[str, float] | None"],
        ),
        ({"name": "outcome", "params": {"threshold": True}}, ["threshold=True (bool)", "annotation float"]),
        (
            {"name": "overlong", "params": {"max_completion_len": 100, "soft_punish_cache": 200}},
            ["soft_punish_cache must be in [0, max_completion_len=100]"],
        ),
        (
            {"name": "process", "params": {"scorer": "tests.custom_rewards:nope"}},
            ["process scorer", "'nope'"],
        ),
        ({"name": "process", "params": {"reduce": "max"}}, ["reduce must be 'sum' or 'mean'"]),
        ({"name": "outcome", "weight": "0.5"}, ["weight must be a finite number", "remove the quotes"]),
        ({"name": "outcome", "weight": None}, ["weight must be a finite number"]),
        ({"name": "outcome", "weight": True}, ["weight must be a finite number"]),
        ({"name": "outcome", "weight": math.inf}, ["weight must be a finite number"]),
        ({"name": "outcome", "wieght": 1.0}, ["unknown field(s) ['wieght']", "'weight'?"]),
        ({"weight": 1.0}, ["missing 'name'"]),
        ({"name": "outcome", "params": [1]}, ["params must be a mapping"]),
        ({"name": "outcome", "key": "total"}, ["reserved"]),
        ("outcome", ["expected a mapping"]),
    ],
)
def test_validation_errors(spec, fragments):
    with pytest.raises(ValueError) as e:
        validate_reward_specs([spec])
    for f in fragments:
        assert f.lower() in str(e.value).lower(), (f, str(e.value))


def test_validation_reports_every_problem_and_duplicates():
    with pytest.raises(ValueError) as e:
        validate_reward_specs(
            [{"name": "outcom"}, {"name": "process"}, {"name": "process"}, {"name": "x.y:z"}]
        )
    msg = str(e.value)
    assert "rewards[0]" in msg and "rewards[3]" in msg and "share the key 'process'" in msg
    with pytest.raises(ValueError, match="must be a list"):
        validate_reward_specs({"name": "outcome"})


def test_reward_result_helpers():
    r = RewardResult.from_per_turn([0.1, 0.2], {"x": 1})
    assert r.value == pytest.approx(0.3) and r.components == {"x": 1}
    assert RewardMetrics().as_dict()["reward/trainable_frac"] == 0.0
