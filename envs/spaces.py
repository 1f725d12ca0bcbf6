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


def _is_part(p: Any) -> bool:
    """A content part: {"type": "text", "text": str} or {"type": "image", "image": bytes | PreparedImage}."""
    if not isinstance(p, dict):
        return False
    if p.get("type") == "text":
        return isinstance(p.get("text"), str)
    if p.get("type") == "image":  # a PreparedImage is recognised by its fields: envs/ imports no model code
        img = p.get("image")
        return isinstance(img, bytes) or all(hasattr(img, a) for a in ("pixels", "png", "sha256", "grid"))
    return False


class ChatMessages(_TextSpace):
    """A list of chat messages `{"role": one of ROLES, "content": str}` (extra keys allowed). With
    `images=True` a content may also be a list of parts: `{"type": "text", "text": str}` and
    `{"type": "image", "image": bytes (encoded) | model.image.PreparedImage}` (envs/tool_result.py)."""

    def __init__(self, images: bool = False, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(seed=seed)
        self.images = bool(images)

    def _content_ok(self, c: Any) -> bool:
        if isinstance(c, str):
            return True
        return self.images and isinstance(c, list) and all(_is_part(p) for p in c)

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict) and m.get("role") in ROLES and self._content_ok(m.get("content")) for m in x
        )

    def __repr__(self) -> str:
        return f"ChatMessages(images={self.images})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.images == self.images

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, str]]:
        n = int(self.np_random.integers(1, 3))
        return [{"role": "tool", "content": f"sample {int(self.np_random.integers(1000))}"} for _ in range(n)]


class ChatText(_TextSpace):
    """One model turn: any string (the raw generated text, tool calls included)."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, str)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return f"sample text {int(self.np_random.integers(1000))}"
