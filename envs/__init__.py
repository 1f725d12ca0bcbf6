"""Odyssey environments: `ToolEnv` + `@tool`, the tool-call protocol, the registry and built-in envs.

    import envs
    env = envs.make("arith", difficulty=0)
    messages, info = env.reset(seed=0)

See docs/envs.md for writing and registering your own env as a plugin.

Imports are lazy (PEP 562): `import envs` costs nothing, so `envs.trajectory` (the episode record that
rewards/ and rl/ import) stays a numpy-only leaf. The registry (built-ins, plugin discovery, the
`odyssey/<Name>-v0` gymnasium ids) loads on first use of `envs.make`, `envs.list_envs`, `envs.register`,
... or `import envs.registry`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ToolEnv": "envs.base",
    "EnvEntry": "envs.registry",
    "discover": "envs.registry",
    "list_envs": "envs.registry",
    "make": "envs.registry",
    "register": "envs.registry",
    "unregister": "envs.registry",
    "ToolError": "envs.tools",
    "ToolResult": "envs.tool_result",
    "tool": "envs.tools",
    "StepInfo": "envs.trajectory",
    "Trajectory": "envs.trajectory",
    "TurnSpan": "envs.trajectory",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'envs' has no attribute {name!r}")
