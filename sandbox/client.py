"""One shared Docker Engine client, with daemon errors turned into `SandboxUnavailable`.

The `docker` SDK talks HTTP to the daemon's unix socket through a `requests` connection pool.
One client per process is enough: requests' sessions are safe to share across threads as long as
the pool is large enough for the concurrency (`max_pool_size`), so we size it for many leases.
"""

from __future__ import annotations

import os
import threading

import docker
from docker.errors import DockerException

from sandbox.errors import SandboxUnavailable

#: the fix printed whenever the daemon does not answer
DAEMON_FIX = (
    "start the Docker daemon: as root `dockerd >/tmp/dockerd.log 2>&1 &` (or `sudo systemctl start docker`), "
    "or run `make setup`, which installs and starts it"
)

_lock = threading.Lock()
_client: docker.DockerClient | None = None
_client_pid = -1  # a forked child must not share the parent's sockets


def docker_client(max_pool_size: int = 64) -> docker.DockerClient:
    """The process-wide Docker client; `SandboxUnavailable` (naming the fix) when the daemon is down."""
    global _client, _client_pid
    with _lock:
        if _client is not None and _client_pid == os.getpid():
            return _client
        try:
            client = docker.from_env(max_pool_size=max_pool_size, timeout=60)
            client.ping()
        except DockerException as err:
            raise SandboxUnavailable(f"cannot reach the Docker daemon ({err}); {DAEMON_FIX}") from err
        except Exception as err:  # requests/urllib3 connection errors
            raise SandboxUnavailable(f"cannot reach the Docker daemon ({err}); {DAEMON_FIX}") from err
        _client, _client_pid = client, os.getpid()
        return client


def reset_client() -> None:
    """Forget the cached client (after the daemon restarted, or in a forked child process)."""
    global _client
    with _lock:
        if _client is not None:
            try:
                _client.close()
            except Exception:
                pass
        _client = None
