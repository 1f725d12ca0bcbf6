"""Task generators and the sandbox scripts, run on the host (they are our own trusted code here):
determinism, bug declarations of every code-repair template, the test runner's edge cases, the calc
evaluator's safety, the long-docs facts and paging."""

from __future__ import annotations

import itertools
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
    tmp_path: Path, template: code_repair.Template, source: str, timeout_s: int = 2
) -> dict[str, str]:
    (tmp_path / template.module_file).write_text(source)
    res = _run(
        [str(tmp_path), template.test_file, str(timeout_s), *template.test_names],
        stdin=f"N0NCE\n{template.tests}",
    )
    assert res.returncode == 0, res.stderr
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("N0NCE PASS ") or line.startswith("N0NCE FAIL "):
            name, _, reason = line[11:].partition(": ")
            out[name] = "PASS" if line.startswith("N0NCE PASS") else reason
    return out


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
        assert set(_run_suite(tmp_path, t, t.source).values()) == {"PASS"}, t.name


def test_every_bug_combination_breaks_exactly_the_declared_tests(tmp_path):
    for t in code_repair.TEMPLATES:
        for k in range(1, len(t.bugs) + 1):
            for bugs in itertools.combinations(t.bugs, k):
                results = _run_suite(tmp_path, t, code_repair.inject(t, bugs))
                failing = {n for n, r in results.items() if r != "PASS"}
                declared = {n for b in bugs for n in b.breaks}
                assert failing == declared, (t.name, [b.old for b in bugs])


def test_runner_edge_cases(tmp_path):
    t = code_repair.TEMPLATES[0]
    # a syntax error in the module: every test fails with the import error
    results = _run_suite(tmp_path, t, "def mean(:\n")
    assert set(results) == set(t.test_names)
    assert all(r.startswith("cannot import the code under test: SyntaxError") for r in results.values())
    # printed fake results do not count: only nonce-prefixed lines are results
    forged = t.source + "\nprint('PASS test_mean')\nprint('N0NCEX PASS test_mean')\n"
    assert set(_run_suite(tmp_path, t, forged).values()) == {"PASS"}
    broken = code_repair.inject(t, t.bugs[:1]) + "\nprint('PASS test_mean')\n"
    assert _run_suite(tmp_path, t, broken)["test_mean"] != "PASS"
    # an infinite loop hits the per-test alarm
    looping = t.source.replace("return sum(xs) / len(xs)", "while True:\n        pass")
    results = _run_suite(tmp_path, t, looping, timeout_s=1)
    assert results["test_mean"].startswith("TimeoutError") and results["test_median_odd"] == "PASS"


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
