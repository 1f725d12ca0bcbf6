"""Code-repair tasks: a small Python module with injected bugs, plus the tests it must pass.

Each `Template` is a correct module, its tests (plain `test_*` functions with asserts: the spec the agent
reads), a check generator and a few `Bug`s (exact-substring replacements, each declaring the tests it
breaks). The tests are *decided* by checks, not by running the asserts in the sandbox: for every run,
`draw_checks` draws fresh inputs per test (`checks(rng) -> {test name: [code, ...]}`, each code a snippet
calling the module and `observe(...)`-ing results), the reference traces come from the correct module on
the host, and the sandbox only reports what the agent's module observed (envs/observations.py). So a test
passes only for a module that computes the right values on inputs it has never seen: printing "PASS",
exiting early, patching builtins or returning always-equal objects earns nothing, and neither does
special-casing the inputs of the visible tests. tests/test_envs_tasks.py checks every bug declaration
against the checks over many draws. A task picks one template and `num_bugs` of its bugs from the seed.
"""

from __future__ import annotations

from collections.abc import Callable
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
    checks: Callable[[np.random.Generator], dict[str, list[str]]]  # fresh inputs per run, per test

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


# ---- check generators: fresh inputs for every run (see the module docstring) -----------------------------
# Each test gets inputs that exercise exactly the behaviour it names (so every bug fails the tests it declares
# and no other), and is two-sided where a constant answer could otherwise pass.


def _ints(rng: np.random.Generator, n: int, lo: int = -9, hi: int = 30) -> list[int]:
    return [int(v) for v in rng.integers(lo, hi, n)]


def _stats_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    def varied(n: int) -> list[int]:  # nonzero sum, not all equal
        while True:
            xs = _ints(rng, n)
            if sum(xs) != 0 and len(set(xs)) > 1:
                return xs

    def unsorted_median(n: int) -> list[int]:  # the middle of the unsorted list is not the median
        while True:
            xs, s, mid = _ints(rng, n), None, n // 2
            s = sorted(xs)
            true = s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
            naive = xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2
            if naive != true:
                return xs

    size = lambda *c: int(rng.choice(c))  # noqa: E731
    return {
        "test_mean": [f"observe(mean({varied(size(3, 4, 5, 6))}))" for _ in range(2)],
        "test_median_odd": [f"observe(median({unsorted_median(size(3, 5, 7))}))" for _ in range(2)],
        "test_median_even": [f"observe(median({unsorted_median(size(4, 6))}))" for _ in range(2)],
        "test_variance": [f"observe(variance({varied(size(3, 4, 5, 6))}))" for _ in range(2)],
    }


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _text_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    def word(lo: int = 3, hi: int = 8) -> str:
        return "".join(rng.choice(list(_LETTERS), int(rng.integers(lo, hi))))

    def palindrome() -> str:
        half = word(2, 5)
        return half + (str(rng.choice(list(_LETTERS))) if rng.random() < 0.5 else "") + half[::-1]

    def non_palindrome() -> str:
        while True:
            w = word()
            if w != w[::-1]:
                return w

    def mixed_case_phrase(text: str) -> str:  # random case + separators; mirrored letters differ in case
        while True:
            out = "".join(c.upper() if rng.random() < 0.5 else c for c in text)
            letters = [c for c in out if c.isalpha()]
            if letters != letters[::-1]:
                break
        cut = sorted({int(i) for i in rng.integers(1, len(out), 2)})
        parts = [out[a:b] for a, b in zip([0, *cut], [*cut, len(out)])]
        return str(rng.choice([" ", ", ", " - "])).join(parts)

    def spaced(words: list[str]) -> str:  # runs of 1-3 spaces, at least one double, leading/trailing spaces
        gaps = [" " * int(rng.integers(1, 4)) for _ in range(len(words) - 1)]
        gaps[int(rng.integers(len(gaps)))] = "  "
        return " " * int(rng.integers(0, 3)) + "".join(w + g for w, g in zip(words, [*gaps, ""])) + "  "

    def random_case(w: str) -> str:
        out = "".join(c.upper() if rng.random() < 0.5 else c for c in w)
        return out if any(c.isupper() for c in out[1:]) else out[0] + out[1:].upper()

    call = lambda fn, arg: f"observe({fn}({arg!r}))"  # noqa: E731
    n_words = lambda lo, hi: int(rng.integers(lo, hi))  # noqa: E731
    return {
        "test_palindrome_simple": [call("is_palindrome", palindrome()), call("is_palindrome", palindrome()),
                                   call("is_palindrome", non_palindrome())],
        "test_palindrome_mixed_case": [call("is_palindrome", mixed_case_phrase(palindrome())),
                                       call("is_palindrome", mixed_case_phrase(non_palindrome()))],
        "test_not_palindrome": [call("is_palindrome", non_palindrome()),
                                call("is_palindrome", non_palindrome()), call("is_palindrome", palindrome())],
        "test_word_count_spaces": [call("word_count", spaced([word() for _ in range(n_words(2, 6))]))
                                   for _ in range(2)],
        "test_title_case": [call("title_case", " ".join(random_case(word()) for _ in range(n_words(2, 5))))
                            for _ in range(2)],
    }  # fmt: skip


