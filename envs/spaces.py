"""Gymnasium spaces for chat environments: observations are message lists, actions are free text."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import Space

ROLES = ("system", "user", "assistant", "tool")


class _TextSpace(Space):
    """A space of Python objects (no shape, no dtype, not flattenable to numpy); equal by type."""

    def __init__(self, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)


class ChatMessages(_TextSpace):
    """A list of chat messages `{"role": one of ROLES, "content": str}` (extra keys allowed)."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, str]]:
        n = int(self.np_random.integers(1, 3))
        return [{"role": "tool", "content": f"sample {int(self.np_random.integers(1000))}"} for _ in range(n)]


class ChatText(_TextSpace):
    """One model turn: any string (the raw generated text, tool calls included)."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, str)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return f"sample text {int(self.np_random.integers(1000))}"
