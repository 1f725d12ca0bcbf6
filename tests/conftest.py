"""Shared fixtures. Heavy components are real (Docker, Ray, vLLM); their fixtures are session-scoped."""

from __future__ import annotations

import os

import pytest
import torch

pytest_plugins = ["tests.sandbox_fixtures"]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests use tiny shapes: one intra-op thread is faster on 2 shared cores and keeps results reproducible.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A real local Ray cluster for the whole test session, in its own temp dir."""
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    # Ray's socket paths must stay short (AF_UNIX limit ~107 bytes).
    short = f"/tmp/ray_odyssey_{os.getpid()}"
    os.makedirs(short, exist_ok=True)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=short,
        logging_level="WARNING",
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.getcwd()}},
    )
    yield tmp
    ray.shutdown()
