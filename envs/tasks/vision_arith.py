"""Arithmetic tasks whose expression exists only in an image: `vision-arith` (envs/vision_arith.py).

The expression is arith's (envs/tasks/arith.py, same presets and seeds); the prompt never contains it. The
image is the expression rendered with the 5x7 bitmap font of `envs/sandbox_scripts/glyphs.py`, one
character per `cell` x `cell` cell, `cols` characters per line: with cell = the policy's patch size
(8 for the tiny preset) each character is one patch, and an image of at most 64 characters fits the tiny
preset's 64x64 pixel cap without resizing. The oracle looks, computes each step with calc, then answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from envs.sandbox_scripts import glyphs
from envs.tasks import arith
from envs.tasks.difficulty import resolve_preset
from envs.tool_call import format_tool_call

PROMPT = "Compute the value of the expression shown in the image. Call look to see it."


@dataclass(frozen=True)
class VisionArithConfig:
    """arith's ArithConfig fields plus the rendering: `cols` characters per line, `cell` pixels per character
    (a multiple of 8)."""

    num_ops: int = 1
    max_operand: int = 9
    min_operand: int = 0
    ops: tuple[str, ...] = ("+",)
    cols: int = 8
    cell: int = 8

    def __post_init__(self) -> None:
        self.arith()  # validates the arith fields
        glyphs.layout("0", self.cols, self.cell)  # validates cols and cell

    def arith(self) -> arith.ArithConfig:
        return arith.ArithConfig(self.num_ops, self.max_operand, self.min_operand, self.ops)


DIFFICULTIES: dict[int, VisionArithConfig] = {
    k: VisionArithConfig(**dataclasses.asdict(c)) for k, c in arith.DIFFICULTIES.items()
}


def resolve_config(difficulty: int, overrides: dict[str, Any] | None = None) -> VisionArithConfig:
    """The preset for `difficulty` (arith's levels 0-3) with `overrides` applied."""
    return resolve_preset("vision-arith", DIFFICULTIES, difficulty, overrides)


@dataclass(frozen=True)
class VisionArithTask:
    task_id: str
    prompt: str
    expression: str
    intermediates: tuple[int, ...]
    steps: tuple[str, ...]  # one-operation expressions computing each intermediate
    cols: int
    cell: int

    @property
    def answer(self) -> int:
        return self.intermediates[-1]

    def image(self, blank: bool = False) -> bytes:
        """The PNG of the expression (`blank`: a white image of the same size)."""
        return glyphs.render_png(self.expression, self.cols, self.cell, blank=blank)


def generate(seed: int, config: VisionArithConfig) -> VisionArithTask:
    """The task for `seed` (the same expression as arith's task for this seed and config)."""
    t = arith.generate(seed, config.arith())
    return VisionArithTask(
        task_id=f"vision-arith/{t.expression}",
        prompt=PROMPT,
        expression=t.expression,
        intermediates=t.intermediates,
        steps=tuple(t.step_expressions()),
        cols=config.cols,
        cell=config.cell,
    )


def oracle_actions(task: VisionArithTask) -> list[str]:
    """The scripted perfect policy: look, one calc per operation, then answer."""
    calls = [format_tool_call("calc", {"expression": e}) for e in task.steps]
    return [format_tool_call("look", {}), *calls, format_tool_call("answer", {"value": task.answer})]
