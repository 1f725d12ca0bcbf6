"""Code-repair tasks: a small Python module with injected bugs, plus the tests it must pass.

Each `Template` is a correct module, its tests (plain `test_*` functions with asserts, run by
`envs/sandbox_scripts/run_tests.py`) and a few `Bug`s: exact-substring replacements, each declaring
the tests it breaks (tests/test_envs_code_repair_tasks.py checks every declaration by running the
runner). A task picks one template and `num_bugs` of its bugs from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.tasks.difficulty import resolve_preset
from envs.tool_call import format_tool_call


@dataclass(frozen=True)
class Bug:
    old: str  # exact substring of the correct module, occurring once
    new: str
    breaks: tuple[str, ...]  # tests that fail with this bug alone


@dataclass(frozen=True)
class Template:
    name: str  # module name; files are <name>.py and test_<name>.py
    source: str
    tests: str
    bugs: tuple[Bug, ...]

    @property
    def module_file(self) -> str:
        return f"{self.name}.py"

    @property
    def test_file(self) -> str:
        return f"test_{self.name}.py"

    @property
    def test_names(self) -> tuple[str, ...]:
        return tuple(
            line.split("(")[0][4:] for line in self.tests.splitlines() if line.startswith("def test_")
        )


TEMPLATES: tuple[Template, ...] = (
    Template(
        name="stats",
        source="""\
def mean(xs):
    \"\"\"Arithmetic mean of a non-empty list.\"\"\"
    return sum(xs) / len(xs)


def median(xs):
    \"\"\"Middle value; the mean of the two middle values for an even length.\"\"\"
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    if n % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def variance(xs):
    \"\"\"Population variance.\"\"\"
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
""",
        tests="""\
from stats import mean, median, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_variance():
    assert variance([1, 2, 3, 4]) == 1.25
""",
        bugs=(
            Bug("return sum(xs) / len(xs)", "return sum(xs) / (len(xs) - 1)", ("test_mean", "test_variance")),
            Bug("s = sorted(xs)", "s = list(xs)", ("test_median_odd", "test_median_even")),
            Bug("(x - m) ** 2", "(x - m)", ("test_variance",)),
        ),
    ),
    Template(
        name="text",
        source="""\
def is_palindrome(text):
    \"\"\"True when text reads the same backwards, ignoring case and non-letters.\"\"\"
    letters = [c.lower() for c in text if c.isalpha()]
    return letters == letters[::-1]


def word_count(text):
    \"\"\"Number of whitespace-separated words.\"\"\"
    return len(text.split())


def title_case(text):
    \"\"\"Capitalize the first letter of every word and lowercase the rest.\"\"\"
    return " ".join(w[:1].upper() + w[1:].lower() for w in text.split())
""",
        tests="""\
from text import is_palindrome, title_case, word_count


def test_palindrome_simple():
    assert is_palindrome("racecar")


def test_palindrome_mixed_case():
    assert is_palindrome("Never odd or even")


def test_not_palindrome():
    assert not is_palindrome("python")


def test_word_count_spaces():
    assert word_count("  two   words ") == 2


def test_title_case():
    assert title_case("hELLO wORLD") == "Hello World"
""",
        bugs=(
            Bug("[c.lower() for c in text", "[c for c in text", ("test_palindrome_mixed_case",)),
            Bug("return len(text.split())", 'return len(text.split(" "))', ("test_word_count_spaces",)),
            Bug("w[1:].lower()", "w[1:]", ("test_title_case",)),
        ),
    ),
    Template(
        name="intervals",
        source="""\
def merge(intervals):
    \"\"\"Merge overlapping or touching [start, end] intervals; the result is sorted.\"\"\"
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


def total_length(intervals):
    \"\"\"Total length covered by the union of the intervals.\"\"\"
    return sum(end - start for start, end in merge(intervals))
""",
        tests="""\
from intervals import merge, total_length


