"""pytest plugin with the Docker sandbox fixtures. Load it from tests/conftest.py:

    pytest_plugins = ["tests.sandbox_fixtures"]

Fixtures (all session-scoped; a test using any of them must be marked `@pytest.mark.docker`):
    sandbox_leak_check  records the Odyssey containers (label odyssey.sandbox=1) present at session start and,
                        at session end, fails if any container created during the session by this process (or
                        by a subprocess registered with `.track_pid(pid)`) is still there.
    docker_sandbox      a reachable daemon + the sandbox image (returns the image tag). Without them the test
                        is skipped with the reason and the fix; with ODYSSEY_REQUIRE_DOCKER=1 (CI) it fails.
    sandbox_pool        a started `SandboxPool(size=2, limits=TEST_LIMITS)` shared by the session.
"""

from __future__ import annotations

import bisect
import os
import time

import pytest

#: small limits so bombs hit them fast; used by the sandbox tests and the session pool
TEST_LIMITS_KW = dict(
    memory="256m", cpus=1.0, pids=128, work_size="64m", tmp_size="16m", fsize="16m", output_bytes=64 << 10
)


#: (unix time, node id) of every test this session started, in order: names the test that made a leaked
#: container (the last one started before the container's creation time)
TEST_STARTS: list[tuple[float, str]] = []


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    TEST_STARTS.append((time.time(), nodeid))


def running_test_at(t: float) -> str:
    """The test that was running at unix time `t` ('before any test' when none had started)."""
    i = bisect.bisect_right(TEST_STARTS, (t, chr(0x10FFFF))) - 1
    return TEST_STARTS[i][1] if i >= 0 else "before any test"


class LeakCheck:
    def __init__(self, before: set[str]) -> None:
        self.before = before
        self.pids = {os.getpid()}

    def track_pid(self, pid: int) -> None:
        """Count containers owned by `pid` (a subprocess of this session) in the end-of-session check."""
        self.pids.add(pid)

    def leaked(self) -> list:
        from sandbox.reaper import list_sandboxes

        return [i for i in list_sandboxes() if i.id not in self.before and i.owner_pid in self.pids]


@pytest.fixture(scope="session")
def sandbox_leak_check():
    """Count Odyssey containers by label before and after the session; fail on any this session left."""
    from sandbox.errors import SandboxError
    from sandbox.reaper import list_sandboxes

    try:
        before = {i.id for i in list_sandboxes()}
    except SandboxError:
        before = set()  # no daemon: docker_sandbox skips/fails with the reason
    check = LeakCheck(before)
    yield check
    try:
        leaked = check.leaked()
    except SandboxError:
        return
    assert not leaked, (
        f"{len(leaked)} sandbox container(s) left behind by this test session "
        f"(present before: {len(before)}), with the test that was running when each was created: "
        f"{[(i.name, i.status, i.owner_pid, running_test_at(i.created)) for i in leaked]}"
    )


@pytest.fixture(scope="session")
def docker_sandbox(sandbox_leak_check) -> str:
    """The sandbox image tag, once the daemon answers and the image exists (else skip, or fail in CI)."""
    from sandbox.errors import SandboxError
    from sandbox.image import DEFAULT_IMAGE, image_exists

    problem = None
    try:
        if not image_exists(DEFAULT_IMAGE):
            problem = (
                f"sandbox image {DEFAULT_IMAGE} is missing: run `make setup` (or `odyssey sandbox build`)"
            )
    except SandboxError as err:
        problem = str(err)
    if problem:
        if os.environ.get("ODYSSEY_REQUIRE_DOCKER") == "1":
            pytest.fail(f"ODYSSEY_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)
    return DEFAULT_IMAGE


@pytest.fixture(scope="session")
def sandbox_pool(docker_sandbox):
    """A started SandboxPool(size=2) with the test limits for the whole session; closed at the end."""
    from sandbox.container import SandboxLimits
    from sandbox.pool import SandboxPool

    pool = SandboxPool(size=2, image=docker_sandbox, limits=SandboxLimits(**TEST_LIMITS_KW))
    pool.start_sync()
    yield pool
    pool.close_sync()
