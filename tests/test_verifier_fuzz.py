"""Fuzzing every verifier with hostile values: each returns a verdict, never raises, never hangs.

The policy is an adversary (docs/sandbox.md, "Threat model"): whatever its text or its sandboxed code prints,
a check must come back as a verdict. A verifier that raises or hangs on some value lets that answer escape
scoring (issue 40: a 400-digit integer on an `@@observed` line made `decide` raise, so `submit` never ended
the episode). Each test below drives one verifier (or one env's scoring path) with hostile values, fixed
ones (huge integers, NaN/inf, nesting past the recursion limit, values that contain themselves, lone
surrogates, bytes, megabytes of text, wrong types, objects whose comparison raises, texts that make naive
regexes quadratic) and generated ones (hypothesis), and asserts that a verdict comes back within a time
bound. The verifiers: envs/observations.py (`same`, `parse_observations`), code-repair's `decide`,
envs/verifiers.py (`final_answer`, exact-match, math-verify), the tool-call parser and the step info
(envs/tool_call.py, envs/base.py), the arith/long-docs/vision-arith answers, dataset-qa, the reasoning-gym
and SkyRL-gym adapters and the agent env's `score`.
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.code_repair import decide
from envs.observations import parse_observations, same
from envs.sandbox_scripts.observe import RESULT_PREFIX
from envs.tasks import code_repair as code_repair_tasks
from envs.tool_call import ToolCall, ToolCallError, parse_tool_calls
from envs.verifiers import ExactMatch, VerifierResult, final_answer, make_verifier

IN_PROCESS_S = 5.0  # bound for a verdict computed in this process (generous: 2 shared cores)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FUZZ_FEW = settings(FUZZ, max_examples=20)  # each example spawns work in a child process


def timed(fn: Callable[[], Any], bound_s: float = IN_PROCESS_S) -> Any:
    """fn()'s value, asserting it came within `bound_s` seconds."""
    t0 = time.perf_counter()
    value = fn()
    elapsed = time.perf_counter() - t0
    assert elapsed < bound_s, f"took {elapsed:.1f} s (bound {bound_s} s)"
    return value


