"""Text envs: dataset-qa with its verifiers, the reasoning-gym and SkyRL-gym adapters (real packages, nothing
downloaded), namespaced ids in the registry, and the child process that scoring runs in (hostile answers
that hang a verifier are cut off and scored 0; a verifier's own bug is an infra error, never a 0)."""

from __future__ import annotations

import asyncio
import time

import pytest

import envs
from envs import child_process
from envs.dataset import DatasetRow
from envs.registry import EnvLoadError, EnvNotFoundError, entry_for
from envs.verifiers import ExactMatch, VerifierError, final_answer, make_verifier
from tests import custom_verifiers


def qa(answer: str = "5", prompt: str = "What is 2+3?", **kwargs) -> envs.ToolEnv:
    env = envs.make("dataset-qa", **kwargs)
    env.reset(seed=0, options={"row": DatasetRow(7, {"prompt": prompt, "answer": answer})})
    return env


# ---- verifiers ------------------------------------------------------------------------------------------


def test_final_answer_extraction():
    assert final_answer("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert final_answer("<answer> 42 </answer> then <answer>43</answer>") == "43"
    assert final_answer("  just 7 \n") == "just 7"
    assert final_answer("\\boxed{unclosed") == "\\boxed{unclosed"


def test_math_verify_accepts_equivalent_forms_in_a_child_process():
    v = make_verifier("math-verify")
    score = lambda text, truth: asyncio.run(v.averify(text, truth)).score  # noqa: E731
    assert score("The answer is \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert score("so it is 0.5", "\\frac{1}{2}") == 1.0
    assert score("\\boxed{3}", "0.5") == 0.0
    assert score("no answer here", "7") == 0.0


def test_a_hostile_answer_that_hangs_the_verifier_scores_zero_and_is_cut_off():
    """9^(9^(9^9)) makes sympy compute for minutes; the child is killed at the wall-clock limit, the answer
    scores 0.0 (the policy's doing, never an infra error) and the next call gets a fresh child."""
    v = make_verifier("math-verify", timeout_s=2.0)
    t0 = time.monotonic()
    res = asyncio.run(v.averify("\\boxed{9^{9^{9^{9}}}}", "2"))
    assert res.timed_out and res.score == 0.0 and time.monotonic() - t0 < 10
    assert asyncio.run(v.averify("\\boxed{2}", "2")).score == 1.0  # a fresh child answers


def test_custom_verifiers_sync_async_and_their_failures():
    row = {"prompt": "p", "answer": "abc"}
    same = make_verifier("tests.custom_verifiers:same_length")
    assert asyncio.run(same.averify("xyz", "abc", row)).score == 1.0
    assert (
        asyncio.run(make_verifier("tests.custom_verifiers:async_contains").averify("xabcx", "abc")).score
        == 1.0
    )
    with pytest.raises(VerifierError, match="raised KeyError"):
        asyncio.run(make_verifier("tests.custom_verifiers:broken").averify("a", "b"))
    with pytest.raises(VerifierError, match="returned 2.0; a verifier returns a bool or a number in"):
        asyncio.run(make_verifier("tests.custom_verifiers:out_of_range").averify("a", "b"))
    hung = make_verifier("tests.custom_verifiers:hangs", timeout_s=0.2)
    assert asyncio.run(hung.averify("a", "b")).timed_out
    with pytest.raises(ValueError, match=r"must take \(answer, ground_truth, row\)"):
        make_verifier("tests.custom_verifiers:wrong_arity")
    with pytest.raises(ValueError, match="unknown verifier 'exact_match'; did you mean 'exact-match'"):
        make_verifier("exact_match")
    assert isinstance(make_verifier("exact-match"), ExactMatch)


# ---- child process --------------------------------------------------------------------------------------


def test_child_process_returns_raises_and_kills():
    async def go():
        assert await child_process.call_in_child(custom_verifiers.add, 2, 3, timeout_s=30) == (5, False)
        with pytest.raises(ValueError, match="from the child"):
            await child_process.call_in_child(custom_verifiers.fail, "from the child", timeout_s=30)
        t0 = time.monotonic()
        assert await child_process.call_in_child(custom_verifiers.sleep_then, 60, 1, timeout_s=0.5) == (
            None,
            True,
        )
        assert time.monotonic() - t0 < 5
        # concurrent calls share the two children; a killed one is replaced
        results = await asyncio.gather(
            *(
                child_process.call_in_child(custom_verifiers.sleep_then, 0.2, i, timeout_s=30)
                for i in range(4)
            )
        )
        assert [r for r, _ in results] == [0, 1, 2, 3]

    asyncio.run(go())
    child_process.shutdown()


# ---- dataset-qa -----------------------------------------------------------------------------------------


def test_dataset_qa_single_turn_scores_the_first_answer():
    env = qa()
    messages = env.first_messages()
    assert messages[-1] == {"role": "user", "content": "What is 2+3?"} and "\\boxed" in messages[0]["content"]
    obs, reward, terminated, truncated, info = env.step("I think \\boxed{6}")
    assert (obs, reward, terminated, truncated, info["success"]) == ([], 0.0, True, False, 0.0)
    env = qa()
    assert env.step("\\boxed{5}")[1:4] == (1.0, True, False)
    assert env.task.task_id == "row-7" and env.tool_schemas() == []


def test_dataset_qa_multi_turn_gives_feedback_until_correct_or_the_last_try():
    env = qa(multi_turn=True, max_turns=3, feedback="Nope.")
    obs, reward, terminated, _, _ = env.step("\\boxed{4}")
    assert obs == [{"role": "user", "content": "Nope."}] and not terminated and reward == 0.0
    assert env.step("\\boxed{5}")[1:3] == (1.0, True)
    env = qa(multi_turn=True, max_turns=2)
    env.step("\\boxed{1}")
    obs, reward, terminated, truncated, info = env.step("\\boxed{2}")
    assert (obs, terminated, truncated, info["success"]) == ([], True, False, 0.0)  # the last try is scored


def test_dataset_qa_exact_match_conversational_rows_and_its_errors():
    env = envs.make("dataset-qa", verifier="exact-match", instructions="Say it.")
    msgs, _ = env.reset(options={"row": {"prompt": [{"role": "user", "content": "hi?"}], "answer": "yes"}})
    assert msgs == [{"role": "system", "content": "Say it."}, {"role": "user", "content": "hi?"}]
    assert env.step("<answer>yes</answer>")[1] == 1.0
    with pytest.raises(ValueError, match="dataset-qa takes its tasks from dataset rows"):
        envs.make("dataset-qa").reset(seed=0)
    with pytest.raises(Exception, match="has no ground truth in column 'answer'"):
        envs.make("dataset-qa").reset(options={"row": {"prompt": "q"}})
    env = envs.make("dataset-qa", verifier="tests.custom_verifiers:broken")
    env.reset(options={"row": {"prompt": "q", "answer": "1"}})
    with pytest.raises(VerifierError):  # the agent loop records this as the env's infra error, unscored
        env.step("1")


def test_dataset_qa_verifier_timeout_scores_zero_and_marks_the_step():
    env = qa(verifier="tests.custom_verifiers:hangs", verifier_timeout_s=0.2)
    _, reward, terminated, _, info = env.step("anything")
    assert (reward, terminated, info["verifier_timed_out"], info["success"]) == (0.0, True, True, 0.0)


# ---- reasoning-gym --------------------------------------------------------------------------------------


def test_reasoning_gym_env_scores_with_the_datasets_own_score_answer():
    env = envs.make("reasoning-gym/chain_sum", config={"min_terms": 2, "max_terms": 3})
    msgs, info = env.reset(seed=11)
    entry = env.task.entry
    assert msgs[1]["content"] == entry["question"] and info["env_id"] == "reasoning-gym/chain_sum"
    assert info["task_id"] == "reasoning-gym/chain_sum/11"
    assert env.step(f"thinking... <answer>{entry['answer']}</answer>")[1:3] == (1.0, True)
    again = envs.make("reasoning-gym/chain_sum", config={"min_terms": 2, "max_terms": 3})
    again.reset(seed=11)
    assert again.task.entry == entry  # deterministic from the seed
    assert again.step("no tags at all")[1] == 0.0
    rows = envs.make("reasoning-gym/chain_sum")
    rows.reset(options={"row": DatasetRow(3, {"prompt": "1 + 2 =", "answer": "3", "metadata": {}})})
    assert rows.task.task_id == "reasoning-gym/chain_sum/row-3" and rows.step("<answer>3</answer>")[1] == 1.0


def test_reasoning_gym_oracle_makes_warmup_transcripts():
    """`odyssey warmup` imitates env.oracle_actions(): the entry's answer in tags solves every task."""
    from model.tokenizer import load_tokenizer
    from rl.rollout.agent_loop import ChatCodec
    from rl.warmup import make_warmup_env, oracle_transcript

    codec = ChatCodec(load_tokenizer())
    kwargs = {"config": {"min_terms": 2, "max_terms": 3}, "max_turns": 1}
    for seed in range(3):
        t = oracle_transcript(make_warmup_env("reasoning-gym/chain_sum", kwargs), codec, seed)
        assert t.success == 1.0 and t.n_turns == 1 and t.loss_mask.sum() > 3


def test_reasoning_gym_bad_names_and_config():
    with pytest.raises(
        EnvNotFoundError, match="no reasoning-gym env 'chain_sm'. Did you mean 'reasoning-gym/chain_sum'"
    ):
        envs.make("reasoning-gym/chain_sm")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['max_term'\]"):
        envs.make("reasoning-gym/chain_sum", config={"max_term": 3})
    assert entry_for("reasoning-gym/basic_arithmetic").source == "adapter reasoning-gym"
    with pytest.raises(EnvNotFoundError, match="namespaces reasoning-gym/<name>, skyrl/<name>"):
        entry_for("reasoning-gymm/chain_sum")


# ---- SkyRL-gym ------------------------------------------------------------------------------------------


def test_skyrl_gsm8k_from_a_row():
    env = envs.make("skyrl/gsm8k")
    prompt = [{"role": "user", "content": "Ana has 2 apples and gets 3 more. How many? Answer after ####."}]
    msgs, info = env.reset(
        options={"row": DatasetRow(4, {"prompt": prompt, "reward_spec": {"ground_truth": "5"}})}
    )
    assert (
        msgs == prompt and info["task_id"] == "skyrl/gsm8k/row-4"
    )  # SkyRL's init(), no system message added
    obs, reward, terminated, _, info = env.step("2 + 3 = 5\n#### 5")
    assert (obs, reward, terminated, info["success"]) == ([], 1.0, True, 1.0)
    env.reset(options={"row": DatasetRow(4, {"prompt": prompt, "reward_spec": {"ground_truth": "5"}})})
    assert env.step("#### 6")[1] == 0.0
    env.close()


def test_skyrl_multi_turn_rewards_each_step():
    env = envs.make("skyrl/gsm8k_multi_turn", max_turns=5)
    row = {
        "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_spec": {"ground_truth": "2"},
        "max_turns": 3,
        "extra_info": {},
    }
    env.reset(options={"row": row})
    obs, reward, terminated, _, info = env.step("#### 3")  # well formatted, wrong: SkyRL's format score
    assert obs and obs[0]["role"] == "user" and not terminated and 0 < reward < 1
    assert info["env_reward"] == reward
    obs, reward, terminated, _, _ = env.step("#### 2")
    assert (reward, terminated) == (1.0, True)


def test_skyrl_needs_rows_and_names_its_envs():
    with pytest.raises(ValueError, match="skyrl/gsm8k takes its tasks from dataset rows"):
        envs.make("skyrl/gsm8k").reset(seed=0)
    with pytest.raises(EnvNotFoundError, match="no skyrl env 'gsm8'. Did you mean 'skyrl/gsm8k'"):
        envs.make("skyrl/gsm8")
    with pytest.raises(AssertionError, match="reward_spec field is required"):  # SkyRL's own check of the row
        envs.make("skyrl/gsm8k").reset(options={"row": {"prompt": [{"role": "user", "content": "q"}]}})


def test_an_adapter_without_its_package_is_a_load_error(monkeypatch):
    from envs import registry

    monkeypatch.setitem(
        registry.NAMESPACES, "nogym", ("odyssey_no_such_pkg.env:Env", "odyssey_no_such_pkg:names")
    )
    with pytest.raises(EnvLoadError, match="env 'nogym/x' is not available"):
        envs.make("nogym/x")
    (row,) = [e for e in registry.list_namespaces() if e.id == "nogym/<name>"]
    assert row.status == "broken" and "odyssey_no_such_pkg" in row.error
