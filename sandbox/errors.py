"""Sandbox error classes.

Every class here means an *infrastructure* failure: the sandbox could not run the tool at all
(no daemon, no image, container died). They are distinct from a tool that simply fails — that is a
normal `ExecResult` with a non-zero `exit_code` and is the agent's business. Callers (envs, rollout)
catch `SandboxError`, end the episode with `infra_error=str(err)`, and never score it as the agent's
fault. Every message names the problem and the fix.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class: an infrastructure failure of the sandbox layer (never the agent's fault)."""


class SandboxUnavailable(SandboxError):
    """The sandbox cannot be created: Docker daemon down, image missing, build prerequisites missing."""


class SandboxCrashed(SandboxError):
    """A running sandbox died underneath a call: OOM-killed, exited, or removed by someone else.

    `reason` is a short machine-readable cause ("oom", "exited", "removed", ...).
    """

    def __init__(self, message: str, reason: str = "unknown") -> None:
        super().__init__(message)
        self.reason = reason