# ---------------------------------------------------------------------------------------- hostile values
def nested_list(depth: int, leaf: Any = 1) -> Any:
    """A list nested `depth` levels deep, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def nested_dict(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


class Hostile:
    """An object whose every comparison, conversion and iteration raises (what agent code would return)."""

    def _boom(self, *args: Any) -> Any:
        raise RuntimeError("hostile")

    __eq__ = __ne__ = __lt__ = __gt__ = __bool__ = __len__ = __iter__ = __str__ = __float__ = _boom
    __hash__ = None  # type: ignore[assignment]


def _self_list() -> list:
    x: list = []
    x.append(x)
    return x


def _self_dict() -> dict:
    d: dict = {}
    d["d"] = d
    return d


HOSTILE_VALUES: dict[str, Any] = {
    "int_400_digits": 10**400,
    "neg_int_400_digits": -(10**400),
    "int_4000_digits": 10**4000,
    "int_2_63": 2**63,
    "nan": math.nan,
    "inf": math.inf,
    "neg_inf": -math.inf,
    "neg_zero": -0.0,
    "max_float": 1.7976931348623157e308,
    "list_600_deep": nested_list(600),
    "list_100000_deep": nested_list(100_000),
    "dict_5000_deep": nested_dict(5000),
    "int_in_600_deep": nested_list(600, 10**400),
    "self_list": _self_list(),
    "self_dict": _self_dict(),
    "lone_surrogate": "\ud800",
    "surrogate_in_text": "a\udfffb",
    "bytes": b"\xff\xfe\x00",
    "bytearray": bytearray(b"14"),
    "megabyte_string": "7" * (1 << 20),
    "empty": "",
    "none": None,
    "true": True,
    "object": object(),
    "set": {1, 2},
    "tuple": (1, 2),
    "complex": complex(1, 2),
    "hostile": Hostile(),
    "list_of_hostile": [Hostile()],
}

# JSON text as the sandbox (the agent's code) could print it after RESULT_PREFIX: what json.loads accepts
# (400-digit integers, NaN/Infinity, 1e999) and what it does not (4300+ digits, nesting past the limit).
HOSTILE_JSON_LITERALS: dict[str, str] = {
    "int_400_digits": "1" + "0" * 400,
    "neg_int_400_digits": "-" + "9" * 400,
    "int_5000_digits": "1" + "0" * 4999,
    "float_overflow": "1e999",
    "nan": "NaN",
    "infinity": "Infinity",
    "neg_infinity": "-Infinity",
    "list_600_deep": "[" * 600 + "]" * 600,
    "list_20000_deep": "[" * 20_000 + "]" * 20_000,
    "dict_900_deep": '{"a":' * 900 + "1" + "}" * 900,
    "unbalanced": "[" * 5000,
    "lone_surrogate": '"\\ud800"',
    "string": '"XIV"',
    "null": "null",
    "true": "true",
    "object": '{"float": "nan"}',
    "bigint_bits": '{"bigint_bits": 1329}',
}

HOSTILE_TEXTS: dict[str, str] = {
    "boxed_unclosed_many": "\\boxed{" * 20_000,
    "answer_unclosed_many": "<answer>" * 20_000,
    "answer_tags_then_boxed": "<answer>" * 20_000 + "\\boxed{1",
    "braces_100000_deep": "{" * 100_000 + "}" * 100_000,
    "boxed_deep": "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",
    "boxed_int_5000": "\\boxed{" + "9" * 5000 + "}",
    "boxed_power_tower": "\\boxed{9^{9^{9^{9}}}}",
    "boxed_nan": "\\boxed{nan}",
    "boxed_inf": "\\boxed{\\infty}",
    "boxed_div_zero": "\\boxed{\\frac{1}{0}}",
    "boxed_parens": "\\boxed{" + "(" * 3000 + "}",
    "answer_surrogate": "<answer>\ud800</answer>",
    "nul_and_controls": "\x00\x1b[2J\u202e" * 1000,
    "megabyte": "x" * (1 << 20),
    "gsm8k_hashes": "#### " * 20_000 + "-",
    "gsm8k_digits": "#### " + "9" * 100_000,
    "empty": "",
}

TEXT_CHUNKS = [
    "\\boxed{", "{", "}", "<answer>", "</answer>", "#### ", "<tool_call>", "</tool_call>", RESULT_PREFIX,
    "9" * 400, "NaN", "\ud800", "\x00", "[", "]", '"', "\\", "\n", "1/0", "\\frac{1}{2}", "5",
]  # fmt: skip

surrogate_chars = st.characters(codec=None, categories=["Cs", "Cc", "Nd", "Lu", "Ps", "Pe", "Po"])
hostile_texts = st.one_of(
    st.sampled_from(list(HOSTILE_TEXTS.values())),
    st.lists(st.one_of(st.sampled_from(TEXT_CHUNKS), st.text(surrogate_chars, max_size=20)), max_size=60).map(
        "".join
    ),
)
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(surrogate_chars, max_size=10),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
hostile_values = st.one_of(st.sampled_from(list(HOSTILE_VALUES.values())), json_values)


# ------------------------------------------------------------------------------ observations + decide
EXPECTED_TRACES: list[Any] = [
    [14], [0.5], [-1, -1], ["XIV"], [None], [True], ["ValueError"], [[1, 2], [3, 4]], [{"float": "nan"}],
    {"a": [1.0]}, [], [2**62], [{"bigint_bits": 1329}],
]  # fmt: skip


@pytest.fixture(scope="module")
def checks_by_template() -> dict[str, list[code_repair_tasks.Check]]:
    config = code_repair_tasks.resolve_config(0)
    out: dict[str, list[code_repair_tasks.Check]] = {}
    for seed in range(300):
        task = code_repair_tasks.generate(seed, config)
        if task.template.name not in out:
            out[task.template.name] = code_repair_tasks.draw_checks(task, 0)
    assert len(out) == 6, sorted(out)
    return out


@pytest.mark.parametrize("kind", sorted(HOSTILE_VALUES))
def test_same_is_total_on_hostile_observations(kind):
    """`same(observed, expected)` for each hostile observed value against every shape of expected trace:
    a bool, quickly; only a value equal to the expected one can be the same."""
    observed = HOSTILE_VALUES[kind]
    for expected in EXPECTED_TRACES:
        verdict = timed(lambda: same(observed, expected))  # noqa: B023
        assert verdict is False, (kind, expected)
        wrapped = timed(lambda: same([observed], expected))  # noqa: B023
        assert wrapped is (kind in ("none", "true") and expected == [observed]), (kind, expected)
        assert timed(lambda: same(expected, observed)) in (True, False)  # noqa: B023


def test_same_still_compares_numbers_as_before():
    assert same([1.0], [1]) and same([0.1 + 0.2], [0.3]) and not same([True], [1]) and not same([1], [True])
    assert same([10**400], [10**400]) and not same([10**400], [10**400 + 1]) and not same([10**400], [1e308])
    assert same([2**60], [2**60]) and not same([2**60 + 1], [2**60])  # beyond 2**53: exact
    assert same({"a": [1, "x"]}, {"a": [1, "x"]}) and not same({"a": 1}, {"b": 1})


@given(observed=hostile_values, expected=st.sampled_from(EXPECTED_TRACES))
@FUZZ
def test_same_fuzz(observed, expected):
    assert timed(lambda: same(observed, expected)) in (True, False)


def _observed_line(check_id: Any, trace_literal: str) -> str:
    return f'{RESULT_PREFIX}{{"id": {json.dumps(check_id)}, "trace": [{trace_literal}], "note": ""}}'


@pytest.mark.parametrize("kind", sorted(HOSTILE_JSON_LITERALS))
def test_decide_fails_every_check_on_hostile_observation_lines(checks_by_template, kind):
    """Issue 40's reproduction and its class: the sandbox prints, for every check id, a result line whose
    trace holds a hostile JSON value (a 400-digit integer made `decide` raise OverflowError). Every test of
    every template fails, with a reason, and nothing raises."""
    literal = HOSTILE_JSON_LITERALS[kind]
    for template, checks in checks_by_template.items():
        stdout = "\n".join(_observed_line(c.id, literal) for c in checks) + "\n"
        results, why, _ = timed(lambda: decide(checks, stdout))  # noqa: B023
        assert results and not any(results.values()), (template, kind, results)
        assert set(why) == set(results) and all(isinstance(w, str) and w for w in why.values())


def test_decide_takes_the_first_well_formed_line_and_ignores_malformed_ones(checks_by_template):
    """Malformed lines (bad ids, wrong shapes, deep nesting, bytes, overlong) are missing results; the first
    well-formed line per id decides, so a forged line after the real one changes nothing."""
    checks = checks_by_template["roman"]
    right = [_observed_line(c.id, ", ".join(json.dumps(v) for v in c.expected)) for c in checks]
    junk = [
        _observed_line(True, "1"), _observed_line("0", "1"), _observed_line(10**400, "1"),
        f'{RESULT_PREFIX}{{"id": 0, "trace": 5}}', f"{RESULT_PREFIX}[1, 2]", f"{RESULT_PREFIX}" + "[" * 70000,
        f'{RESULT_PREFIX}{{"id": 0, "trace": {"[" * 100 + "]" * 100}}}', "\ud800", "\x00" * 100,
    ]  # fmt: skip
    results, _, other = decide(checks, "\n".join(junk + right + [_observed_line(0, '"forged"')]))
    assert all(results.values()), results
    assert "\ud800" in other
    found, _ = parse_observations(b"\xff\n" + "\n".join(right).encode(), {c.id for c in checks})
    assert set(found) == {c.id for c in checks}
    assert parse_observations(None, {0}) == ({}, [])  # type: ignore[arg-type]


@given(
    lines=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 12), json_values).map(
                lambda p: _observed_line(p[0], json.dumps(p[1], allow_nan=True))
            ),
            st.tuples(st.integers(0, 12), st.sampled_from(list(HOSTILE_JSON_LITERALS.values()))).map(
                lambda p: _observed_line(*p)
            ),
            hostile_texts,
        ),
        max_size=30,
    ),
    template=st.sampled_from(["stats", "text", "intervals", "bank", "search", "roman"]),
)
@FUZZ
def test_decide_fuzz(checks_by_template, lines, template):
    """Generated sandbox outputs (result lines of hostile values, junk lines): `decide` gives a bool per
    test and a reason for each failed one, in bounded time."""
    checks = checks_by_template[template]
    results, why, _ = timed(lambda: decide(checks, "\n".join(lines)))
    assert set(results) == {c.test for c in checks} and all(type(v) is bool for v in results.values())
    assert {t for t, ok in results.items() if not ok} == set(why)


# ------------------------------------------------------------------------ answer verifiers (text)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(HOSTILE_TEXTS))
def test_final_answer_and_exact_match_are_linear_and_total(kind):
    """`final_answer` (and exact-match on it) answers within the bound on texts that make a naive scan
    quadratic: 20,000 unclosed `\\boxed{` or `<answer>` tags took minutes."""
    text = HOSTILE_TEXTS[kind]
    assert isinstance(timed(lambda: final_answer(text)), str)
    result = timed(lambda: asyncio.run(ExactMatch().averify(text, "5")))
    assert isinstance(result, VerifierResult) and result.score == 0.0


def test_exact_match_wrong_types_score_zero():
    for value in HOSTILE_VALUES.values():
        assert asyncio.run(ExactMatch().averify(value, "5")).score == 0.0
    assert asyncio.run(ExactMatch().averify("\\boxed{5}", "5")).score == 1.0


@given(text=hostile_texts)
@FUZZ
def test_final_answer_fuzz(text):
    """Against the old definition (kept here as the reference, on texts small enough for it)."""
    import re

    def reference(t: str) -> str:
        for start in reversed([m.end() for m in re.finditer(r"\\boxed\s*\{", t)]):
            depth = 1
            for i in range(start, len(t)):
                depth += {"{": 1, "}": -1}.get(t[i], 0)
                if depth == 0:
                    return t[start:i].strip()
        tags = re.findall(r"<answer>(.*?)</answer>", t, re.S)
        return tags[-1].strip() if tags else t.strip()

    got = timed(lambda: final_answer(text))
    if len(text) < 5000:
        assert got == reference(text)


@pytest.fixture(scope="module")
def math_verify():
    from envs import child_process

    verifier = make_verifier("math-verify", timeout_s=10.0)
    verifier.op_timeout_s = 2
    yield verifier
    child_process.shutdown()


MATH_BOUND_S = 40.0  # the verifier's wall-clock limit (10 s), a child's start and a re-check, on 2 cores


@pytest.mark.timeout(900)
def test_math_verify_is_total_on_hostile_answers(math_verify):
    """Every hostile text and every wrong-typed answer gets a score in [0, 1] (0 here), within the
    verifier's timeout; the right answer still scores 1."""
    for kind, text in HOSTILE_TEXTS.items():
        result = timed(lambda: asyncio.run(math_verify.averify(text, "5")), MATH_BOUND_S)  # noqa: B023
        assert result.score == 0.0, (kind, result)
    for value in (10**400, None, b"5", ["5"], Hostile(), math.nan):
        assert asyncio.run(math_verify.averify(value, "5")).score == 0.0
    assert asyncio.run(math_verify.averify("\\boxed{5}", "5")).score == 1.0


