"""Rollout: inference engines (engine.py, sampling.py), the multi-turn agent loop (agent_loop.py),
Ray rollout workers (worker.py) and `odyssey rollout` (cli.py, summary.py). See docs/quickstart.md."""
