"""Rollout engines in one registry: `rollout.engine` names a factory, `build_engine` calls it.

    engine, tmp_dir = build_engine(settings, codec.decode)    # settings: rl.rollout.worker.WorkerSettings
    engine, tmp_dir = build_engine(settings, codec.decode, policy=model)   # serve a model in memory

Built-ins: "torch" (TorchEngine, rl/rollout/engine.py) and "vllm" (VllmEngine on the plugin,
rl/rollout/vllm_engine.py). A user's engine is `pkg.module:fn` with the factories' signature
(settings, detokenize, policy=None) -> (engine, temporary directory to delete on close, or None); the engine
implements rl.rollout.engine.InferenceEngine. This module imports nothing of the repo at load time but the
policy factory, so the config checks can look a name up.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from rl.policy import build_policy

EngineFactory = Callable[[Any, Callable[[list[int]], str], Any], tuple[Any, str | None]]


def torch_engine(
    settings: Any, detokenize: Callable[[list[int]], str], policy: Any = None
) -> tuple[Any, None]:
    """TorchEngine on `policy` (default: `rl.policy.build_policy(settings)`)."""
    from rl.rollout.engine import TorchEngine

    engine = TorchEngine(build_policy(settings) if policy is None else policy, detokenize=detokenize,
                         max_batch_size=settings.max_batch_size,
                         prefill_chunk_size=settings.prefill_chunk_size, seed=settings.seed)
    return engine, None


def vllm_engine(
    settings: Any, detokenize: Callable[[list[int]], str], policy: Any = None
) -> tuple[Any, str | None]:
    """VllmEngine on `settings.checkpoint`, or on the policy (`policy`, default a fresh
    `rl.policy.build_policy(settings)`) saved to a temporary directory first, so both engines start from
    the same weights."""
    from rl.rollout.vllm_engine import VllmEngine

    model_dir, tmp = (settings.checkpoint if policy is None else None), None
    if not model_dir:
        tmp = model_dir = tempfile.mkdtemp(prefix="odyssey-vllm-policy-")
        (build_policy(settings) if policy is None else policy).save_pretrained(model_dir)
    try:
        engine = VllmEngine(
            model_dir, detokenize=detokenize, seed=settings.seed, dtype=settings.dtype,
            max_num_seqs=settings.max_batch_size,
            max_num_batched_tokens=max(settings.prefill_chunk_size, settings.max_batch_size),
            # an episode never holds more than max_episode_tokens; +2: the flush and one spare position
            max_model_len=settings.episode.max_episode_tokens + 2,
        )
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return engine, tmp


# rollout.engine: a built-in name, or "pkg.module:fn" with the signature of these factories
ENGINES: dict[str, EngineFactory] = {"torch": torch_engine, "vllm": vllm_engine}


def engine_factory(name: str) -> EngineFactory:
    """The engine factory `name` names: a built-in (`ENGINES`) or `pkg.module:fn` with the same signature,
    (settings, detokenize, policy=None) -> (engine, temporary directory to delete on close, or None)."""
    from envs.dotted import builtin_or_dotted

    return builtin_or_dotted(name, ENGINES, "rollout engine",
                             "factory (signature: rl.rollout.engines.engine_factory)")  # fmt: skip


def build_engine(
    settings: Any, detokenize: Callable[[list[int]], str], policy: Any = None
) -> tuple[Any, str | None]:
    """The engine `settings.engine` names (every rollout engine is built here: workers, the warm-up's
    evaluation), by `engine_factory`. policy: a model in memory to serve (default: the factory builds
    `rl.policy.build_policy(settings)`). Returns (engine, temporary directory to delete on close, or None)."""
    return engine_factory(settings.engine)(settings, detokenize, policy)


__all__ = ["ENGINES", "EngineFactory", "build_engine", "engine_factory", "torch_engine", "vllm_engine"]