@given(text=hostile_texts)
@FUZZ_FEW
def test_math_verify_fuzz(math_verify, text):
    result = timed(lambda: asyncio.run(math_verify.averify(text, "1/2")), MATH_BOUND_S)
    assert 0.0 <= result.score <= 1.0


# --------------------------------------------------------------------------------- text envs (adapters)
def _one_turn(env: envs.ToolEnv, text: str, bound_s: float) -> tuple:
    obs, reward, terminated, truncated, info = timed(lambda: env.step(text), bound_s)
    pickle.dumps(info)
    json.dumps(info)
    return obs, reward, terminated, truncated, info


@pytest.mark.timeout(900)
@pytest.mark.parametrize("verifier", ["exact-match", "math-verify"])
def test_dataset_qa_scores_every_hostile_answer(verifier, math_verify):
    """dataset-qa with each built-in verifier: every hostile answer ends the episode with reward 0."""
    env = envs.make("dataset-qa", verifier=verifier, verifier_timeout_s=10.0)
    for kind, text in HOSTILE_TEXTS.items():
        env.reset(options={"row": {"prompt": "What is 2+3?", "answer": "5"}})
        _, reward, terminated, _, info = _one_turn(env, text, MATH_BOUND_S)
        assert terminated and reward == 0.0 and info["success"] == 0.0, (kind, info)
    env.close()


