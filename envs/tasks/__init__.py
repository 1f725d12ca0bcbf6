"""Deterministic task generators (pure Python, no sandbox) for the built-in envs, with difficulty
presets and scripted oracle policies."""
