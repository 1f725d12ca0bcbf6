"""The tool-call protocol and `@tool` schemas: every class of malformed call becomes a readable error
observation + info["tool_errors"], never an exception. Pure Python (no Docker)."""

from __future__ import annotations

import json
from typing import Literal, Optional

import pytest

from envs import ToolEnv, ToolError, tool
from envs.tool_call import EXPECTED_FORMAT, ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from envs.tools import ToolArgumentError, ToolDefinitionError, build_spec


class _Task:
    task_id = "echo/0"
    prompt = "say something"


class EchoEnv(ToolEnv):
    """A pure-Python env exercising every tool-call path."""

    env_id = "echo"
    default_max_turns = 3

    def generate_task(self, seed, options):
        return _Task()

    @tool
    def echo(self, text: str, times: int = 1) -> str:
        """Repeat a text.

        Args:
            text: what to repeat.
            times: how often.
        """
        return text * times

    @tool
    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    @tool
    def boom(self) -> str:
        """Always fails."""
        raise KeyError("kaboom")

    @tool
    def refuse(self) -> str:
        """Fails with an agent-facing message."""
        raise ToolError("not allowed here")

    @tool
    def done(self, ok: bool) -> str:
        """End the episode.

        Args:
            ok: whether it succeeded.
        """
        self.finish(1.0 if ok else 0.0)
        return "bye"


def _step(text: str):
    env = EchoEnv()
    env.reset(seed=0)
    return env.step(text)


# ---------------------------------------------------------------------------------------------- parsing
def test_parse_several_calls_with_text_around():
    text = (
        'Let me think.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then\n'
        + format_tool_call("b")
    )
    items = parse_tool_calls(text)
    assert items == [
        ToolCall("a", {"x": 1}, '{"name": "a", "arguments": {"x": 1}}'),
        ToolCall("b", {}, '{"name": "b", "arguments": {}}'),
    ]


def test_parse_no_call_is_empty():
    assert parse_tool_calls("just an answer: 42") == []


def test_arguments_may_be_omitted():
    (item,) = parse_tool_calls('<tool_call>{"name": "b"}</tool_call>')
    assert item == ToolCall("b", {}, '{"name": "b"}')


@pytest.mark.parametrize(
    "text, kind, needle",
    [
        ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', "malformed_json", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "not_an_object", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "bad_name", 'no "name" key'),
        ('<tool_call>{"name": 3}</tool_call>', "bad_name", '"name" = 3'),
        (
            '<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>',
            "bad_arguments",
            "must be a JSON object",
        ),
        ('<tool_call>{"name": "a", "args": {}}</tool_call>', "unexpected_keys", "['args']"),
        ('<tool_call>{"name": "a", "arguments": {}}', "unclosed_tag", "never closed"),
        ('{"name": "a"}</tool_call>', "stray_close_tag", "without a matching"),
    ],
)
def test_parse_errors(text, kind, needle):
    (item,) = parse_tool_calls(text)
    assert isinstance(item, ToolCallError)
    assert item.kind == kind
    assert needle in item.message
    assert EXPECTED_FORMAT in item.message


def test_nested_open_tag_reports_unclosed_then_parses_inner():
    items = parse_tool_calls('<tool_call>oops <tool_call>{"name": "a"}</tool_call>')
    assert isinstance(items[0], ToolCallError) and items[0].kind == "unclosed_tag"
    assert items[1] == ToolCall("a", {}, '{"name": "a"}')


# ---------------------------------------------------------------------------------------------- schemas
def test_schema_from_hints_and_docstring():
    def f(
        self,
        name: str,
        n: int,
        x: float,
        flag: bool,
        tags: list[str],
        mode: Literal["fast", "slow"] = "fast",
        limit: Optional[int] = None,  # noqa: UP045 - Optional must work too
        extra: dict[str, int] | None = None,
    ) -> str:
        """Do a thing.

        Longer description line.

        Args:
            name: the name,
                continued here.
            n: a count.
            x: a number.
            flag: a switch.
            tags: labels.
            mode: speed.
            limit: an optional cap.
            extra: more counts.

        Returns:
            something.
        """

    spec = build_spec(f)
    schema = spec.schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "f"
    assert fn["description"] == "Do a thing. Longer description line."
    props = fn["parameters"]["properties"]
    assert props["name"] == {"type": "string", "description": "the name, continued here."}
    assert props["n"] == {"type": "integer", "description": "a count."}
    assert props["x"]["type"] == "number"
    assert props["flag"]["type"] == "boolean"
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["mode"]["enum"] == ["fast", "slow"] and props["mode"]["default"] == "fast"
    assert props["limit"] == dict(type="integer", nullable=True, description="an optional cap.", default=None)
    assert props["extra"]["additionalProperties"] == {"type": "integer"} and props["extra"]["nullable"]
    assert fn["parameters"]["required"] == ["name", "n", "x", "flag", "tags"]
    assert fn["parameters"]["additionalProperties"] is False
    json.dumps(schema)  # serialisable for chat templates