@pytest.mark.timeout(900)
def test_reasoning_gym_scores_every_hostile_answer():
    """reasoning-gym/chain_sum: every hostile answer is scored (0) within the bound; the answer extraction
    is reasoning-gym's, without its quadratic regex."""
    env = envs.make("reasoning-gym/chain_sum", config={"min_terms": 2, "max_terms": 3}, score_timeout_s=10.0)
    for kind, text in HOSTILE_TEXTS.items():
        env.reset(seed=3)
        _, reward, terminated, _, info = _one_turn(env, text, MATH_BOUND_S)
        assert terminated and reward == 0.0, (kind, info)
    env.reset(seed=3)
    assert env.step(f"<answer>{env.task.entry['answer']}</answer>")[1] == 1.0
    env.close()
    from reasoning_gym.utils import extract_answer as theirs

    from envs.adapters.reasoning_gym import extract_answer

    samples = ("<answer> 5 </answer>", "a<answer>1</answer><answer>\n2\n</answer>", "<answer>x", "", "</a>")
    for text in samples:
        assert extract_answer(text) == theirs(text)


def test_reasoning_gym_scorer_failure_is_the_answers_when_the_entry_scores(monkeypatch):
    """A score_answer that raises on the model's answer, while the entry's own answer scores: a failed
    check (0, info["score_failed"]). One that fails on the entry's answer too: the env's error, raised."""
    from envs.adapters.reasoning_gym import ReasoningGymEnv

    calls: list[Any] = []

    async def fragile(self, answer):
        calls.append(answer)
        if answer == "boom" or answer == "always":
            raise ValueError("scorer choked")
        if self.task.entry.get("answer") == "always":
            raise ValueError("scorer choked on its own entry")
        return 1.0, False

    monkeypatch.setattr(ReasoningGymEnv, "_score", fragile)
    env = envs.make("reasoning-gym/chain_sum")
    env.reset(seed=1)
    _, reward, terminated, _, info = env.step("<answer>boom</answer>")
    assert (reward, terminated) == (0.0, True) and "scorer choked" in info["score_failed"]
    assert calls == ["boom", env.task.entry["answer"]]
    env.reset(seed=1)
    object.__setattr__(env.task, "entry", {**env.task.entry, "answer": "always"})
    with pytest.raises(ValueError, match="scorer choked"):
        env.step("<answer>always</answer>")


