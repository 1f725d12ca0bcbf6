"""Answer verifiers: does the model's final text hold the ground truth? A score in [0, 1].

    verifier = make_verifier("math-verify")          # or "exact-match", or "my_pkg.checks:same_answer"
    score = await verifier.averify(text, truth, row) # row: the dataset row's columns (or {})

- `math-verify` (default): Hugging Face Math-Verify, `verify(parse(truth), parse(text))`: LaTeX and plain
  expressions, the answer found as the text's last `\\boxed{}` or expression; equivalent forms match
  (`\\frac{1}{2}` and `0.5`). When the ground truth is a number, the answer must also be written as a
  number (`number_literal`: a decimal or a fraction in lowest terms), not as an expression of that value:
  Math-Verify alone scores `25 * 2`, `\\boxed{49+1}` or `\\frac{100}{2}` correct for 50, and GRPO on
  SmolLM2 learned to restate the question as the answer (docs/envs.md, "Verifying safely"). It runs in a
  child process (envs/child_process.py), where Math-Verify's own per-operation timeouts (signal.alarm, main
  thread only) work, so no answer can block the event loop that serves the engine.
- `exact-match`: `final_answer(text) == str(truth).strip()`, where `final_answer` is the content of the
  text's last `\\boxed{...}`, else of its last `<answer>...</answer>`, else the whole stripped text.
- `pkg.module:fn`: your function `fn(answer: str, ground_truth, row: dict) -> float | bool`, `def` (run
  on a thread of its own, envs/threads.py) or `async def` (awaited).

Failures. The built-in verifiers are total in the answer: whatever the text holds (huge numbers,
NaN/inf, deep nesting, lone surrogates, megabytes, a value that is not a string) they return a score,
in time linear in the text (`final_answer` and `last_tagged` never backtrack), and a malformed answer
scores 0.0. A verifier that runs longer than `timeout_s` (wall clock) scores the answer 0.0 and says so
(`VerifierResult.timed_out`): only the answer can make a verifier hang (Math-Verify on `9^{9^{9^9}}`),
so it is the policy's doing, never an infrastructure error; a hung math-verify child is killed and the
next call spawns a fresh one. An exception inside Math-Verify caused by the answer is a failed check
(0.0); a math-verify child that dies on an answer while the ground truth checked against itself runs is
one too (`VerifierResult.failed` says so). Only the ground truth failing to parse, or the child dying on
that as well, is `VerifierError`. A custom verifier that raises, or returns something that is not a
number in [0, 1], is a bug in the verifier: `VerifierError`, which the env reports as its own failure
(an infra error, never scored); a custom verifier must be total in the answer itself.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from envs.child_process import ChildProcessDied, call_in_child
from envs.threads import run_in_own_thread

BUILTIN_VERIFIERS = ("math-verify", "exact-match")
DEFAULT_TIMEOUT_S = 30.0


class VerifierError(RuntimeError):
    """The verifier itself failed (raised or returned garbage): the env's fault, not the answer's."""


@dataclass(frozen=True)
class VerifierResult:
    """score in [0, 1]; timed_out: the verifier ran past its timeout (score 0.0); failed: why the answer
    made a built-in verifier fail instead of answering (score 0.0), else None."""

    score: float
    timed_out: bool = False
    failed: str | None = None


_BOXED = re.compile(r"\\boxed\s*\{")
_BRACE = re.compile(r"[{}]")


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last `<tag>...</tag>` (None when there is none), exactly what
    `re.findall("<tag>(.*?)</tag>", text, re.S)[-1]` gives, in linear time: that regex takes quadratic time
    on a text of many opening tags and no closing one."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    found, pos = None, 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return found
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return found
        found, pos = text[start + len(open_tag) : end], end + len(close_tag)


def final_answer(text: str) -> str:
    """The content of the last `\\boxed{...}` (braces balanced), else of the last `<answer>...</answer>`,
    else the whole text; stripped. Linear time in the text, whatever it holds."""
    starts = {m.end() - 1 for m in _BOXED.finditer(text)}  # the boxes' opening braces
    best: tuple[int, int] | None = None  # (start, end) of the last box that closes
    stack: list[int] = []
    for m in _BRACE.finditer(text) if starts else ():
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            opened = stack.pop()
            if opened in starts and (best is None or opened > best[0]):
                best = (opened, m.start())
    if best is not None:
        return text[best[0] + 1 : best[1]].strip()
    tagged = last_tagged(text)
    return tagged.strip() if tagged is not None else text.strip()


def _check_score(name: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)) or not 0.0 <= value <= 1.0:
        raise VerifierError(
            f"verifier {name} returned {value!r}; a verifier returns a bool or a number in [0, 1]"
        )
    return float(value)


class ExactMatch:
    """`final_answer(text) == str(truth).strip()`; an answer that is not a string scores 0.0."""

    name = "exact-match"

    async def averify(self, answer: str, truth: Any, row: Mapping[str, Any] | None = None) -> VerifierResult:
        if not isinstance(answer, str):
            return VerifierResult(0.0)
        return VerifierResult(float(final_answer(answer) == str(truth).strip()))


# ---- math-verify in a child process ----------------------------------------------------------------


_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"  # 7, 1,234, 3.25, .5
_DECIMAL = re.compile(rf"[+-]?(?:{_DIGITS})")
_FRACTION = re.compile(r"([+-]?)(?:\\[dt]?frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")


def number_literal(extracted: str, percent: bool = False) -> bool:
    """Whether Math-Verify's extracted answer text is a number written as one: a decimal (`50`, `-3.5`,
    `1,234`) or a fraction in lowest terms (`\\frac{1}{2}`, `-3/4`; denominator > 1), with a trailing `%`
    only when `percent` (the ground truth has one); surrounding whitespace ignored. Not an expression that
    evaluates to a number (`25 * 2`, `49+1`, `\\frac{100}{2}`, `-(-50)`, `\\sqrt{2500}`), and not digits
    apart (`5 0`, `5\\,0`: Math-Verify reads them as a product, 0, or a mixed number, `1 2` = 3). Linear
    time."""
    s = extracted.strip()
    if percent:
        s = s.removesuffix("\\%").removesuffix("%")
    if _DECIMAL.fullmatch(s):
        return True
    m = _FRACTION.fullmatch(s)
    if m is None:
        return False
    num, den = (int(m[2]), int(m[3])) if m[2] is not None else (int(m[4]), int(m[5]))
    return den > 1 and math.gcd(num, den) == 1


def _math_verify_in_child(answer: str, truth: str, op_timeout_s: int) -> bool:
    """Runs in the child process (main thread: Math-Verify's signal-based timeouts work). An exception
    while parsing the ground truth propagates (the env's data); one caused by the answer (parsing it, or
    comparing it) is a failed check: False. A ground truth that is a number needs an answer written as a
    number (`number_literal`): Math-Verify alone accepts any expression of the same value, so restating
    the question (`25 * 2` for "What is 25 times 2?") would score as solving it."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(truth, parsing_timeout=op_timeout_s)
    try:
        pred = parse(answer, parsing_timeout=op_timeout_s)
        if not (gold and pred and verify(gold, pred, timeout_seconds=op_timeout_s)):
            return False
        if getattr(gold[0], "is_Number", False):  # SymPy Integer / Rational / Float
            texts = [p for p in pred if isinstance(p, str)]
            return bool(texts) and number_literal(texts[-1], percent="%" in truth)
        return True
    except Exception:  # Math-Verify (or SymPy under it) failing on the answer: the answer's doing
        return False


class MathVerify:
    """Hugging Face Math-Verify in a child process. op_timeout_s: Math-Verify's own limit per parse and per
    comparison (inside the child); timeout_s: the wall-clock limit of one call."""

    name = "math-verify"

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, op_timeout_s: int = 5) -> None:
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "the math-verify verifier needs the math-verify package: pip install 'odyssey-rl[envs]' "
                "(or pip install math-verify); or use verifier: exact-match"
            )
        self.timeout_s, self.op_timeout_s = float(timeout_s), int(op_timeout_s)

    async def averify(self, answer: str, truth: Any, row: Mapping[str, Any] | None = None) -> VerifierResult:
        if not isinstance(answer, str):
            return VerifierResult(0.0)
        try:
            ok, timed_out = await self._call(answer, str(truth))
        except ChildProcessDied as e:
            # The child died on this answer (out of memory, a crash in SymPy's C code) or of something else
            # (killed from outside). The truth checked against itself tells which: if that runs, the
            # answer killed it, and an answer that crashes the verifier is a failed check.
            try:
                self_check = await self._call(str(truth), str(truth))
            except Exception:
                raise VerifierError(str(e)) from e
            if self_check[1]:
                raise VerifierError(str(e)) from e
            return VerifierResult(0.0, failed=f"the verifier's process died on this answer: {e}")
        except Exception as e:  # an exception parsing the ground truth: the env's data, reported as such
            raise VerifierError(f"math-verify raised {type(e).__name__}: {e}") from e
        return VerifierResult(0.0, timed_out=True) if timed_out else VerifierResult(float(bool(ok)))

    async def _call(self, answer: str, truth: str) -> tuple[Any, bool]:
        return await call_in_child(
            _math_verify_in_child, answer, truth, self.op_timeout_s, timeout_s=self.timeout_s
        )