def test_merge_overlap():
    assert merge([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]


def test_merge_touching():
    assert merge([[1, 2], [2, 4]]) == [[1, 4]]


def test_merge_unsorted():
    assert merge([[5, 7], [1, 2]]) == [[1, 2], [5, 7]]


def test_merge_contained():
    assert merge([[1, 10], [2, 3]]) == [[1, 10]]


def test_total_length():
    assert total_length([[0, 2], [1, 3], [10, 11]]) == 4
""",
        bugs=(
            Bug("in sorted(intervals):", "in intervals:", ("test_merge_unsorted",)),
            Bug("start <= result[-1][1]", "start < result[-1][1]", ("test_merge_touching",)),
            Bug("max(result[-1][1], end)", "end", ("test_merge_contained",)),
        ),
    ),
    Template(
        name="bank",
        source="""\
class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, balance=0):
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise InsufficientFunds(f"balance {self.balance} < {amount}")
        self.balance -= amount
        return self.balance


def transfer(src, dst, amount):
    \"\"\"Move amount from src to dst; nothing changes when src lacks the funds.\"\"\"
    src.withdraw(amount)
    dst.deposit(amount)
""",
        tests="""\
from bank import Account, InsufficientFunds, transfer


def test_deposit():
    assert Account().deposit(5) == 5


def test_deposit_zero_rejected():
    try:
        Account().deposit(0)
    except ValueError:
        return
    raise AssertionError("deposit(0) must raise ValueError")


def test_withdraw():
    assert Account(10).withdraw(4) == 6


def test_overdraft_rejected():
    a = Account(10)
    try:
        a.withdraw(11)
    except InsufficientFunds:
        assert a.balance == 10
        return
    raise AssertionError("withdraw(11) from 10 must raise InsufficientFunds")


def test_transfer():
    a, b = Account(10), Account()
    transfer(a, b, 7)
    assert (a.balance, b.balance) == (3, 7)


def test_transfer_insufficient():
    a, b = Account(5), Account()
    try:
        transfer(a, b, 6)
    except InsufficientFunds:
        assert (a.balance, b.balance) == (5, 0)
        return
    raise AssertionError("transfer of 6 from 5 must raise InsufficientFunds")
""",
        bugs=(
            Bug("if amount <= 0:", "if amount < 0:", ("test_deposit_zero_rejected",)),
            Bug(
                "if amount > self.balance:",
                "if amount > self.balance + 100:",
                ("test_overdraft_rejected", "test_transfer_insufficient"),
            ),
            Bug("self.balance -= amount", "self.balance += amount", ("test_withdraw", "test_transfer")),
        ),
    ),
    Template(
        name="search",
        source="""\
def binary_search(items, target):
    \"\"\"Index of target in the sorted list items, or -1.\"\"\"
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def insert_position(items, target):
    \"\"\"Leftmost index where target can be inserted keeping items sorted.\"\"\"
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo
""",
        tests="""\
from search import binary_search, insert_position


def test_search_middle():
    assert binary_search([1, 3, 5, 7, 9], 5) == 2


def test_search_ends():
    xs = [1, 3, 5, 7, 9]
    assert binary_search(xs, 1) == 0
    assert binary_search(xs, 9) == 4


def test_search_missing():
    assert binary_search([1, 3, 5], 4) == -1


def test_insert_position():
    assert insert_position([1, 3, 5], 4) == 2


def test_insert_duplicates():
    assert insert_position([1, 2, 2, 3], 2) == 1
""",
        bugs=(
            Bug("while lo <= hi:", "while lo < hi:", ("test_search_ends",)),
            Bug("return mid\n", "return mid + 1\n", ("test_search_middle", "test_search_ends")),
            Bug(
                "if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid\n",
                "if items[mid] <= target:\n            lo = mid + 1\n        else:\n            hi = mid\n",
                ("test_insert_duplicates",),
            ),
        ),
    ),
    Template(
        name="roman",
        source="""\
VALUES = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]


def to_roman(n):
    \"\"\"Roman numeral of 1 <= n <= 3999.\"\"\"
    if not 1 <= n <= 3999:
        raise ValueError("out of range")
    out = []
    for value, symbol in VALUES:
        while n >= value:
            out.append(symbol)
            n -= value
    return "".join(out)


