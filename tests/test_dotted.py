"""envs/dotted.py: the one "pkg.module:attr" resolver (env entry points, reward functions, scorers).
It is pkgutil.resolve_name; each failure names the failing part and the fix."""

from __future__ import annotations

import pkgutil
import textwrap

import pytest

from envs.dotted import DottedNameError, resolve_name


@pytest.fixture
def mods(tmp_path, monkeypatch):
    (tmp_path / "odyssey_dotted_ok.py").write_text(
        textwrap.dedent(
            """
            class Scorer:
                @staticmethod
                def score(traj, i):
                    return 1.0
            def brevity(traj):
                return 0.0
            LIMIT = 3
            """
        )
    )
    (tmp_path / "odyssey_dotted_needs_dep.py").write_text("import odyssey_no_such_dependency\n")
    (tmp_path / "odyssey_dotted_raises.py").write_text("raise RuntimeError('module import exploded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_resolves_what_pkgutil_resolves(mods):
    for name in (
        "odyssey_dotted_ok:brevity",
        "odyssey_dotted_ok:Scorer.score",
        "tests.custom_rewards:brevity",
    ):
        assert resolve_name(name) is pkgutil.resolve_name(name)
    assert resolve_name("odyssey_dotted_ok:LIMIT", callable_=False) == 3


@pytest.mark.parametrize(
    "name, needles",
    [
        ("odyssey_dotted_ok", ["is malformed", "'pkg.module:function'"]),
        ("odyssey_dotted_ok:", ["is malformed"]),
        ("a b:c", ["is malformed"]),
        ("odyssey_dotted_missing:fn", ["module 'odyssey_dotted_missing' not found", "PYTHONPATH"]),
        ("odyssey_dotted_ok.sub:fn", ["module 'odyssey_dotted_ok.sub' not found", "is not a package"]),
        (
            "odyssey_dotted_needs_dep:fn",  # the module exists; its own import fails on a missing dependency
            [
                "importing module 'odyssey_dotted_needs_dep' failed",
                "No module named 'odyssey_no_such_dependency'",
            ],
        ),
        (
            "odyssey_dotted_raises:fn",
            ["importing module 'odyssey_dotted_raises' failed", "module import exploded"],
        ),
        (
            "odyssey_dotted_ok:brevityy",
            ["'odyssey_dotted_ok' has no attribute 'brevityy'", "did you mean 'brevity'"],
        ),
        ("odyssey_dotted_ok:Scorer.scor", ["'odyssey_dotted_ok.Scorer' has no attribute 'scor'", "'score'"]),
        ("odyssey_dotted_ok:LIMIT", ["is a int, not a callable"]),
    ],
)
def test_each_failure_names_its_part_and_the_fix(mods, name, needles):
    with pytest.raises(DottedNameError) as info:
        resolve_name(name, what="reward function")
    msg = str(info.value)
    assert msg.startswith(f"reward function {name!r}") and isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in msg, msg
    assert info.value.problem in msg