def _intervals_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    def chain(kind: str, n: int) -> list[list[int]]:
        """Sorted intervals, each next one related to the union so far by `kind`."""
        start = int(rng.integers(0, 10))
        out = [[start, start + int(rng.integers(3, 8))]]
        end = out[0][1]
        for _ in range(n - 1):
            prev_start = out[-1][0]
            if kind == "overlap":  # prev_start < s < end < e
                s = int(rng.integers(prev_start + 1, end))
                e = end + int(rng.integers(1, 6))
            elif kind == "touch":  # s == end < e
                s, e = end, end + int(rng.integers(1, 6))
            elif kind == "contain":  # prev_start < s < e < end
                s = int(rng.integers(prev_start + 1, end - 1))
                e = int(rng.integers(s + 1, end))
            else:  # "gap": disjoint, at least 2 apart
                s = end + int(rng.integers(2, 6))
                e = s + int(rng.integers(1, 6))
            out.append([s, e])
            end = max(end, e)
        return out

    def shuffled(xs: list[list[int]]) -> list[list[int]]:
        while True:
            order = [int(i) for i in rng.permutation(len(xs))]
            if order != sorted(order):
                return [xs[i] for i in order]

    def mixed() -> list[list[int]]:  # overlapping runs separated by gaps (no touching, no containment)
        first = chain("overlap", int(rng.integers(2, 4)))
        second = chain("overlap", int(rng.integers(1, 3)))
        shift = first[-1][1] - second[0][0] + int(rng.integers(2, 6))
        return first + [[a + shift, b + shift] for a, b in second]

    merge = lambda xs: f"observe(merge({xs}))"  # noqa: E731
    return {
        "test_merge_overlap": [merge(mixed()) for _ in range(2)],
        "test_merge_touching": [merge(chain("touch", int(rng.integers(2, 4)))) for _ in range(2)],
        "test_merge_unsorted": [merge(shuffled(chain("gap", int(rng.integers(3, 6))))) for _ in range(2)],
        "test_merge_contained": [merge(chain("contain", 2) + [[100, 100 + int(rng.integers(1, 5))]])
                                 for _ in range(2)],
        "test_total_length": [f"observe(total_length({mixed()}))" for _ in range(2)],
    }  # fmt: skip


def _bank_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    n = lambda lo=1, hi=50: int(rng.integers(lo, hi))  # noqa: E731
    b1, b2, b3, b4, b5 = n(10, 60), n(), n(10, 60), n(), n(10, 60)
    t = int(rng.integers(1, b5 + 1))
    return {
        "test_deposit": [f"observe(Account().deposit({n()}))",
                         f"a = Account({n()})\na.deposit({n()})\nobserve(a.balance)"],
        "test_deposit_zero_rejected": [f"observe(raised(lambda: Account({n()}).deposit(0)))",
                                       f"observe(raised(lambda: Account({n()}).deposit(-{n()})))"],
        "test_withdraw": [f"observe(Account({b1}).withdraw({int(rng.integers(1, b1 + 1))}))"],
        "test_overdraft_rejected": [f"a = Account({b3})\nobserve(raised(lambda: a.withdraw({b3 + n()})))\n"
                                    "observe(a.balance)"],
        "test_transfer": [f"a, b = Account({b5}), Account({b2})\ntransfer(a, b, {t})\n"
                          "observe((a.balance, b.balance))"],
        "test_transfer_insufficient": [f"a, b = Account({b4 + 1}), Account({n()})\n"
                                       f"observe(raised(lambda: transfer(a, b, {b4 + 1 + n()})))\n"
                                       "observe((a.balance, b.balance))"],
    }  # fmt: skip


