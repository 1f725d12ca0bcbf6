"""Difficulty presets shared by the task generators: a preset per level plus field overrides."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


def resolve_preset(
    env_name: str, presets: dict[int, C], difficulty: int, overrides: dict[str, Any] | None = None
) -> C:
    """`presets[difficulty]` (a frozen dataclass) with `overrides` (field -> value) applied.

    List values for tuple-typed fields become tuples, so YAML lists work. Unknown levels or fields raise
    a ValueError that names the valid ones.
    """
    if difficulty not in presets:
        raise ValueError(f"{env_name} difficulty must be one of {sorted(presets)}, got {difficulty}")
    base = presets[difficulty]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise ValueError(f"unknown {env_name} config field(s) {unknown}; valid: {sorted(fields)}")
    fixed = {
        k: tuple(v) if isinstance(getattr(base, k), tuple) and isinstance(v, list) else v
        for k, v in (overrides or {}).items()
    }
    return dataclasses.replace(base, **fixed)