class CustomVerifier:
    """A user function `fn(answer, ground_truth, row) -> float | bool`, sync (on a thread of its own) or
    async."""

    def __init__(self, name: str, fn: Callable[..., Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            inspect.signature(fn).bind("answer", "truth", {})
        except TypeError as e:
            raise ValueError(
                f"verifier {name}: it must take (answer, ground_truth, row), got {fn.__name__}"
                f"{inspect.signature(fn)} ({e})"
            ) from None
        except ValueError:  # no signature (a builtin): checked when called
            pass
        self.name, self.fn, self.timeout_s = name, fn, float(timeout_s)
        self.is_async = inspect.iscoroutinefunction(fn)

    async def averify(self, answer: str, truth: Any, row: Mapping[str, Any] | None = None) -> VerifierResult:
        row = dict(row or {})
        if self.is_async:
            call = asyncio.wait_for(self.fn(answer, truth, row), self.timeout_s)
        else:  # a thread of its own (envs/threads.py): one that hangs holds only it, never the engine's
            call = run_in_own_thread(self.fn, answer, truth, row, timeout_s=self.timeout_s, what="verifier")
        try:
            value = await call
        except TimeoutError:
            return VerifierResult(0.0, timed_out=True)
        except Exception as e:
            raise VerifierError(f"verifier {self.name} raised {type(e).__name__}: {e}") from e
        return VerifierResult(_check_score(self.name, value))


def make_verifier(
    spec: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ExactMatch | MathVerify | CustomVerifier:
    """A verifier by name: "math-verify", "exact-match" or "pkg.module:fn". ValueError naming the fix."""
    if spec == "math-verify":
        return MathVerify(timeout_s)
    if spec == "exact-match":
        return ExactMatch()
    from envs.dotted import is_dotted_name, resolve_name

    if not is_dotted_name(spec):
        import difflib

        close = difflib.get_close_matches(str(spec), BUILTIN_VERIFIERS, n=1)
        raise ValueError(
            f"unknown verifier {spec!r}"
            + (f"; did you mean {close[0]!r}?" if close else "")
            + f" Built-ins: {', '.join(BUILTIN_VERIFIERS)}; or your own 'pkg.module:function'"
        )
    return CustomVerifier(spec, resolve_name(spec, what="verifier"), timeout_s)