def _search_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    def distinct(n: int) -> list[int]:  # increasing, gaps of 2-5 (room for missing targets)
        start = int(rng.integers(-20, 20))
        return [start + int(v) for v in np.cumsum(rng.integers(2, 6, n))]

    def odd_list() -> list[int]:
        return distinct(int(rng.choice([3, 5, 7, 9])))

    def dup_list() -> tuple[list[int], int]:
        xs = distinct(int(rng.integers(3, 7)))
        target = xs[int(rng.integers(len(xs)))]
        xs = sorted(xs + [target] * int(rng.integers(1, 3)))
        return xs, target

    middle = [odd_list() for _ in range(2)]
    ends = [distinct(int(rng.integers(4, 9))) for _ in range(2)]
    missing = [distinct(int(rng.integers(3, 8))) for _ in range(2)]
    dups = [dup_list() for _ in range(2)]
    bs = lambda xs, t: f"observe(binary_search({xs}, {t}))"  # noqa: E731
    ip = lambda xs, t: f"observe(insert_position({xs}, {t}))"  # noqa: E731
    return {
        "test_search_middle": [bs(xs, xs[(len(xs) - 1) // 2]) for xs in middle],
        "test_search_ends": [bs(xs, xs[0]) + "\n" + bs(xs, xs[-1]) for xs in ends],
        "test_search_missing": [bs(xs, xs[int(rng.integers(len(xs)))] + 1) + "\n" + bs(xs, xs[0] - 1)
                                for xs in missing],
        "test_insert_position": [ip(xs, xs[int(rng.integers(len(xs)))] + 1) for xs in missing],
        "test_insert_duplicates": [ip(xs, t) for xs, t in dups],
    }  # fmt: skip


def _reference(template: str, name: str) -> Callable:
    """`name` from a template's correct module (its own source, run here): the check generators build
    inputs with it (e.g. valid Roman numerals), so no second copy of the module's logic exists."""
    (t,) = [t for t in TEMPLATES if t.name == template]
    namespace: dict[str, Any] = {}
    exec(compile(t.source, f"<reference {t.name}>", "exec"), namespace)  # our own template code
    return namespace[name]


def _roman_checks(rng: np.random.Generator) -> dict[str, list[str]]:
    _roman = _reference("roman", "to_roman")

    def number(digits: tuple[int, ...], hundreds: tuple[int, ...] | None = None, thousands=(0, 1, 2, 3)):
        d = [int(rng.choice(thousands)), int(rng.choice(hundreds or digits)), int(rng.choice(digits)),
             int(rng.choice(digits))]  # fmt: skip
        return max(1, d[0] * 1000 + d[1] * 100 + d[2] * 10 + d[3])

    def additive_with_repeats() -> int:  # no 4/9/0 digits, at least one repeated symbol
        while True:
            n = number((1, 2, 3, 5, 6, 7, 8), thousands=(1, 2, 3))
            numeral = _roman(n)
            if any(a == b for a, b in zip(numeral, numeral[1:])):
                return n

    def subtractive_no_repeats() -> int:
        while True:
            n = number((0, 1, 4, 5, 6, 9), thousands=(0, 1))
            numeral = _roman(n)
            if ("4" in str(n) or "9" in str(n)) and all(a != b for a, b in zip(numeral, numeral[1:])):
                return n

    to = lambda n: f"observe(to_roman({n}))"  # noqa: E731
    frm = lambda n: f"observe(from_roman({_roman(n)!r}))"  # noqa: E731
    bad = lambda n: f"observe(raised(lambda: to_roman({n})))"  # noqa: E731
    return {
        "test_to_roman_basic": [to(additive_with_repeats()) for _ in range(2)],
        "test_to_roman_subtractive": [to(number((0, 4, 9, 1, 5), hundreds=(9,))) for _ in range(2)],
        "test_to_roman_range": [bad(0), bad(4000 + int(rng.integers(0, 500))), bad(-int(rng.integers(1, 99))),
                                bad(int(rng.integers(1, 3999)))],
        "test_from_roman_basic": [frm(additive_with_repeats()) for _ in range(2)],
        "test_from_roman_subtractive": [frm(subtractive_no_repeats()) for _ in range(2)],
    }  # fmt: skip



TEMPLATES: tuple[Template, ...] = (
    Template(
        name="stats",
        checks=_stats_checks,
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
        checks=_text_checks,
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
        checks=_intervals_checks,
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
        checks=_bank_checks,
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
        checks=_search_checks,
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
        checks=_roman_checks,
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
    seed: int = 0

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
        seed=int(seed),
    )


@dataclass(frozen=True)
class Check:
    """One decisive check of a test run: `code` runs in the sandbox against the agent's module;
    `expected` is its trace against the correct module, computed on the host."""

    id: int
    test: str
    code: str
    expected: list


def draw_checks(task: CodeRepairTask, run_index: int) -> list[Check]:
    """The checks of run `run_index` of this task's tests: fresh inputs each run (deterministic per task
    seed and run index), expected traces from the reference module (envs.observations.reference_traces)."""
    from envs.observations import reference_traces

    template = task.template
    drawn = template.checks(np.random.default_rng([task.seed, run_index, 0xC0DE]))
    if sorted(drawn) != sorted(template.test_names):
        raise ValueError(
            f"template {template.name}: checks cover {sorted(drawn)}, tests are {template.test_names}"
        )
    pairs = [(test, code) for test in template.test_names for code in drawn[test]]
    expected = reference_traces(template.source, template.name, [code for _, code in pairs])
    return [Check(i, test, code, exp) for i, ((test, code), exp) in enumerate(zip(pairs, expected))]


def oracle_actions(task: CodeRepairTask) -> list[str]:
    """The scripted perfect policy: read the module, write the fixed version, run the tests."""
    return [
        format_tool_call("read_file", {"path": task.module_file}),
        format_tool_call("write_file", {"path": task.module_file, "content": task.fixed_source}),
        format_tool_call("run_tests"),
    ]
