"""Multi-step arithmetic tasks: `((a+b)*c)-d`, left-nested, integer operands.

The intermediate values (after each operation) are the sub-goals; the last one is the answer.
Difficulty 0 is a single `a+b` with one-digit numbers and a very short prompt, so a tiny model can
learn the whole loop (calc, then answer) after a short SFT warm-up on `oracle_actions`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.tasks.difficulty import resolve_preset
from envs.tool_call import format_tool_call

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithConfig:
    """num_ops operations on num_ops+1 operands drawn uniformly from [min_operand, max_operand]."""

    num_ops: int = 1
    max_operand: int = 9
    min_operand: int = 0
    ops: tuple[str, ...] = ("+",)

    def __post_init__(self) -> None:
        if self.num_ops < 1:
            raise ValueError(f"num_ops must be >= 1, got {self.num_ops}")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
            )
        bad = [op for op in self.ops if op not in _OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {list(_OPS)}, got {list(self.ops)}")


DIFFICULTIES: dict[int, ArithConfig] = {
    0: ArithConfig(num_ops=1, max_operand=9, ops=("+",)),
    1: ArithConfig(num_ops=2, max_operand=20, ops=("+", "-", "*")),
    2: ArithConfig(num_ops=3, max_operand=50, ops=("+", "-", "*")),
    3: ArithConfig(num_ops=5, max_operand=999, ops=("+", "-", "*")),
}


def resolve_config(difficulty: int, overrides: dict[str, Any] | None = None) -> ArithConfig:
    """The preset for `difficulty` with `overrides` (ArithConfig field -> value) applied."""
    return resolve_preset("arith", DIFFICULTIES, difficulty, overrides)


@dataclass(frozen=True)
class ArithTask:
    task_id: str
    prompt: str
    expression: str
    operands: tuple[int, ...]
    ops: tuple[str, ...]
    intermediates: tuple[int, ...]  # value after each operation; the last is the answer

    @property
    def answer(self) -> int:
        return self.intermediates[-1]

    def step_expressions(self) -> list[str]:
        """The one-operation expressions that compute each intermediate: ["3+4", "7*2", ...]."""
        prev = [str(self.operands[0])] + [str(v) for v in self.intermediates[:-1]]
        return [f"{p}{op}{b}" for p, op, b in zip(prev, self.ops, self.operands[1:])]


def generate(seed: int, config: ArithConfig) -> ArithTask:
    """The task for `seed` under `config` (same seed + config -> same task)."""
    rng = np.random.default_rng(seed)
    operands = tuple(
        int(x) for x in rng.integers(config.min_operand, config.max_operand + 1, config.num_ops + 1)
    )
    ops = tuple(str(config.ops[i]) for i in rng.integers(0, len(config.ops), config.num_ops))
    expr, value, inter = str(operands[0]), operands[0], []
    for i, (op, b) in enumerate(zip(ops, operands[1:])):
        expr = f"({expr}){op}{b}" if i > 0 else f"{expr}{op}{b}"
        value = _OPS[op](value, b)
        inter.append(value)
    return ArithTask(
        task_id=f"arith/{expr}",
        prompt=f"Compute {expr}.",
        expression=expr,
        operands=operands,
        ops=ops,
        intermediates=tuple(inter),
    )


def oracle_actions(task: ArithTask) -> list[str]:
    """The scripted perfect policy: one calc per operation, then answer."""
    calls = [format_tool_call("calc", {"expression": e}) for e in task.step_expressions()]
    return [*calls, format_tool_call("answer", {"value": task.answer})]