def test_schema_is_transformers_get_json_schema_plus_defaults():
    """The schema the model sees is transformers' get_json_schema of the method; Odyssey only adds each
    optional parameter's default and additionalProperties: false (and normalises description spacing)."""
    from transformers.utils import get_json_schema

    hf = get_json_schema(EchoEnv.echo)["function"]
    ours = EchoEnv().tools["echo"].schema()["function"]
    assert ours["name"] == hf["name"] == "echo" and ours["description"] == " ".join(hf["description"].split())
    props = ours["parameters"]["properties"]
    assert {k: {f: v for f, v in p.items() if f != "default"} for k, p in props.items()} == hf["parameters"][
        "properties"
    ]
    assert props["times"]["default"] == 1 and "default" not in props["text"]


def test_undocumented_tool_fails_at_env_construction_with_the_fix():
    class Bare(ToolEnv):
        def generate_task(self, seed, options):
            return type("T", (), {"task_id": "t", "prompt": "p"})()

        @tool
        def go(self, n: int) -> str:
            """Go somewhere."""
            return str(n)

    with pytest.raises(ToolDefinitionError, match=r"tool 'go': .*no description for the argument 'n'.*Args:"):
        Bare()


def test_bad_tool_definitions_fail_at_decoration():
    with pytest.raises(ToolDefinitionError, match="no type hint"):

        @tool
        def a(x):
            pass

    with pytest.raises(ToolDefinitionError, match="unsupported type"):

        @tool
        def b(x: set[int]):
            pass

    with pytest.raises(ToolDefinitionError, match=r"\*args"):

        @tool
        def c(*xs: int):
            pass

    with pytest.raises(ToolDefinitionError, match="Optional"):

        @tool
        def d(x: int | str):
            pass


def test_tool_inheritance_override_and_duplicates():
    class Child(EchoEnv):
        def boom(self) -> str:  # overridden without @tool: no longer a tool
            return "quiet"

        @tool
        def add(self, a: float, b: float) -> float:
            """Subtract instead.

            Args:
                a: from this.
                b: subtract this.
            """
            return a - b

    assert list(Child().tools) == ["echo", "add", "refuse", "done"]
    env = Child()
    env.reset(seed=0)
    assert env.step(format_tool_call("add", {"a": 3, "b": 1}))[0][0]["content"] == "2.0"

    with pytest.raises(ToolDefinitionError, match="two methods declare the tool name 'echo'"):

        class Twice(EchoEnv):
            @tool(name="echo")
            def echo2(self, text: str) -> str:
                """Another echo."""
                return text


