"""bench/trl_tools_race.py: its helpers against obviously correct references (the calculator against the very
script our Docker sandbox runs, executed by python3 as the sandbox does; exact strings and integers; ratios to
1e-12), TRL's acceptance of the derived checkpoint's template, equal prompt ids on both sides, and (slow) a
TRL-only smoke run of the bench on a tiny random model with SmolLM2's tokenizer."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
from pathlib import Path

import pytest

from bench import trl_tools_race as race
from envs.sandbox_scripts import script_source

ROOT = Path(__file__).resolve().parents[1]
ALIAS = "smollm2-135m-instruct"
ENV_KWARGS = {"difficulty": 0, "tools_in_prompt": False}


# ---- derived checkpoint -----------------------------------------------------------------------------------


def _fake_checkpoint(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text('{"v": 1}')
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "OLD", "eos_token": "<|im_end|>"}))
    (d / "chat_template.jinja").write_text("OLD")
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    return d


def test_derive_checkpoint_links_weights_and_replaces_the_template(tmp_path):
    src = _fake_checkpoint(tmp_path / "src")
    dst = race.derive_checkpoint(src, tmp_path / "dst", "NEW {{ messages }}")
    assert (dst / "model.safetensors").is_symlink()
    assert (dst / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert (dst / "chat_template.jinja").read_text() == "NEW {{ messages }}"
    assert json.loads((dst / "tokenizer_config.json").read_text()) == {"eos_token": "<|im_end|>"}
    assert (dst / "tokenizer.json").read_text() == '{"v": 1}' and not (dst / "tokenizer.json").is_symlink()
    assert (src / "chat_template.jinja").read_text() == "OLD"  # the source is untouched
    race.derive_checkpoint(src, dst, "AGAIN")  # replaces an earlier derivation
    assert (dst / "chat_template.jinja").read_text() == "AGAIN"


def test_derive_checkpoint_refuses_a_directory_without_a_tokenizer(tmp_path):
    src = _fake_checkpoint(tmp_path / "src")
    (src / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        race.derive_checkpoint(src, tmp_path / "dst", "T")


# ---- budgets, shapes, comparison --------------------------------------------------------------------------


def test_trl_budgets_map_turns_and_tokens():
    assert race.trl_budgets(128, 4, 2048, 682) == {
        "max_new_tokens": 128, "max_tool_calling_iterations": 3, "max_completion_length": 2048 - 682,
    }  # fmt: skip
    assert race.trl_budgets(8, 1, 100, 99)["max_tool_calling_iterations"] == 0  # one turn: no post-tool turn
    with pytest.raises(ValueError, match="no room for a completion"):
        race.trl_budgets(128, 4, 682, 682)
    with pytest.raises(ValueError, match="must be >= 1"):
        race.trl_budgets(128, 0, 2048, 10)


def test_episode_shape_counts_turns_and_tool_results():
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
        {"role": "tool", "name": "calc", "content": "14"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
        {"role": "tool", "name": "answer", "content": "correct"},
        {"role": "assistant", "content": "done"},
    ]
    assert race.episode_shape(completion) == {"turns": 3, "tool_results": 2}
    assert race.episode_shape([]) == {"turns": 0, "tool_results": 0}


def test_compare_divides_each_rate_and_checks_the_target():
    ours = {"tokens_all_per_s": 30.0, "tokens_all_per_s_steps_2_to_n": 45.0, "tokens_trained_per_s": 15.0,
            "tokens_trained_per_s_steps_2_to_n": None}  # fmt: skip
    trl = {"tokens_all_per_s": 20.0, "tokens_all_per_s_steps_2_to_n": 20.0, "tokens_trained_per_s": 10.0,
           "tokens_trained_per_s_steps_2_to_n": 9.0}  # fmt: skip
    out = race.compare(ours, trl)
    assert out["ratio_ours_over_trl_tokens_all_per_s"] == pytest.approx(1.5, rel=1e-12)
    assert out["ratio_ours_over_trl_tokens_all_per_s_steps_2_to_n"] == pytest.approx(2.25, rel=1e-12)
    assert out["ratio_ours_over_trl_tokens_trained_per_s_steps_2_to_n"] is None
    assert out["ratio_conservative"] == pytest.approx(15.0 / 20.0, rel=1e-12)  # our trained / TRL's all
    assert out["target_met"]["ratio_ours_over_trl_tokens_all_per_s"] is True  # 1.5 >= 1.5
    assert out["target_met"]["ratio_conservative"] is False
    assert "ratio_ours_over_trl_tokens_trained_per_s_steps_2_to_n" not in out["target_met"]


# ---- the tools TRL calls ----------------------------------------------------------------------------------


def test_schema_tool_is_its_schema_and_calls_with_keywords():
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    seen = []
    tool = race.SchemaTool(schema, lambda args: seen.append(args) or "ok")
    assert isinstance(tool, dict) and dict(tool) == schema and tool.__name__ == "calc"
    assert tool(expression="1+2") == "ok" and seen == [{"expression": "1+2"}]
    schema["function"]["name"] = "changed"
    assert tool["function"]["name"] == "calc"  # a copy
    twin = race.SchemaTool(tool, lambda args: "")
    assert twin != tool and tool in [tool] and twin not in [tool]  # TRL's `in` dedup: one per object


def _sandbox_calc(expression: str) -> str:
    """The sandbox's calc: `python3 -c <calc script>` with the expression on stdin (envs/arith.py), its
    stdout stripped; exit 1 -> "error: <message>" as the env reports it."""
    res = subprocess.run(["python3", "-c", script_source("calc")], input=expression.encode(),
                         capture_output=True, timeout=30, check=False)  # fmt: skip
    text = res.stdout.decode().strip()
    return text if res.returncode == 0 else "error: " + text.removeprefix("error: ")


def _task(seed: int = 0):
    from rl.rollout.tasks import Task

    return Task("train", 0, seed, ())


def test_calc_returns_what_the_sandbox_script_prints():
    tools = race.EnvTools("arith", ENV_KWARGS)
    tools.reset(_task())
    try:
        for expression in ["2+3", "(3+4)*2", "7/2", "9-15", "2**10", "7//2", "7%3", "1/0", "2+", "x+1",
                           "__import__('os')", "2**100", "   4 * 5  ", "1e3"]:  # fmt: skip
            assert tools.call("calc", {"expression": expression}) == _sandbox_calc(expression), expression
        # argument problems are checked by our tool schema before any evaluation, with our error text
        bad = tools.call("calc", {"expr": "1+1"})
        assert bad.startswith("error: ") and "expression" in bad
        assert tools.outcome == 0.0 and not tools.over  # calc never ends the episode
    finally:
        tools.close()


def test_answer_scores_the_first_call_and_ends_the_episode():
    tools = race.EnvTools("arith", ENV_KWARGS)
    try:
        tools.reset(_task(3))
        want = tools.env.task.answer
        assert tools.call("answer", {"value": want + 1}) == "incorrect"
        assert (tools.outcome, tools.over) == (0.0, True)
        assert tools.call("answer", {"value": want}) == race.EnvTools.OVER  # only the first answer counts
        assert tools.outcome == 0.0
        tools.reset(_task(3))
        assert (tools.outcome, tools.over) == (0.0, False)
        assert tools.call("answer", {"value": int(want) if float(want).is_integer() else want}) == "correct"
        assert (tools.outcome, tools.over) == (1.0, True)
        assert tools.call("calc", {"expression": "1+1"}) == race.EnvTools.OVER
    finally:
        tools.close()


def test_arith_episode_offers_answer_as_trl_discovers_tools():
    import envs

    schemas = {s["function"]["name"]: s for s in envs.make("arith", **ENV_KWARGS).tool_schemas()}
    ep = race.ArithEpisode([_task(5), _task(6)], "arith", ENV_KWARGS, schemas)
    try:
        # TRL: public functions of the class, minus reset / get_reward, then read off the instance
        names = [n for n, _ in inspect.getmembers(type(ep), predicate=inspect.isfunction)
                 if n not in ("reset", "get_reward") and not n.startswith("_")]  # fmt: skip
        assert names == ["answer"]
        tool = ep.answer  # TRL reads it off the instance: getattr(environment, name)
        assert isinstance(tool, race.SchemaTool) and dict(tool) == schemas["answer"]
        assert ep.reset(task_index=1, prompt=[{"role": "user", "content": "x"}]) is None
        assert ep._env.env.task.task_id == envs.make("arith", **ENV_KWARGS).generate_task(6, {}).task_id
        assert tool(value=ep._env.env.task.answer) == "correct" and ep.outcome == 1.0
    finally:
        ep._env.close()


# ---- the derived SmolLM2 checkpoint -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    from trl.chat_template_utils import qwen2_5_chat_template

    from model.embedded import checkpoint_dir

    try:
        src = checkpoint_dir(ALIAS)
    except ValueError as e:
        pytest.skip(f"the embedded SmolLM2 is not installed ({e})")
    if not (src / "config.json").is_file():
        pytest.skip(f"SmolLM2 is not converted yet ({src}); run `python -m model.embedded ensure`")
    return src, race.derive_checkpoint(src, tmp_path_factory.mktemp("ckpt") / "d", qwen2_5_chat_template)


def test_trl_refuses_smollm2s_template_and_accepts_the_derived_one(derived):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import (
        add_response_schema,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    src, dst = derived
    own = AutoTokenizer.from_pretrained(src, local_files_only=True)
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(own)
    tok = AutoTokenizer.from_pretrained(dst, local_files_only=True)
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    add_response_schema(tok)
    assert tok.eos_token == "<|im_end|>"


def test_trl_renders_our_prompt_ids_and_parses_our_call_format(derived, tmp_path):
    from trl.chat_template_utils import add_response_schema, parse_response

    from model.tokenizer import policy_tokenizer

    _, dst = derived
    cfg = race.race_config(str(dst), 2, None, 0, tmp_path / "run", [])
    race.check_race(cfg)
    tok = copy.deepcopy(policy_tokenizer(str(dst)))
    tasks, rows, schemas, equal = race.trl_prompts(cfg, tok, 3)
    assert equal == 3 and len(rows) == 3 and list(schemas) == ["calc", "answer"]
    assert [r["task_index"] for r in rows] == [0, 1, 2]
    assert rows[0]["prompt"][0]["role"] == "system" and rows[0]["prompt"][-1]["role"] == "user"
    # the demonstrations' call format (no newlines inside the tags), as SmolLM2 copies it
    add_response_schema(tok)
    prefix = tok.apply_chat_template(rows[0]["prompt"], tools=list(schemas.values()),
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "8+6"}}</tool_call><|im_end|>'
    parsed = parse_response(tok, tok(text, add_special_tokens=False)["input_ids"], prefix=list(prefix),
                            tools=list(schemas.values()))  # fmt: skip
    calls = parsed.get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["calc"]
    assert calls[0]["function"]["arguments"] == {"expression": "8+6"}


@pytest.mark.slow
def test_smoke_run_trains_trl_with_the_tool_loop(derived, tmp_path):
    """The --smoke run, through `train_trl_in_child` (how a TRL-first race runs its TRL side: the bench again
    in a child process): the child's results file and the record handed back."""
    out = tmp_path / "results.json"
    argv = ["--smoke", "--out", str(tmp_path / "o"), "--trl-threads", "1"]
    trl = race.train_trl_in_child(Path(race.__file__), argv, out)
    r = json.loads(out.read_text())
    assert r["smoke"] is True and r["odyssey"] is None and r["trl"]["tiny_random_model"] is True
    assert trl == r["trl"]
    assert trl["prompt_ids_equal"] == trl["prompts"] == 2  # 1 task a step (8 episodes = 1 group), 2 steps
    assert [s["step"] for s in trl["steps"]] == [1, 2]
    for s in trl["steps"]:
        assert s["tokens_all"] >= 8 * (min(trl["prompt_tokens"]) + 1)
        assert s["tool_result_tokens"] >= 0 and s["turns_mean"] >= 1
    assert r["summary"]["trl"]["tokens_all_per_s"] > 0