@pytest.mark.parametrize("env_id, row", [
    ("skyrl/gsm8k", {"reward_spec": {"ground_truth": "5"}}),
    ("skyrl/aime", {"reward_model": {"ground_truth": "5"}}),
])  # fmt: skip
def test_skyrl_envs_score_every_hostile_answer(env_id, row):
    """SkyRL-gym's gsm8k and aime scorers (foreign code, run by the adapter): every hostile answer is a
    scored, terminated step, within the bound."""
    env = envs.make(env_id)
    prompt = [{"role": "user", "content": "2+3?"}]
    for kind, text in HOSTILE_TEXTS.items():
        env.reset(options={"row": {"prompt": prompt, **row}})
        _, reward, terminated, _, info = _one_turn(env, text, IN_PROCESS_S)
        assert terminated and reward <= 0.0, (kind, reward, info)
    env.close()


def test_agent_env_scores_results_str_cannot_show():
    """The agent env's score of an agent result: one `str()` cannot show (an integer beyond 4300 digits,
    an object whose __str__ raises) scores 0; a right one still scores 1."""
    env = envs.make("agent", agent=lambda client, task: None, verifier="exact-match")
    env.reset(options={"row": {"prompt": "2+3?", "answer": "5"}})
    for value in (10**5000, Hostile(), *HOSTILE_VALUES.values()):
        assert asyncio.run(env.score(value)) == 0.0
    assert asyncio.run(env.score(5)) == 1.0