def from_roman(text):
    \"\"\"Integer value of a Roman numeral.\"\"\"
    single = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, ch in enumerate(text):
        value = single[ch]
        if i + 1 < len(text) and single[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total
""",
        tests="""\
from roman import from_roman, to_roman


def test_to_roman_basic():
    assert to_roman(3) == "III"
    assert to_roman(8) == "VIII"


def test_to_roman_subtractive():
    assert to_roman(1994) == "MCMXCIV"


def test_to_roman_range():
    try:
        to_roman(0)
    except ValueError:
        return
    raise AssertionError("to_roman(0) must raise ValueError")


def test_from_roman_basic():
    assert from_roman("III") == 3


def test_from_roman_subtractive():
    assert from_roman("MCMXCIV") == 1994
""",
        bugs=(
            Bug('(900, "CM"), ', "", ("test_to_roman_subtractive",)),
            Bug(
                "while n >= value:", "while n > value:", ("test_to_roman_basic", "test_to_roman_subtractive")
            ),
            Bug("single[text[i + 1]] > value", "single[text[i + 1]] >= value", ("test_from_roman_basic",)),
        ),
    ),
)


@dataclass(frozen=True)
class CodeRepairConfig:
    """num_bugs bugs injected into one of `templates` (names; empty = all)."""

    num_bugs: int = 1
    templates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        known = {t.name for t in TEMPLATES}
        unknown = sorted(set(self.templates) - known)
        if unknown:
            raise ValueError(f"unknown code-repair template(s) {unknown}; available: {sorted(known)}")
        if not 1 <= self.num_bugs <= min(len(t.bugs) for t in TEMPLATES):
            raise ValueError(
                f"num_bugs must be between 1 and {min(len(t.bugs) for t in TEMPLATES)}, got {self.num_bugs}"
            )


DIFFICULTIES: dict[int, CodeRepairConfig] = {
    0: CodeRepairConfig(1),
    1: CodeRepairConfig(2),
    2: CodeRepairConfig(3),
}


def resolve_config(difficulty: int, overrides: dict[str, Any] | None = None) -> CodeRepairConfig:
    """The preset for `difficulty` with `overrides` (CodeRepairConfig field -> value) applied."""
    return resolve_preset("code-repair", DIFFICULTIES, difficulty, overrides)


@dataclass(frozen=True)
class CodeRepairTask:
    task_id: str
    prompt: str
    template: Template
    bugs: tuple[Bug, ...]
    buggy_source: str

    @property
    def module_file(self) -> str:
        return self.template.module_file

    @property
    def test_file(self) -> str:
        return self.template.test_file

    @property
    def fixed_source(self) -> str:
        return self.template.source

    @property
    def failing_tests(self) -> tuple[str, ...]:
        """Tests that fail on the buggy module (their first pass is a sub-goal)."""
        broken = {name for bug in self.bugs for name in bug.breaks}
        return tuple(n for n in self.template.test_names if n in broken)


def inject(template: Template, bugs: tuple[Bug, ...]) -> str:
    """The template's source with `bugs` applied (each `old` must occur exactly once)."""
    source = template.source
    for bug in bugs:
        if source.count(bug.old) != 1:
            raise ValueError(f"bug {bug.old!r} must occur exactly once in {template.module_file}")
        source = source.replace(bug.old, bug.new)
    return source


def generate(seed: int, config: CodeRepairConfig) -> CodeRepairTask:
    rng = np.random.default_rng(seed)
    pool = [t for t in TEMPLATES if not config.templates or t.name in config.templates]
    template = pool[int(rng.integers(len(pool)))]
    picked = sorted(int(i) for i in rng.choice(len(template.bugs), size=config.num_bugs, replace=False))
    bugs = tuple(template.bugs[i] for i in picked)
    return CodeRepairTask(
        task_id=f"code-repair/{template.name}/{'-'.join(map(str, picked))}",
        prompt=(
            f"Tests in {template.test_file} fail. Fix {template.module_file} so that all tests pass. "
            f"Only {template.module_file} may be changed."
        ),
        template=template,
        bugs=bugs,
        buggy_source=inject(template, bugs),
    )


def oracle_actions(task: CodeRepairTask) -> list[str]:
    """The scripted perfect policy: read the module, write the fixed version, run the tests."""
    return [
        format_tool_call("read_file", {"path": task.module_file}),
        format_tool_call("write_file", {"path": task.module_file, "content": task.fixed_source}),
        format_tool_call("run_tests"),
    ]