def test_validate_coerces_and_rejects():
    spec = EchoEnv().tools["add"]
    assert spec.validate({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    with pytest.raises(ToolArgumentError, match="'a' must be number, got boolean"):
        spec.validate({"a": True, "b": 1})
    echo = EchoEnv().tools["echo"]
    assert echo.validate({"text": "x", "times": 2.0}) == {"text": "x", "times": 2}
    with pytest.raises(ToolArgumentError) as err:
        echo.validate({"times": "3", "colour": 1})
    msg = str(err.value)
    assert "unexpected argument(s) ['colour']" in msg
    assert "missing required argument(s) ['text']" in msg
    assert "'times' must be integer, got string \"3\"" in msg
    assert "Expected: echo(text: string, times: integer = 1)" in msg


# ---------------------------------------------------------------------------------------------- env
def test_valid_calls_run_in_order():
    text = (
        format_tool_call("echo", {"text": "ab", "times": 2})
        + " and "
        + format_tool_call("add", {"a": 1, "b": 2})
    )
    obs, reward, term, trunc, info = _step(text)
    assert obs == [{"role": "tool", "content": "abab"}, {"role": "tool", "content": "3.0"}]
    assert info["tool_calls"] == [
        {"name": "echo", "arguments": {"text": "ab", "times": 2}},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
    ]
    assert info["tool_results"] == ["abab", "3.0"]
    assert info["tool_errors"] == []
    assert (reward, term, trunc, info["infra_error"], info["no_tool_call"]) == (
        0.0,
        False,
        False,
        None,
        False,
    )


@pytest.mark.parametrize(
    "text, needle",
    [
        ('<tool_call>{"name": "echo", "arguments": {"text": "a"</tool_call>', "is not valid JSON"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "a"}}', "never closed"),
        (
            '<tool_call>{"name": "ech", "arguments": {"text": "a"}}</tool_call>',
            "unknown tool 'ech'. Did you mean 'echo'?",
        ),
        ('<tool_call>{"name": "echo", "arguments": {}}</tool_call>', "missing required argument(s) ['text']"),
        (
            '<tool_call>{"name": "echo", "arguments": {"text": "a", "x": 1}}</tool_call>',
            "unexpected argument(s) ['x']",
        ),
        (
            '<tool_call>{"name": "echo", "arguments": {"text": 5}}</tool_call>',
            "'text' must be string, got integer 5",
        ),
        ('<tool_call>{"name": "boom", "arguments": {}}</tool_call>', "tool 'boom' raised KeyError: 'kaboom'"),
        ('<tool_call>{"name": "refuse", "arguments": {}}</tool_call>', "not allowed here"),
    ],
)
def test_every_malformed_call_is_an_observation(text, needle):
    obs, reward, term, trunc, info = _step(text)
    assert len(obs) == 1 and obs[0]["role"] == "tool"
    assert obs[0]["content"].startswith("error: ") and needle in obs[0]["content"]
    assert len(info["tool_errors"]) == 1 and needle in info["tool_errors"][0]
    assert not term and not trunc and reward == 0.0 and info["infra_error"] is None


def test_error_results_align_with_calls():
    text = (
        format_tool_call("nope")
        + '<tool_call>{"bad json</tool_call>'
        + format_tool_call("echo", {"text": "k"})
    )
    obs, *_, info = _step(text)
    assert [c["name"] for c in info["tool_calls"]] == ["nope", "echo"]  # the unparsable block has no entry
    assert info["tool_results"][0].startswith("error: unknown tool 'nope'") and info["tool_results"][1] == "k"
    assert len(info["tool_errors"]) == 2 and len(obs) == 3


def test_no_tool_call_nudges():
    obs, reward, term, trunc, info = _step("I think the answer is 4.")
    assert obs[0]["role"] == "user" and EXPECTED_FORMAT in obs[0]["content"]
    assert "echo, add, boom, refuse, done" in obs[0]["content"]
    assert info["no_tool_call"] and info["tool_calls"] == [] and info["tool_errors"] == []
    assert not term and not trunc


def test_finish_stops_later_calls_and_sets_success():
    text = format_tool_call("done", {"ok": True}) + format_tool_call("echo", {"text": "never"})
    obs, reward, term, trunc, info = _step(text)
    assert obs == [{"role": "tool", "content": "bye"}]
    assert (reward, term, trunc, info["success"], info["env_reward"]) == (1.0, True, False, 1.0, 1.0)
    assert [c["name"] for c in info["tool_calls"]] == ["done"]


# ---------------------------------------------------------------------------------------------- totality
@pytest.mark.parametrize(
    "body, needle",
    [
        ("[" * 5000, "nested too deeply"),
        ('{"name": "a", "arguments": {"v": ' + "7" * 5000 + "}}", "integer is too long"),
        ('{"name": "a", "arguments": {"v": 1e400}}', "out of range"),
        ('{"name": "a", "arguments": {"v": NaN}}', "NaN is not valid JSON"),
        ('{"name": "a", "arguments": {"v": -Infinity}}', "-Infinity is not valid JSON"),
        ('{"name": "a", "name": "b"}', "duplicate key"),
        ('{"name": "a\\ud800"}', "lone surrogate"),
        ('{"name": "a", "arguments": {"\\udfff": 1}}', "lone surrogate"),
    ],
)
def test_strict_json_rejects_what_python_would_accept_or_crash_on(body, needle):
    (item,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(item, ToolCallError) and item.kind == "malformed_json", item
    assert needle in item.message and len(item.message) < 600


def test_echo_bounds_and_escapes_model_text():
    from envs.tool_call import echo, without_surrogates

    text = "a\x00b\x1b[2J\u202ec\u200bd\ud800e\n\tf" + "x" * 500
    out = echo(text, 20)
    assert out.startswith("a\\u0000b\\u001b[2J\\u202ec\\u200bd\\ud800e\n\tf") and "more characters" in out
    out.encode("utf-8")  # always encodable
    assert echo("plain text") == "plain text" and echo("é中文🙂") == "é中文🙂"
    assert without_surrogates("a\ud800b\udfff") == "a\ufffdb\ufffd" and without_surrogates("ok") == "ok"


def test_many_calls_in_one_turn_run_only_the_first_ones():
    text = format_tool_call("echo", {"text": "x"}) * (EchoEnv.max_tool_calls_per_turn + 10)
    obs, _, _, _, info = _step(text)
    assert len(info["tool_calls"]) == EchoEnv.max_tool_calls_per_turn
    assert "only the first" in info["tool_errors"][0]
    assert len(obs) == EchoEnv.max_tool_calls_per_turn + 1


def test_unknown_and_confusable_names_are_echoed_safely():
    for name in ("ech\u043e", "echo\u200b", "x" * 100_000, "ec\x00ho"):
        obs, _, _, _, info = _step(format_tool_call(name, {"text": "a"}))
        assert info["tool_results"] == [obs[0]["content"]]
        assert obs[0]["content"].startswith("error: unknown tool")
        assert len(obs[0]["content"]) < 1200 and "\x00" not in obs[0]["content"]
        assert info["tool_calls"][0]["name"] != "echo" and len(info["tool_calls"][0]["name"]) < 300
