"""Answer verifiers: does the model's final text hold the ground truth? A score in [0, 1].

    verifier = make_verifier("math-verify")          # or "exact-match", or "my_pkg.checks:same_answer"
    score = await verifier.averify(text, truth, row) # row: the dataset row's columns (or {})

- `math-verify` (default): Hugging Face Math-Verify, `verify(parse(truth), parse(text))`: LaTeX and plain
  expressions, the answer found as the text's last `\\boxed{}` or expression; equivalent forms match
  (`\\frac{1}{2}` and `0.5`). It runs in a child process (envs/child_process.py), where Math-Verify's own
  per-operation timeouts (signal.alarm, main thread only) work, so no answer can block the event loop
  that serves the engine.
- `exact-match`: `final_answer(text) == str(truth).strip()`, where `final_answer` is the content of the
  text's last `\\boxed{...}`, else of its last `<answer>...</answer>`, else the whole stripped text.
- `pkg.module:fn`: your function `fn(answer: str, ground_truth, row: dict) -> float | bool`, `def` (run
  in a thread) or `async def` (awaited).

Failures. A verifier that runs longer than `timeout_s` (wall clock) scores the answer 0.0 and says so
(`VerifierResult.timed_out`): only the answer can make a verifier hang (Math-Verify on `9^{9^{9^9}}`),
so it is the policy's doing, never an infrastructure error; a hung math-verify child is killed and the
next call spawns a fresh one. A verifier that raises, or returns something that is not a number in
[0, 1], is a bug in the verifier: `VerifierError`, which the env reports as its own failure (an infra
error, never scored).
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

BUILTIN_VERIFIERS = ("math-verify", "exact-match")
DEFAULT_TIMEOUT_S = 30.0


class VerifierError(RuntimeError):
    """The verifier itself failed (raised or returned garbage): the env's fault, not the answer's."""


@dataclass(frozen=True)
class VerifierResult:
    """score in [0, 1]; timed_out: the verifier ran past its timeout (score 0.0)."""

    score: float
    timed_out: bool = False


_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer(text: str) -> str:
    """The content of the last `\\boxed{...}` (braces balanced), else of the last `<answer>...</answer>`,
    else the whole text; stripped."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    return text.strip()


def _check_score(name: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)) or not 0.0 <= value <= 1.0:
        raise VerifierError(
            f"verifier {name} returned {value!r}; a verifier returns a bool or a number in [0, 1]"
        )
    return float(value)


class ExactMatch:
    """`final_answer(text) == str(truth).strip()`."""

    name = "exact-match"

    async def averify(self, answer: str, truth: Any, row: Mapping[str, Any] | None = None) -> VerifierResult:
        return VerifierResult(float(final_answer(answer) == str(truth).strip()))


# ---- math-verify in a child process ----------------------------------------------------------------


def _math_verify_in_child(answer: str, truth: str, op_timeout_s: int) -> bool:
    """Runs in the child process (main thread: Math-Verify's signal-based timeouts work)."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(truth, parsing_timeout=op_timeout_s)
    pred = parse(answer, parsing_timeout=op_timeout_s)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=op_timeout_s))


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
        try:
            ok, timed_out = await call_in_child(
                _math_verify_in_child, answer, str(truth), self.op_timeout_s, timeout_s=self.timeout_s
            )
        except ChildProcessDied as e:
            raise VerifierError(str(e)) from e
        except Exception as e:  # an exception inside math-verify: a bug there, reported as one
            raise VerifierError(f"math-verify raised {type(e).__name__}: {e}") from e
        return VerifierResult(0.0, timed_out=True) if timed_out else VerifierResult(float(ok))


class CustomVerifier:
    """A user function `fn(answer, ground_truth, row) -> float | bool`, sync (in a thread) or async."""

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
        call = (
            self.fn(answer, truth, row) if self.is_async else asyncio.to_thread(self.fn, answer, truth, row)
        )
        try:
            value = await asyncio.wait_for(call, self.timeout_s)
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
