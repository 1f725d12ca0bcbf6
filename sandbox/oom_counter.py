"""`OomCounter`: how many processes the kernel's OOM killer has killed in one sandbox, read on the host.

The trusted side decides from this counter, not from anything printed, whether a lost command was the
policy's doing: if the sandbox's memory cgroup killed a process while the command ran, the agent filled the
memory (its failure, scored); if not, our machinery failed (an infrastructure error). Nothing inside the
container can change the counter except by actually running out of memory.

Where it comes from, first that answers:
    cgroup v1   /sys/fs/cgroup/memory/<path>/memory.oom_control   line "oom_kill N"
    cgroup v2   /sys/fs/cgroup/<path>/memory.events                line "oom_kill N"
    daemon      Docker's "oom" events of the container (a remote daemon, or a host whose cgroup files
                this process cannot read)

`<path>` is the container's cgroup as /proc/<its pid>/cgroup on the host names it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_oom_file(pid: int, root: Path = CGROUP_ROOT) -> Path | None:
    """The file holding the memory cgroup's `oom_kill` counter of host process `pid`, or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):  # v1: the memory hierarchy
            candidates.append(root / "memory" / rel / "memory.oom_control")
        elif controllers == "":  # v2: the unified hierarchy, mounted at the root or at unified/
            candidates += [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
    return next((c for c in candidates if read_oom_kills(c) is not None), None)


def read_oom_kills(path: Path) -> int | None:
    """The `oom_kill N` value of a memory.oom_control / memory.events file; None when absent/unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


class OomCounter:
    """The OOM-kill count of one container (docker-py low-level `api`, container id `cid`).

    `count()` never raises: when no source answers it returns None, and callers then treat a lost command
    as they would without this evidence (see `Sandbox._exec_bytes`).
    """

    def __init__(self, api: Any, cid: str) -> None:
        self._api, self._cid = api, cid
        self._file: Path | None = None
        self._resolved = False
        self._since = int(time.time()) - 1

    def count(self) -> int | None:
        if not self._resolved:
            self._resolved = True
            try:
                pid = int(self._api.inspect_container(self._cid)["State"]["Pid"] or 0)
            except Exception:
                pid = 0
            self._file = cgroup_oom_file(pid) if pid > 0 else None
        if self._file is not None:
            value = read_oom_kills(self._file)
            if value is not None:
                return value
        return self._daemon_events()

    def _daemon_events(self) -> int | None:
        """Docker's "oom" events of the container since it was created (a bounded, non-streaming query)."""
        try:
            events = self._api.events(
                since=self._since,
                until=int(time.time()),
                filters={"container": self._cid, "event": "oom"},
                decode=True,
            )
            return sum(1 for _ in events)
        except Exception:
            return None
