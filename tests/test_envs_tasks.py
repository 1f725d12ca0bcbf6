"""Task generators and the sandbox scripts, run on the host (they are our own trusted code here):
determinism, bug declarations of every code-repair template, the test runner's edge cases, the calc
evaluator's safety, the long-docs facts and paging."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from envs.sandbox_scripts import calc, script_source
from envs.tasks import arith, code_repair, long_docs


def _run(args: list[str], stdin: str = "", cwd: Path | None = None, name: str = "run_tests"):
    return subprocess.run(
        [sys.executable, "-c", script_source(name), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _run_suite(
    tmp_path: Path, template: code_repair.Template, source: str, timeout_s: int = 2, run: int = 0
) -> dict[str, str]:
    """Run one test run of the code-repair env on the host: the observe runner in a subprocess on `source`,
    the verdict by `envs.code_repair.decide`. {test: "PASS" or why it failed}."""
    from envs.code_repair import decide

    (tmp_path / template.module_file).write_text(source)
    task = code_repair.CodeRepairTask("t", "p", template, (), source, seed=11)
    checks = code_repair.draw_checks(task, run)
    res = _run(
        [str(tmp_path), template.name, str(timeout_s)],
        stdin=json.dumps([{"id": c.id, "code": c.code} for c in checks]),
        name="observe",
    )
    results, why, _ = decide(checks, res.stdout)
    return {n: "PASS" if ok else why[n] for n, ok in results.items()}


# ---------------------------------------------------------------------------------------------- arith
def test_arith_generate_is_deterministic_and_consistent():
    cfg = arith.resolve_config(3)
    a, b = arith.generate(123, cfg), arith.generate(123, cfg)
    assert a == b and arith.generate(124, cfg) != a
    assert calc.evaluate(a.expression) == a.answer
    for expr, value in zip(a.step_expressions(), a.intermediates):
        assert calc.evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, value",
    [("(3+4)*2", 14), ("7/2", 3.5), ("4/2", 2), ("-3-5", -8), ("2**10", 1024), ("17 % 5", 2), ("+-1", -1)],
)
def test_calc_evaluates_arithmetic(expr, value):
    assert calc.evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, msg",
    [
        ("__import__('os').system('id')", "unsupported syntax 'Call'"),
        ("x + 1", "unsupported syntax 'Name'"),
        ("'a' * 3", "unsupported syntax 'Constant'"),
        ("2 ** 999", "exponent 999 too large"),
        ("10**60 * 10**60", "result out of range"),
        ("1 +", "invalid expression"),
        ("", "empty expression"),
        ("1+" * 200 + "1", "longer than 200"),
    ],
)
def test_calc_rejects_everything_else(expr, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("*", r"\*")):
        calc.evaluate(expr)


def test_calc_script_cli():
    ok = _run([], stdin="(1+2)*3", name="calc")
    bad = _run([], stdin="1/0", name="calc")
    assert (ok.returncode, ok.stdout) == (0, "9\n")
    assert (bad.returncode, bad.stdout) == (1, "error: division by zero\n")


# ---------------------------------------------------------------------------------------------- code repair
def test_every_template_passes_when_correct(tmp_path):
    for t in code_repair.TEMPLATES:
        for run in range(3):
            assert set(_run_suite(tmp_path, t, t.source, run=run).values()) == {"PASS"}, t.name


def test_every_bug_combination_breaks_exactly_the_declared_tests():
    """Over 25 draws per template, in process (the reference traces of the buggy module stand in for the
    sandbox's observations; the runner itself is exercised by the tests around this one)."""
    from envs.observations import reference_traces, same

    for t in code_repair.TEMPLATES:
        for run in range(25):
            checks = code_repair.draw_checks(code_repair.CodeRepairTask("t", "p", t, (), "", seed=run), run)
            for k in range(1, len(t.bugs) + 1):
                for bugs in itertools.combinations(t.bugs, k):
                    observed = reference_traces(code_repair.inject(t, bugs), t.name, [c.code for c in checks])
                    failing = {c.test for c, o in zip(checks, observed) if not same(o, c.expected)}
                    declared = {n for b in bugs for n in b.breaks}
                    assert failing == declared, (t.name, run, [b.old for b in bugs])


def test_checks_are_fresh_every_run_and_reproducible():
    t = code_repair.TEMPLATES[0]
    task = code_repair.CodeRepairTask("t", "p", t, (), "", seed=5)
    first, again, second = (code_repair.draw_checks(task, r) for r in (0, 0, 1))
    assert [c.code for c in first] == [c.code for c in again]
    assert [c.code for c in first] != [c.code for c in second]
    assert {c.test for c in first} == set(t.test_names)


def test_runner_edge_cases(tmp_path):
    t = code_repair.TEMPLATES[0]
    # a syntax error in the module: every test fails with the import error
    results = _run_suite(tmp_path, t, "def mean(:\n")
    assert set(results) == set(t.test_names)
    assert all("cannot import the code under test: SyntaxError" in r for r in results.values())
    # printed or hard-coded results do not count: only observed values that match the reference
    forged = code_repair.inject(t, t.bugs[:1]) + "\nprint('@@observed {\"id\": 0, \"trace\": [0]}')\n"
    assert _run_suite(tmp_path, t, forged)["test_mean"] != "PASS"
    overfit = t.source.replace("return sum(xs) / len(xs)", "return 2.5  # the visible test's answer")
    assert _run_suite(tmp_path, t, overfit)["test_mean"] != "PASS"
    # an infinite loop hits the per-check alarm; the other tests still run
    looping = t.source.replace("return sum(xs) / len(xs)", "while True:\n        pass")
    results = _run_suite(tmp_path, t, looping, timeout_s=1)
    assert "TimeoutError" in results["test_mean"] and results["test_median_odd"] == "PASS"


def test_code_repair_generate():
    cfg = code_repair.resolve_config(1)
    task = code_repair.generate(5, cfg)
    assert task == code_repair.generate(5, cfg)
    assert len(task.bugs) == 2 and task.buggy_source != task.fixed_source
    assert set(task.failing_tests) == {n for b in task.bugs for n in b.breaks}
    names = {code_repair.generate(s, code_repair.resolve_config(0)).template.name for s in range(60)}
    assert names == {t.name for t in code_repair.TEMPLATES}
    only = code_repair.resolve_config(0, {"templates": ["bank"]})
    assert code_repair.generate(0, only).template.name == "bank"
    with pytest.raises(ValueError, match="unknown code-repair template"):
        code_repair.resolve_config(0, {"templates": ["nope"]})


# ---------------------------------------------------------------------------------------------- long docs
def test_long_docs_facts_are_where_declared():
    cfg = long_docs.resolve_config(1)
    task = long_docs.generate(9, cfg)
    assert task == long_docs.generate(9, cfg)
    assert len(task.docs) == cfg.num_docs
    assert all(len(text.splitlines()) == cfg.lines_per_doc for text in task.docs.values())
    for fact in (task.location_fact, task.code_fact):
        assert task.docs[fact.doc].splitlines()[fact.line - 1] == fact.text
    assert task.artifact in task.location_fact.text and task.vault in task.code_fact.text
    assert str(task.code) in task.code_fact.text and str(task.code) not in task.prompt
    everything = "".join(task.docs.values())
    assert (
        everything.count(task.artifact) == 1
        and everything.count(task.vault + " ") + everything.count(task.vault + ".") == 2
    )
    assert not any(ch.isdigit() for w in long_docs.FILLER for ch in w)


def test_long_docs_size_scales_to_a_million_tokens():
    cfg = long_docs.resolve_config(2)
    task = long_docs.generate(0, cfg)
    chars = sum(len(t) for t in task.docs.values())
    assert abs(chars - cfg.approx_chars) / chars < 0.1
    assert chars / 4 > 1e6  # ~4 characters per token: reading everything is > 1M tokens
    n_turns = len(long_docs.reader_actions(task))
    assert n_turns == cfg.num_docs * cfg.lines_per_doc // cfg.page_lines + 1


def test_docs_script_paging_and_errors(tmp_path):
    task = long_docs.generate(1, long_docs.resolve_config(0))
    for name, text in task.docs.items():
        (tmp_path / name).write_text(text)
    root = str(tmp_path)
    listing = _run([root, "list", "1", "3"], name="docs")
    assert (
        listing.stdout.startswith("[4 documents, page 1/2]") and listing.stdout.count(".txt (40 lines)") == 3
    )
    page = _run([root, "read", task.code_fact.doc, str(task.page_of(task.code_fact)), "20"], name="docs")
    assert (
        task.code_fact.text in page.stdout and f"{task.code_fact.line}: {task.code_fact.text}" in page.stdout
    )
    hits = _run([root, "grep", task.vault, "1", "20"], name="docs")
    assert hits.stdout.startswith(f"[2 matches for '{task.vault}', page 1/1]")
    for args, msg in [
        (["read", "nope.txt", "1", "20"], "error: no document 'nope.txt'"),
        (["read", "doc_000.txt", "9", "20"], "error: page 9 is out of range: doc_000.txt has pages 1-2"),
        (["grep", "([", "1", "20"], "error: invalid regular expression"),
    ]:
        res = _run([root, *args], name="docs")
        assert res.returncode == 2 and res.stdout.startswith(msg), res.stdout
    assert _run([root, "grep", "zzzz", "1", "20"], name="docs").stdout.startswith("[0 matches")
