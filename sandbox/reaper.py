"""The reaper: removes Odyssey sandbox containers that nobody will ever close.

Every sandbox carries labels naming its owner (see `sandbox.container.owner_labels`):
    odyssey.sandbox=1, odyssey.owner_pid, odyssey.owner_host, odyssey.owner_start (the pid's start time in
    clock ticks since boot, so a recycled pid is not mistaken for the owner), odyssey.created, odyssey.ttl_s.

A container is reaped when
    its owner ran on this host and that process is gone (or the pid now belongs to another process), or
    it is older than its TTL (whoever owns it; covers owners on other hosts sharing the daemon).

`reap()` runs at every pool start, periodically in a background thread (`start_background_reaper`, every
60 s in any live pool's process), at the start of every `odyssey` run command (`reap_quietly`, from
rl/cli.py), on `odyssey sandbox gc`, and in the test session's leak check. So a SIGKILLed process — which
runs no atexit or finally — leaks its containers only until the first of: the next reaper round of any
live pool on the host (<= 60 s), the next `odyssey` run or `odyssey sandbox gc`, or the container's TTL
(6 h by default), whichever comes first.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from docker.errors import APIError, DockerException, NotFound

from sandbox.client import docker_client
from sandbox.errors import SandboxError

log = logging.getLogger(__name__)
LABEL = "odyssey.sandbox=1"


@dataclass(frozen=True)
class SandboxInfo:
    """One Odyssey container as the daemon lists it."""

    id: str
    name: str
    status: str  # Docker state: running, exited, created, ...
    owner_pid: int
    owner_host: str
    owner_start: str
    created: float  # unix time
    ttl_s: float
    owner_alive: bool | None  # None: owner on another host, cannot tell

    @property
    def age_s(self) -> float:
        return time.time() - self.created

    @property
    def expired(self) -> bool:
        return self.age_s > self.ttl_s

    @property
    def reapable(self) -> bool:
        return self.owner_alive is False or self.expired


def process_start_ticks(pid: int) -> str:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); '' when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_alive(pid: int, host: str, start: str = "") -> bool | None:
    """Is the owning process still running? None when it ran on another host."""
    if host != socket.gethostname():
        return None
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    if start and os.path.isdir("/proc"):
        now = process_start_ticks(pid)
        if now and now != start:
            return False  # the pid was recycled by a different process
    return True


def _to_info(row: dict) -> SandboxInfo:
    labels = row.get("Labels") or {}

    def num(key: str, default: float) -> float:
        try:
            return float(labels.get(key, default))
        except ValueError:
            return default

    pid, host, start = (
        int(num("odyssey.owner_pid", -1)),
        labels.get("odyssey.owner_host", ""),
        labels.get("odyssey.owner_start", ""),
    )
    return SandboxInfo(
        id=row["Id"],
        name=(row.get("Names") or ["/?"])[0].lstrip("/"),
        status=row.get("State", "?"),
        owner_pid=pid,
        owner_host=host,
        owner_start=start,
        created=num("odyssey.created", float(row.get("Created", 0))),
        ttl_s=num("odyssey.ttl_s", 6 * 3600),
        owner_alive=owner_alive(pid, host, start),
    )


def list_sandboxes() -> list[SandboxInfo]:
    """Every container labelled `odyssey.sandbox=1` on the daemon (running or not)."""
    try:
        rows = docker_client().api.containers(all=True, filters={"label": LABEL})
    except (APIError, DockerException) as err:
        raise SandboxError(f"cannot list sandbox containers: {err}") from err
    return [_to_info(r) for r in rows]


def remove_container(container_id: str) -> bool:
    """Force-remove; True when removed here, False when already gone or being removed by someone else."""
    try:
        docker_client().api.remove_container(container_id, force=True, v=True)
        return True
    except NotFound:
        return False
    except APIError as err:
        if err.status_code == 409:  # removal already in progress
            return False
        raise


def reap(everything: bool = False) -> list[str]:
    """Remove reapable sandbox containers (all of them with `everything`); returns the removed names."""
    removed = []
    for info in list_sandboxes():
        if everything or info.reapable:
            why = "all" if everything else ("owner gone" if info.owner_alive is False else "ttl passed")
            if remove_container(info.id):
                log.info(
                    "reaped sandbox %s (%s, owner %s:%d)", info.name, why, info.owner_host, info.owner_pid
                )
                removed.append(info.name)
    return removed


def reap_quietly() -> list[str]:
    """`reap()` for the start of a run: [] (and a debug log line) when the daemon cannot be reached, since
    a run that needs no sandbox must not fail here, and one that does reports the daemon itself."""
    try:
        removed = reap()
    except (SandboxError, DockerException, APIError, OSError) as err:
        log.debug("sandbox reaper skipped: %s", err)
        return []
    if removed:
        log.warning("reaped %d sandbox container(s) of dead owners: %s", len(removed), " ".join(removed))
    return removed


class _BackgroundReaper(threading.Thread):
    def __init__(self, interval_s: float) -> None:
        super().__init__(name="odyssey-sandbox-reaper", daemon=True)
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.runs = 0
        self.owner_pid = os.getpid()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                reap()
            except Exception as err:  # daemon briefly down: try again next round
                log.warning("sandbox reaper run failed: %s", err)
            self.runs += 1


_reaper: _BackgroundReaper | None = None
_reaper_lock = threading.Lock()


def start_background_reaper(interval_s: float = 60.0) -> None:
    """Run `reap()` every `interval_s` seconds in a daemon thread (one per process; idempotent).

    A later call with a shorter interval shortens it.
    """
    global _reaper
    with _reaper_lock:
        if _reaper is not None and _reaper.is_alive() and _reaper.owner_pid == os.getpid():
            _reaper.interval_s = min(_reaper.interval_s, interval_s)
            return
        _reaper = _BackgroundReaper(interval_s)
        _reaper.start()


def stop_background_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is not None:
            _reaper.stop_event.set()
            _reaper = None
