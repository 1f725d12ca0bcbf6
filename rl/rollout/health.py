"""`InfraGuard`: stop a run when an env fails on most of a batch.

Episodes that end in an infra error (the env's own code raised, the sandbox died, the engine failed) are
stored and counted but never trained on: they say nothing about the policy. That is only sound while they
are rare. If one env fails on most of a batch, the episodes left over are a biased sample (say, only the
tasks on which the env happens not to crash, or only the turns that did not trigger an env bug the policy
has found), so the run must stop instead of training on them.

    guard = InfraGuard(max_fraction=cfg.rollout.max_infra_fraction)         # 0.5 = "most of the batch"
    guard.check(report.infra_by_env, planned={env_id: batch_size})          # raises BatchUnhealthy

The rule, per env e of the batch: stop when infra_e > max_fraction * planned_e. Infra counts only grow as
the batch proceeds, so `check` may be called on partial counts (a live progress poll) and stops the batch
as soon as the outcome is certain; calling it once at the end gives the same verdict. `odyssey rollout`
polls it while episodes run (exit code 3); the training loop calls it per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class BatchUnhealthy(RuntimeError):
    """An env failed on most of a batch; the message names the env, the counts and the fix."""


@dataclass(frozen=True)
class InfraGuard:
    """max_fraction: the largest share of one env's episodes in a batch that may end in infra errors
    (1.0 never stops)."""

    max_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in (0, 1], got {self.max_fraction!r}")

    def verdict(self, infra_by_env: Mapping[str, int], planned: Mapping[str, int]) -> str | None:
        """Why the batch must stop, or None. planned: episodes of each env in the whole batch."""
        for env_id, n in sorted(planned.items()):
            bad = int(infra_by_env.get(env_id, 0))
            if n > 0 and bad > self.max_fraction * n:
                return (
                    f"env {env_id!r} ended {bad} of the batch's {n} episodes with infrastructure errors "
                    f"(more than rollout.max_infra_fraction={self.max_fraction:g}); the rest would be a "
                    "biased sample, so the run stops"
                )
        return None

    def check(
        self,
        infra_by_env: Mapping[str, int],
        planned: Mapping[str, int],
        examples: Sequence[str] = (),
        by_source: Mapping[str, int] | None = None,
    ) -> None:
        """Raise BatchUnhealthy when `verdict` says so (with the failure sources and a few examples)."""
        why = self.verdict(infra_by_env, planned)
        if why is None:
            return
        if by_source:
            why += ". Sources: " + ", ".join(f"{k} {v}" for k, v in sorted(by_source.items()))
            if by_source.get("env"):
                why += " (env: the env's own code raised; fix the env, its inputs come from the policy)"
            if by_source.get("sandbox"):
                why += " (sandbox: check the Docker daemon and `odyssey sandbox ls`)"
        if examples:
            why += ". First errors: " + " | ".join(e[:300] for e in examples[:3])
        raise BatchUnhealthy(why)
