"""Reward functions as a TRL user already has them (TRL's signature), for configs/quickstart.yaml.

    rewards:
      - {name: examples.quickstart.rewards:numeric_match, weight: 1.0}

Odyssey calls a function in TRL's form with `prompts`, `completions`, `completion_ids` and every other
dataset column by name (here `answer` and `level`), one list entry per episode (docs/rewards.md).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the answer column, else 0.0."""
    out = []
    for text, truth in zip(completions, answer):
        numbers = _NUMBER.findall(text if isinstance(text, str) else text[-1]["content"])
        out.append(float(bool(numbers) and float(numbers[-1]) == float(truth)))
    return out


def brevity(completion_ids: list[list[int]], max_tokens: int = 32, **kwargs) -> list[float]:
    """-0.01 per completion token beyond `max_tokens` (a YAML param)."""
    return [-0.01 * max(0, len(ids) - max_tokens) for ids in completion_ids]
