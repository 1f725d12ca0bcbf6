"""Verifiers and child-process functions used by tests/test_text_envs.py ("tests.custom_verifiers:<name>")."""

from __future__ import annotations

import asyncio
import time


def same_length(answer: str, ground_truth, row: dict) -> float:
    """A sync custom verifier: 1.0 when the answer has as many characters as the ground truth."""
    return float(len(answer.strip()) == len(str(ground_truth)))


async def async_contains(answer: str, ground_truth, row: dict) -> bool:
    await asyncio.sleep(0)
    return str(ground_truth) in answer


def broken(answer: str, ground_truth, row: dict) -> float:
    raise KeyError("the verifier's own bug")


def out_of_range(answer: str, ground_truth, row: dict) -> float:
    return 2.0


async def hangs(answer: str, ground_truth, row: dict) -> float:
    await asyncio.sleep(3600)
    return 1.0


def wrong_arity(answer: str) -> float:
    return 1.0


# ---- functions run in the child process (envs/child_process.py) --------------------------------------


def add(a: int, b: int) -> int:
    print("noise on stdout must not corrupt the answer")
    return a + b


def sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def fail(message: str) -> None:
    raise ValueError(message)
