"""The Odyssey policy: hybrid KDA / gated-MLA sparse-MoE causal LM (see docs/model.md).

Imports are lazy: ``import model`` costs nothing; ``model.OdysseyForCausalLM`` imports torch/transformers
on first use. Importing `model.modeling` (or touching `model.OdysseyForCausalLM`) registers the model with
transformers' AutoConfig / AutoModel / AutoModelForCausalLM (model_type "odyssey_moe").
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "OdysseyConfig": "model.config",
    "OdysseyForCausalLM": "model.modeling",
    "OdysseyModel": "model.modeling",
    "OdysseyOutput": "model.modeling",
    "OdysseyCache": "model.cache",
    "count_parameters": "model.count",
    "situ_glu": "model.activations",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")


def register_auto_classes() -> None:
    """Register OdysseyConfig / OdysseyForCausalLM with transformers' Auto classes (idempotent)."""
    importlib.import_module("model.modeling")
