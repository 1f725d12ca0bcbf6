"""Odyssey environments: `ToolEnv` + `@tool`, the tool-call protocol, the registry and built-in envs.

    import envs
    env = envs.make("arith", difficulty=0)
    messages, info = env.reset(seed=0)

See docs/envs.md for writing and registering your own env as a plugin.
"""

from envs.base import ToolEnv
from envs.registry import EnvEntry, discover, list_envs, make, register, unregister
from envs.tools import ToolError, tool

__all__ = [
    "EnvEntry",
    "ToolEnv",
    "ToolError",
    "discover",
    "list_envs",
    "make",
    "register",
    "tool",
    "unregister",
]