def test_trls_own_tool_loop_plays_our_tools_into_the_reward(derived, tmp_path):
    """TRL's generation + tool loop (`_generate_and_score_completions`) with its model's generate replaced by
    a script: calc the task's expression, answer its value, then plain text. TRL parses each call with its
    response template, runs our tools, appends their results with the template's markup (ids equal to our
    rollout's continuation of the same tool message), and the reward is our outcome."""
    from model.tokenizer import policy_tokenizer
    from rl.rollout.agent_loop import ChatCodec

    _, dst = derived
    tiny = race.tiny_checkpoint(dst, tmp_path / "tiny")
    cfg = race.race_config(str(dst), 2, 8, 0, tmp_path / "run", [])
    run = race.make_trl_trainer(cfg, tiny, 2, tmp_path / "trl", 4)
    try:
        trainer, reward = run["trainer"], run["reward"]
        probe = race.EnvTools("arith", cfg.env.kwargs)
        probe.reset(run["tasks"][0])
        task = probe.env.task
        probe.close()
        from envs.tool_call import format_tool_call

        codec = ChatCodec(policy_tokenizer(str(dst)))
        turns = [format_tool_call("calc", {"expression": task.expression}),
                 format_tool_call("answer", {"value": task.answer}), "Done."]  # fmt: skip
        turn_ids = [codec.turn_ids(t) + [codec.eot_id] for t in turns]
        generated: list[int] = []

        def scripted(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            generated.append(len(prompt_ids))
            return [list(turn_ids[len(generated) - 1]) for _ in prompt_ids], None

        trainer._generate_single_turn = scripted
        trainer._generate_and_score_completions([{"prompt": run["rows"][0]["prompt"], "task_index": 0}] * 8)
        call = reward.calls[-1]
        assert generated == [8, 8, 8]  # no terminal tool in TRL: a third turn after answer's result
        assert call["rewards"] == [1.0] * 8 and call["turns"] == [3] * 8 and call["tool_results"] == [2] * 8
        value = task.answer if not float(task.answer).is_integer() else int(task.answer)
        results = [str(value), "correct"]
        want = (turn_ids[0] + codec.continuation([{"role": "tool", "content": results[0]}]) + turn_ids[1]
                + codec.continuation([{"role": "tool", "content": results[1]}]) + turn_ids[2])  # fmt: skip
        assert call["completion_tokens"] == [len(want)] * 8
        assert call["tokens"] == [run["rows"][0]["prompt_tokens"] + len(want)] * 8
    finally:
        race.close_trl(run)