# ------------------------------------------------------------------------ tool calls and step infos
def _hostile_call(name: str, literal: str) -> str:
    return '<tool_call>{"name": "' + name + '", "arguments": {"value": ' + literal + "}}</tool_call>"


tool_turns = st.one_of(
    hostile_texts,
    st.tuples(
        st.sampled_from(["answer", "calc", "grep", "read_doc", "look", "nope"]),
        st.one_of(
            st.sampled_from(list(HOSTILE_JSON_LITERALS.values())),
            st.integers(0, 3000).map(lambda d: "[" * d + "]" * d),
            json_values.map(lambda v: json.dumps(v, allow_nan=True)),
        ),
    ).map(lambda p: _hostile_call(*p)),
)


@pytest.fixture(scope="module")
def tool_envs() -> dict[str, envs.ToolEnv]:
    made = {
        env_id: envs.make(env_id, difficulty=0, use_sandbox=False, max_turns=10_000)
        for env_id in ("arith", "long-docs", "vision-arith")
    }
    yield made
    for env in made.values():
        env.close()


@given(turn=tool_turns, env_id=st.sampled_from(["arith", "long-docs", "vision-arith"]))
@settings(FUZZ, max_examples=80)
def test_tool_env_steps_are_total_and_their_infos_travel(tool_envs, turn, env_id):
    """A hostile turn (tool-call texts holding hostile JSON, deep nesting, junk) in arith, long-docs and
    vision-arith (their `answer` is the verifier): a step comes back in bounded time, and its info pickles
    (what Ray does to it) and serialises (what the store does), nested no deeper than the bound."""
    env = tool_envs[env_id]
    if env.task is None or env._over:
        env.reset(seed=5)
    *_, info = _one_turn(env, turn, 60.0)
    from envs.base import MAX_INFO_DEPTH
    from envs.tool_call import value_depth

    assert value_depth(info, 10 * MAX_INFO_DEPTH) <= MAX_INFO_DEPTH + 1


