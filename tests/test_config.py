"""Run config: shipped configs load, round trip through the run dir, overrides apply, and every class of bad
input fails before anything starts with a message naming the key path (and the closest valid key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.config import ConfigError, RunConfig, cli_main, load_config, parse_yaml, write_resolved

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny.yaml"
TINY_REL = "configs/tiny.yaml"


def problems_of(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


# ---- valid configs ---------------------------------------------------------------------------------


def test_shipped_configs_are_all_present_and_valid():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "stage_8k.yaml", "stage_64k.yaml", "stage_256k.yaml", "stage_1m.yaml"} <= names
    budgets = {}
    for p in CONFIGS:
        cfg = load_config(p)
        budgets[p.stem] = cfg.rollout.max_tokens
    assert [budgets[f"stage_{s}"] for s in ("8k", "64k", "256k", "1m")] == [8192, 65536, 262144, 1048576]


def test_tiny_is_the_cpu_demo():
    cfg = load_config(TINY)
    assert cfg.model.preset == "tiny" and cfg.env.id == "arith"
    assert [r.name for r in cfg.rewards] == ["outcome", "subgoal", "process", "overlong"]
    assert cfg.rollout.num_workers == 2 and cfg.rollout.engine == "torch"
    assert cfg.learner.advantage == "grpo"


def test_defaults_are_valid():
    cfg = RunConfig()
    assert cfg.model.preset == "tiny" and cfg.rewards[0].name == "outcome"


def test_write_resolved_round_trip(tmp_path):
    cfg = load_config(
        TINY, ["learner.lr=1e-5", "rewards.1.weight=0.5", "model.overrides.num_hidden_layers=4"]
    )
    out = write_resolved(cfg, tmp_path / "run")
    assert out == tmp_path / "run" / "config.yaml"
    again = load_config(out)
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()
    assert write_resolved(again, tmp_path / "run2").read_text() == out.read_text()


def test_overrides_apply():
    cfg = load_config(
        TINY,
        [
            "learner.lr=1e-5",
            "rollout.num_workers=3",
            "rollout.temperature=0.7",
            "learner.routing_replay=false",
            "rewards.0.weight=0.5",
            "env.kwargs.difficulty=2",
            "env.kwargs.config={num_ops: 2}",
            "model.overrides.num_hidden_layers=4",
            "logging.run_dir=runs/x",
            "rollout.sandbox_image=null",
        ],
    )
    assert cfg.learner.lr == 1e-5 and isinstance(cfg.learner.lr, float)
    assert cfg.rollout.num_workers == 3 and cfg.rollout.temperature == 0.7
    assert cfg.learner.routing_replay is False
    assert cfg.rewards[0].weight == 0.5
    assert cfg.env.kwargs == {"difficulty": 2, "config": {"num_ops": 2}}
    assert cfg.model.overrides == {"num_hidden_layers": 4}
    assert cfg.logging.run_dir == "runs/x" and cfg.rollout.sandbox_image is None
    # A whole list can be replaced with a YAML flow value; later overrides win.
    cfg = load_config(TINY, ["rewards=[{name: outcome}]", "learner.lr=1", "learner.lr=2e-3"])
    assert [r.name for r in cfg.rewards] == ["outcome"] and cfg.learner.lr == 2e-3


def test_yaml_scalars_follow_yaml_1_2_floats():
    assert parse_yaml("a: 1e-5\nb: 3\nc: .5\nd: 1.0e+3\ne: '1e-5'\nf: 1_000") == {
        "a": 1e-5, "b": 3, "c": 0.5, "d": 1000.0, "e": "1e-5", "f": 1000,
    }  # fmt: skip


# ---- bad input: one class per test, messages name the key path ----------------------------------------


def test_unknown_key_names_path_and_closest_key(tmp_path):
    assert problems_of(TINY, ["learner.lrr=1e-5"]) == ["learner.lrr: unknown key; did you mean 'learner.lr'?"]
    p = write(tmp_path, "leaner: {lr: 1.0e-5}\nlr: 3\nrollout: {num_worker: 2}\n")
    assert sorted(problems_of(p)) == [
        "leaner: unknown key; did you mean 'learner'?",
        "lr: unknown key; did you mean 'learner.lr' or 'warmup.lr'?",  # misplaced: found in other sections
        "rollout.num_worker: unknown key; did you mean 'rollout.num_workers'?",
    ]
    assert problems_of(write(tmp_path, "seed: 1\nzzzz: 2\n")) == [
        "seed: unknown key; did you mean 'env.dataset.seed' or 'rollout.seed' or 'learner.seed'?",
        "zzzz: unknown key (valid keys here: model, env, rewards, rollout, learner, orchestrator, logging, "
        "warmup, stages)",
    ]
    assert problems_of(TINY, ["rewards.0.wieght=1"]) == [
        "rewards.0.wieght: unknown key; did you mean 'rewards.0.weight'?"
    ]
    assert problems_of(TINY, ["model.overrides.hidden_sise=64"]) == [
        "model.overrides.hidden_sise: unknown model field; did you mean 'model.overrides.hidden_size'?"
    ]
    (msg,) = problems_of(TINY, ["env.kwargs.dificulty=1"])
    assert msg.startswith(
        "env.kwargs.dificulty: unknown argument of env 'arith'; did you mean 'env.kwargs.difficulty'?"
    )


def test_wrong_type():
    assert problems_of(TINY, ["learner.lr=abc"]) == [
        "learner.lr: Input should be a valid number, got 'abc' (str)"
    ]
    assert problems_of(TINY, ["rollout.num_workers=2.5", "learner.routing_replay=maybe"]) == [
        "rollout.num_workers: Input should be a valid integer, got 2.5 (float)",
        "learner.routing_replay: Input should be a valid boolean, got 'maybe' (str)",
    ]
    (msg,) = problems_of(TINY, ["rollout.engine=jax"])  # a registry name (rl/rollout/engines.py)
    assert msg.startswith("rollout.engine: unknown rollout engine 'jax': choose from torch, vllm")
    assert problems_of(TINY, ["learner=5"]) == [
        "learner: Input should be a valid dictionary or instance of LearnerSection, got 5 (int)"
    ]
    assert problems_of(TINY, ["model.overrides.num_hidden_layers=x"]) == [
        "model.overrides.num_hidden_layers: Input should be a valid integer, got 'x' (str)"
    ]


def test_out_of_range():
    assert sorted(
        problems_of(TINY, ["learner.lr=-1e-5", "rollout.top_p=1.5", "rollout.temperature=.nan"])
    ) == [
        "learner.lr: Input should be greater than 0, got -1e-05 (float)",
        "rollout.temperature: Input should be a finite number, got nan (float)",
        "rollout.top_p: Input should be less than or equal to 1, got 1.5 (float)",
    ]
    (msg,) = problems_of(TINY, ["learner.betas=[0.9, 1.5]"])
    assert msg.startswith("learner.betas: betas must be two numbers in [0, 1)")
    assert problems_of(TINY, ["model.overrides.hidden_size=0"]) == [
        "model.overrides: hidden_size must be >= 1, got 0"
    ]


def test_contradicting_budgets_and_unknown_names():
    problems = problems_of(TINY, ["rollout.max_new_tokens=4096", "learner.group_size=3"])
    assert problems == [
        "rollout.max_new_tokens (4096) exceeds rollout.max_tokens (2048), the whole-episode budget; "
        "lower max_new_tokens or raise max_tokens",
        "rollout.episodes (16) must be a multiple of learner.group_size (3) for grpo; "
        "e.g. rollout.episodes=15",
    ]
    # an episode longer than the micro-batch budget is packed alone (rl/learner/packing.py): no error
    assert load_config(TINY, ["learner.micro_batch_tokens=1024"]).learner.micro_batch_tokens == 1024
    problems = problems_of(TINY, ["learner.advantage=gae", "learner.turn_credit=true", "learner.group_size=1",
                                  "learner.critic_preset=tinny", "learner.value_model=critic"])
    assert problems == [
        "learner.turn_credit applies to grpo/rloo; with advantage=gae per-turn rewards already land on their "
        "turn's tokens. Set learner.turn_credit=false",
        "learner.critic_preset: unknown preset 'tinny' (choose from k3, small, tiny)",
    ]
    problems = problems_of(TINY, ["learner.advantage=raft", "learner.turn_credit=true",
                                  "orchestrator.dynamic_sampling=true"])
    assert [p.split(";")[0] for p in problems] == [
        "orchestrator.dynamic_sampling discards groups whose rewards are all equal, and raft trains "
        "on the all-success ones",
        "learner.turn_credit applies to grpo/rloo",
    ]
    assert load_config(TINY, ["learner.advantage=raft", "learner.group_size=1"]).learner.group_size == 1
    (msg,) = problems_of(TINY, ["learner.mis_band=[2.0, 0.5]"])
    assert msg.startswith("learner.mis_band: mis_band must be [lo, hi] with 0 <= lo < 1 < hi")
    (msg,) = problems_of(TINY, ["model.preset=tinny"])
    assert msg.startswith("model.preset: unknown preset 'tinny'; did you mean 'tiny'?")
    (msg,) = problems_of(TINY, ["env.id=arth"])
    assert msg.startswith("env.id: unknown env 'arth'; did you mean 'arith'?")
    (msg,) = problems_of(TINY, ["rewards.0.name=outcom"])
    assert msg.startswith("rewards[0] (outcom): unknown built-in reward 'outcom'. Did you mean 'outcome'?")
    assert problems_of(TINY, ["rewards=[]"]) == [
        "rewards: empty; give at least one reward, e.g. rewards: [{name: outcome, weight: 1.0}]"
    ]


def test_all_problems_listed_at_once(tmp_path):
    # an engine that is not a string (an unknown engine name is a meaning check: test_wrong_type)
    text = "learner: {lrr: 1, steps: 0}\nrollout: {engine: [jax], top_k: -1}\nlogging: {log_every: 0}\n"
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert len(info.value.problems) == 5
    text = str(info.value)
    assert text.startswith(f"invalid config {p}:\n  - ")
    for key in ("learner.lrr", "learner.steps", "rollout.engine", "rollout.top_k", "logging.log_every"):
        assert f"  - {key}: " in text


def test_missing_file_and_bad_yaml(tmp_path):
    (msg,) = problems_of(tmp_path / "nope.yaml")
    assert (
        msg
        == f"{tmp_path / 'nope.yaml'}: no such config file (configs/ holds the shipped ones, e.g. {TINY_REL})"
    )
    (msg,) = problems_of(tmp_path)
    assert "is a directory" in msg
    (msg,) = problems_of(write(tmp_path, "learner:\n  lr: [1, 2\n"))
    assert msg.startswith("YAML syntax error at line 3")
    assert problems_of(write(tmp_path, "- 1\n- 2\n")) == [
        "(top level): expected a mapping of sections, got [1, 2] (list)"
    ]
    assert load_config(write(tmp_path, "")) == RunConfig()  # empty file: all defaults


@pytest.mark.parametrize(
    "override, expected",
    [
        ("learner.lr", "override 'learner.lr': expected KEY=VALUE with a dotted key"),
        ("=3", "override '=3': expected KEY=VALUE"),
        ("learner..lr=1", "override 'learner..lr=1': expected KEY=VALUE"),
        (
            "rewards.9.weight=1",
            "override 'rewards.9.weight=1': rewards is a list of 4 item(s); address an item",
        ),
        ("rewards.x=1", "override 'rewards.x=1': rewards is a list of 4 item(s)"),
        (
            "learner.steps.x=1",
            "override 'learner.steps.x=1': learner.steps is a value (4 (int)), not a section",
        ),
        ("learner.lr=[1", "override 'learner.lr=[1': value is not valid YAML"),
    ],
)
def test_bad_override_syntax(override, expected):
    (msg,) = problems_of(TINY, [override])
    assert msg.startswith(expected), msg


# ---- CLI ----------------------------------------------------------------------------------------------


def test_cli_show_prints_resolved_yaml(tmp_path, capsys):
    assert cli_main(["show", str(TINY), "learner.lr=1e-5"]) == 0
    out = capsys.readouterr().out
    assert parse_yaml(out)["learner"]["lr"] == 1e-5
    resolved = write(tmp_path, out)
    assert load_config(resolved) == load_config(TINY, ["learner.lr=1e-5"])


def test_cli_show_bad_input_exits_2(capsys):
    assert cli_main(["show", str(TINY), "learner.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "learner.lrr: unknown key; did you mean 'learner.lr'?" in err
    assert cli_main(["show", "does/not/exist.yaml"]) == 2
    assert "no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["show"])
    assert info.value.code == 2


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert ConfigError(["a.b: bad"]).problems == ["a.b: bad"]


def test_docs_list_every_key():
    from rl.config import _leaf_paths

    docs = (ROOT / "docs" / "config.md").read_text()
    missing = [p for p in _leaf_paths(RunConfig) if f"`{p.replace('.0.', '.N.')}`" not in docs and "." in p]
    assert missing == [], f"document these keys in docs/config.md: {missing}"


def test_every_shipped_config_passes_config_show_and_the_staged_curriculum_has_the_stage_budgets(capsys):
    """`odyssey config show FILE` (what a user runs first) accepts every shipped config, stages included; the
    four-stage curriculum's stages have the budgets of the four stage_*.yaml configs."""
    from rl.config import cli_main
    from rl.train.stages import stage_config

    for p in CONFIGS:
        assert cli_main(["show", str(p)]) == 0, p.name
        assert "rollout:" in capsys.readouterr().out, p.name
    staged = load_config(ROOT / "configs" / "staged_8k_1m.yaml")
    for i, s in enumerate(("8k", "64k", "256k", "1m")):
        one = load_config(ROOT / "configs" / f"stage_{s}.yaml")
        st = stage_config(staged, i)
        assert staged.stages[i].name == s
        assert (st.rollout.max_tokens, st.env.kwargs, st.rollout.max_new_tokens, st.rollout.episodes) == (
            one.rollout.max_tokens, one.env.kwargs, one.rollout.max_new_tokens, one.rollout.episodes)
        assert st.rewards[3].params == one.rewards[3].params
