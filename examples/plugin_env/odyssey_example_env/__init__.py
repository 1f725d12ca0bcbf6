"""Example Odyssey env plugin (see docs/envs.md)."""

from odyssey_example_env.env import WordCountEnv

__all__ = ["WordCountEnv"]