@pytest.mark.parametrize("depth", [63, 64, 600, 975, 100_000])
def test_tool_call_depth_is_bounded_where_it_is_parsed(depth):
    """The parser refuses a block nested deeper than MAX_JSON_DEPTH with an agent error naming the bound
    (a depth Python would parse, 975, included), and accepts one at the bound."""
    from envs.tool_call import MAX_JSON_DEPTH, value_depth

    nested = "[" * depth + "]" * depth
    text = '<tool_call>{"name": "f", "arguments": {"x": ' + nested + "}}</tool_call>"
    [item] = timed(lambda: parse_tool_calls(text))
    if depth + 2 <= MAX_JSON_DEPTH:
        assert isinstance(item, ToolCall) and value_depth(item.arguments) == depth + 1
    else:
        assert isinstance(item, ToolCallError) and item.kind == "malformed_json", item
        assert f"more than {MAX_JSON_DEPTH} levels" in item.message and len(item.message) < 600


@given(value=json_values)
@FUZZ
def test_text_depth_matches_the_parsed_depth(value):
    """`text_depth` (the pre-parse bound) agrees with the depth of the parsed value for any JSON text."""
    from envs.tool_call import text_depth, value_depth

    assert text_depth(json.dumps(value, allow_nan=True)) == value_depth(value, 1000)


def test_depth_checks_are_linear_and_total():
    from envs.tool_call import text_depth, value_depth

    for text in ('\\"' * 500_000, '"' + "[" * 500_000, "{" * 1_000_000, "\ud800" * 100_000, ""):
        assert timed(lambda: text_depth(text), 2.0) >= 0  # noqa: B023
    for value in HOSTILE_VALUES.values():
        assert 0 <= timed(lambda: value_depth(value)) <= 65  # noqa: B023


def test_step_info_depth_is_bounded_for_any_env():
    """A text env whose reply puts a value 1000 levels deep in its info (say, model text it parsed): the
    step's info carries a marker instead, so it pickles (Ray) and serialises (the store)."""
    from envs.text_env import TextEnv, TextReply

    class DeepInfo(TextEnv):
        def generate_task(self, seed, options):
            return type("T", (), {"task_id": "deep", "prompt": "say"})()

        async def respond(self, text):
            return TextReply([], 0.0, done=True, info={"parsed": nested_list(1000), "ok": [1]})

    env = DeepInfo()
    env.reset(seed=0)
    *_, info = _one_turn(env, "anything", IN_PROCESS_S)
    from envs.base import MAX_INFO_DEPTH, bound_info_depth

    assert info["parsed"].startswith(f"<nested deeper than {MAX_INFO_DEPTH} levels") and info["ok"] == [1]
    calls = [{"name": "f", "arguments": nested_dict(500)}, {"name": "g", "arguments": {"x": 1}}]
    bounded = bound_info_depth({"tool_calls": calls, "turn": 1})
    assert bounded["tool_calls"][0]["arguments"]["dropped"] and bounded["tool_calls"][1] == calls[1]
    pickle.dumps(bounded)


def test_math_verify_child_dying_on_the_answer_is_a_failed_check(monkeypatch):
    """A math-verify child that dies on the answer while the ground truth checked against itself runs: the
    answer killed it, a failed check (0, `failed` says why). Dying on the truth too: VerifierError."""
    from envs.child_process import ChildProcessDied
    from envs.verifiers import MathVerify, VerifierError

    deadly = {"\\boxed{crash}"}

    async def call(self, answer, truth):
        if answer in deadly:
            raise ChildProcessDied("the scoring child process died (exit code -9)")
        return True, False

    monkeypatch.setattr(MathVerify, "_call", call)
    result = asyncio.run(MathVerify().averify("\\boxed{crash}", "5"))
    assert result.score == 0.0 and "died on this answer" in result.failed
    deadly.add("5")
    with pytest.raises(VerifierError, match="exit code -9"):
        asyncio.run(MathVerify().averify("\\boxed{crash}", "5"))


@given(text=hostile_texts)
@FUZZ
def test_reasoning_gym_extract_answer_matches_theirs(text):
    """The linear `extract_answer` gives what reasoning-gym's regex gives (on texts small enough for it)."""
    from reasoning_gym.utils import extract_answer as theirs

    from envs.adapters.reasoning_gym import extract_answer

    got = timed(lambda: extract_answer(text))
    if len(text) < 5000:
        assert got == theirs(text)


# ------------------------------------------ math-verify: a numeric truth needs a number, not an expression
RESTATED = ["25 * 2", "\\boxed{25 \\times 2}", "\\boxed{2*25}", "\\boxed{49+1}", "\\boxed{7^2+1}",
            "\\boxed{5\\cdot 10}", "\\boxed{100/2}", "\\boxed{\\frac{100}{2}}", "\\boxed{-(-50)}",
            "\\boxed{\\sqrt{2500}}", "50 = 25*2", "\\boxed{50\\%}", "\\boxed{(50)}",
            "$25 \\cdot 2$"]  # fmt: skip
STATED = ["\\boxed{50}", "The answer is 50.", "$50$", "25*2=50", "\\boxed{50.0}", "so \\boxed{ 50 }"]


def test_math_verify_refuses_expressions_of_a_numeric_truth(math_verify):
    """Math-Verify alone scores every RESTATED text 1.0 for 50 (SymPy evaluates it); GRPO on SmolLM2 learned
    to answer "What is 25 times 2?" with "25 * 2". A numeric truth now needs the number written as one."""
    score = lambda text, truth: asyncio.run(math_verify.averify(text, truth)).score  # noqa: E731
    assert [t for t in RESTATED if score(t, "50") != 0.0] == []
    assert [t for t in STATED if score(t, "50") != 1.0] == []
    hedged = ["\\boxed{49, 50, 51}", "\\boxed{\\{49,50\\}}", "\\boxed{50 \\pm 1}", "\\boxed{[49, 51]}",
              "\\boxed{49 < x < 51}", "\\boxed{50 \\text{ or } 51}", "\\boxed{50}\\boxed{51}", "49 50 51"]
    assert [t for t in hedged if score(t, "50") != 0.0] == []  # several candidates: none is the answer
    # digits apart: Math-Verify reads "5 0" as 5 * 0 and "1 2" as 3; "5 times 0?" -> "5 0" is a restatement
    assert score("\\boxed{5 0}", "0") == score("\\boxed{5\\,0}", "0") == score("\\boxed{1 2}", "3") == 0.0
    assert score("\\boxed{0.5}", "\\frac{1}{2}") == score("\\boxed{1/2}", "0.5") == 1.0
    assert score("\\boxed{\\frac{2}{4}}", "0.5") == score("\\boxed{1-0.5}", "0.5") == 0.0
    assert score("\\boxed{-7}", "-7") == score("\\boxed{1,234}", "1234") == 1.0
    assert score("\\boxed{50\\%}", "50\\%") == 1.0  # a percent truth takes a percent answer
    # a symbolic truth keeps Math-Verify's equivalence: the answer is an expression by nature
    assert score("\\boxed{1 + x^2}", "$x^2+1$") == 1.0
    assert score("\\boxed{\\frac{\\sqrt{2}}{2}}", "$\\frac{1}{\\sqrt{2}}$") == 1.0


@given(a=st.integers(2, 999), b=st.integers(2, 999), op=st.sampled_from(["+", "-", "*", "\\times", "\\cdot"]),
       form=st.sampled_from(["{a} {op} {b}", "\\boxed{{{a}{op}{b}}}", "answer: ${a} {op} {b}$"]))  # fmt: skip
@FUZZ_FEW
def test_math_verify_fuzz_restated_arithmetic_never_scores(math_verify, a, b, op, form):
    """A question "a op b" answered by writing it out (in several syntaxes) scores 0 against its value; the
    value written as a number scores 1."""
    value = str({"+": a + b, "-": a - b}.get(op, a * b))
    text = form.format(a=a, b=b, op=op)
    assert asyncio.run(math_verify.averify(text, value)).score == 0.0, (text, value)
    assert asyncio.run(math_verify.averify(f"\\boxed{{{value}}}", value)).score == 1.0, value
