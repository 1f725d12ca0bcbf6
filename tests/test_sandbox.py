"""Docker sandboxes against a real daemon: hardening, exec semantics, pool, reaper, no leaks.

Every attack test ends by checking that the host and the pool are still fine (`_assert_host_and_pool_fine`).
Fixtures come from tests/sandbox_fixtures.py (session pool, leak check by label before/after the session).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sandbox.client import docker_client
from sandbox.container import Sandbox, SandboxLimits
from sandbox.errors import SandboxCrashed, SandboxUnavailable
from sandbox.pool import SandboxPool
from sandbox.reaper import list_sandboxes, reap
from tests.sandbox_fixtures import TEST_LIMITS_KW

pytestmark = pytest.mark.docker
LIMITS = SandboxLimits(**TEST_LIMITS_KW)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assert_host_and_pool_fine(pool: SandboxPool) -> None:
    """The host can still spawn processes, the daemon answers, and the pool hands out a working sandbox."""
    assert subprocess.run(["true"]).returncode == 0
    assert docker_client().ping()
    with pool.lease_sync() as sb:
        res = sb.exec("echo fine")
        assert (res.exit_code, res.stdout) == (0, "fine\n")


_PS = """
import os
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").replace(b"\\n", b" ")
        cmd = cmd.decode().strip()
    except OSError:
        continue
    if "odyssey-exec-supervisor" not in cmd and cmd and cmd != "runc init":
        print(cmd)
"""


def _processes(sb: Sandbox) -> list[str]:
    """Command lines of every process in the sandbox except this listing and the exec supervisor."""
    return sorted(sb.exec(["python3", "-c", _PS]).stdout.splitlines())


IDLE = ["/sbin/docker-init -- sleep infinity", "sleep infinity"]


def _basics(sb: Sandbox) -> None:
    """Exec semantics every exec path must satisfy."""
    res = sb.exec("echo out; echo err >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out, res.truncated) == (
        3,
        "out\n",
        "err\n",
        False,
        False,
    )
    assert res.duration_s > 0
    assert (
        sb.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"]).stdout
        == "['a b', '$HOME']\n"
    )
    assert sb.exec("no-such-command").exit_code == 127
    assert sb.exec("pwd; id -u; echo $HOME").stdout == "/work\n1000\n/work\n"
    assert sb.exec("echo $X; pwd", env={"X": "42"}, cwd="/tmp").stdout == "42\n/tmp\n"
    assert sb.exec("tr a-z A-Z", stdin=b"hello").stdout == "HELLO"
    assert sb.exec("wc -c", stdin=b"x" * 3_000_000).stdout.strip() == "3000000"  # stdin larger than pipes
    assert sb.exec("head -c 3", stdin=b"y" * 3_000_000).stdout == "yyy"  # command stops reading early
    bg = sb.exec("sleep 30 & echo started")  # a background job holding stdout must not stall the call
    assert bg.stdout == "started\n" and bg.duration_s < 2
    assert sb.exec("pwd", cwd="/nope").exit_code == 126
    with pytest.raises(ValueError, match="timeout_s"):
        sb.exec("true", timeout_s=0)
    with pytest.raises(ValueError, match="NUL"):
        sb.exec(["echo", "a\0b"])
    with pytest.raises(ValueError, match="environment variable"):
        sb.exec("true", env={"A=B": "1"})


def test_exec_basics(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:  # the exec supervisor started with the container (the default)
        _basics(sb)
    with Sandbox(sandbox_pool.image, LIMITS, prespawn=False) as sb:  # started by the first call
        assert sb._chan_future is None and sb._chan is None
        _basics(sb)
    _assert_host_and_pool_fine(sandbox_pool)


def test_image_smoke(sandbox_pool) -> None:
    """The image's build-time smoke command (python3 runs, as uid 1000, /work writable), in a hardened
    sandbox; the build itself only runs it in a plain `docker run` (sandbox/image.py)."""
    from sandbox.image import SMOKE_COMMAND, SMOKE_OUTPUT

    with sandbox_pool.lease_sync() as sb:
        res = sb.exec(SMOKE_COMMAND)
        assert res.exit_code == 0 and res.stdout.split() == SMOKE_OUTPUT, res
        assert sb.exec("test -f /work/ok").exit_code == 0


def test_agent_cannot_kill_the_sandbox_and_no_command_runs_twice(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        assert sb.exec("kill -9 1").exit_code != 0  # pid 1 (docker-init) and sleep belong to root
        assert "Uid:\t0" in sb.exec("cat /proc/1/status").stdout
        for _ in range(3):  # kills every agent process; the supervisor (root) is out of reach
            sb.exec("kill -9 -1")
            res = sb.exec("echo once >> /work/count; wc -l < /work/count")
            assert res.exit_code == 0
        assert sb.exec("cat /work/count").stdout == "once\n" * 3  # the retried call ran exactly once
        assert sb.is_alive()
    _assert_host_and_pool_fine(sandbox_pool)


def test_infinite_loop_times_out_and_its_process_tree_is_gone(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        cmd = "sleep 301 & (sleep 302 &); setsid sleep 303 & python3 -c 'while True: pass'"
        t0 = time.monotonic()
        res = sb.exec(cmd, timeout_s=1.5)
        elapsed = time.monotonic() - t0
        assert res.timed_out and res.exit_code == 137
        assert elapsed < 1.5 + 1.0, f"timeout took {elapsed:.2f} s"
        assert _processes(sb) == IDLE
        assert sb.exec("echo still usable").stdout == "still usable\n"
    _assert_host_and_pool_fine(sandbox_pool)


def test_fork_bomb_is_contained(sandbox_pool) -> None:
    api = docker_client().api
    with sandbox_pool.lease_sync() as sb:
        # a foreground bomb: the timeout kills its process group, the sandbox recovers
        bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
        res = sb.exec(["python3", "-c", bomb], timeout_s=3)
        assert res.timed_out
        assert sb.exec("echo recovered").stdout == "recovered\n"
        # the classic shell bomb detaches into the background: it stays capped by pids_limit
        sb.exec(":(){ :|:& };:", timeout_s=3)
        time.sleep(1.0)
        pids = api.stats(sb.id, stream=False)["pids_stats"].get("current", 0)
        assert 0 < pids <= LIMITS.pids
        assert subprocess.run(["true"]).returncode == 0  # host still forks
        # while it churns, a command either starts or fails with 126 and a message; never an infra error
        for r in [sb.exec("echo maybe", timeout_s=3) for _ in range(3)]:
            assert (r.exit_code, r.stdout) == (0, "maybe\n") or (
                r.exit_code == 126 and "process limit" in r.stderr
            ), r
    with sandbox_pool.lease_sync() as sb:
        # a table kept full (a detached filler that takes every free slot): commands fail with 126
        fill = textwrap.dedent(
            """
            import os, time
            while True:
                try:
                    if os.fork() == 0:
                        time.sleep(600)
                        os._exit(0)
                except OSError:
                    time.sleep(0.005)
            """
        )
        sb.exec(["bash", "-c", 'setsid python3 -c "$1" >/dev/null 2>&1 &', "fill", fill])
        time.sleep(1.0)
        full = [sb.exec("echo never", timeout_s=3) for _ in range(3)]
        assert all(r.exit_code == 126 and "process limit" in r.stderr for r in full), full
    _assert_host_and_pool_fine(sandbox_pool)  # the bombed container was removed, a fresh one works


def test_memory_bomb_is_reported(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        try:
            res = sb.exec(["python3", "-c", "x = bytearray(1 << 30); print(len(x))"], timeout_s=20)
        except SandboxCrashed as err:  # the whole container was killed: also a correct outcome
            assert err.reason in ("oom", "exited")
        else:
            assert res.oom_killed and res.exit_code == 137 and not res.timed_out
            assert sb.exec("echo alive").stdout == "alive\n"
    _assert_host_and_pool_fine(sandbox_pool)


def test_network_is_unreachable(sandbox_pool) -> None:
    probe = textwrap.dedent(
        """
        import os, socket
        print(sorted(os.listdir('/sys/class/net')))
        for host, port in [('172.17.0.1', 2375), ('1.1.1.1', 53), ('10.0.0.1', 80)]:
            try:
                socket.create_connection((host, port), timeout=2)
                print('CONNECTED', host)
            except OSError as err:
                print('blocked', err.errno)
        try:
            socket.getaddrinfo('deb.debian.org', 80)
            print('RESOLVED')
        except OSError:
            print('no dns')
        """
    )
    with sandbox_pool.lease_sync() as sb:
        out = sb.exec(["python3", "-c", probe], timeout_s=15).stdout
        assert out.splitlines()[0] == "['lo']"
        assert "CONNECTED" not in out and "RESOLVED" not in out and out.count("blocked") == 3, out
    _assert_host_and_pool_fine(sandbox_pool)


def test_output_flood_is_truncated_at_the_cap(sandbox_pool) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with sandbox_pool.lease_sync() as sb:
        t0 = time.monotonic()
        res = sb.exec("head -c 100000000 /dev/zero | tr '\\0' a; echo done >&2", timeout_s=30)
        took = time.monotonic() - t0
        assert res.exit_code == 0 and not res.timed_out and res.truncated
        assert len(res.stdout) == LIMITS.output_bytes and set(res.stdout) == {"a"}
        assert res.stderr == "done\n"
        assert took < 15, f"a 100 MB flood took {took:.1f} s"
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mb < 50, f"host memory peak grew by {grown_mb:.0f} MB while reading a capped flood"
    _assert_host_and_pool_fine(sandbox_pool)


def test_writes_outside_work_fail_and_work_is_bounded(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        for target in ("/etc/x", "/x", "/usr/bin/x", "/var/tmp/x", "/root/x"):
            assert sb.exec(f"echo pwn > {target}").exit_code != 0, target
            with pytest.raises(PermissionError):
                sb.write_file(target, b"pwn")
        assert sb.exec("mkdir /opt/x").exit_code != 0
        sb.write_file("ok.txt", b"fine")  # relative paths land in /work
        assert sb.read_file("/work/ok.txt") == b"fine"
        assert sb.exec("echo t > /tmp/t && cat /tmp/t").stdout == "t\n"
        # RLIMIT_FSIZE: a single file larger than limits.fsize is cut off (SIGXFSZ)
        big = sb.exec("head -c 40000000 /dev/zero > /work/big")
        assert big.exit_code != 0
        assert int(sb.exec("stat -c %s /work/big").stdout) <= 16 * 2**20
        # tmpfs size: /work as a whole is bounded by limits.work_size
        fill = sb.exec("for i in 1 2 3 4 5 6; do head -c 15000000 /dev/zero > /work/f$i || exit 1; done")
        assert fill.exit_code != 0 and "No space left" in fill.stderr
    _assert_host_and_pool_fine(sandbox_pool)


def test_privilege_escalation_fails(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        status = sb.exec("grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status").stdout
        assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
        assert "NoNewPrivs:\t1" in status
        assert sb.exec("ls -l /usr/bin/su").stdout.startswith("-rws")  # the setuid binary is there...
        assert sb.exec("su -c id root </dev/null").exit_code != 0  # ...and cannot make us root
        assert sb.exec("mount -t tmpfs none /work").exit_code != 0  # setuid mount, no CAP_SYS_ADMIN
        assert sb.exec(["python3", "-c", "import os; os.setuid(0)"]).exit_code != 0
        assert sb.exec("touch /work/f && chown root /work/f").exit_code != 0
        assert sb.exec("cat /etc/shadow").exit_code != 0
        assert sb.exec("echo 'agent ALL=(ALL) ALL' >> /etc/sudoers").exit_code != 0
        assert sb.exec("unshare -r id").exit_code != 0  # no user namespaces to gain caps in
        assert sb.exec("id -u").stdout == "1000\n"
    _assert_host_and_pool_fine(sandbox_pool)


def test_binary_files_round_trip(sandbox_pool) -> None:
    data = bytes(range(256)) * 4096 + os.urandom(1 << 18)  # every byte value, ~1.3 MB
    with sandbox_pool.lease_sync() as sb:
        sb.write_file("sub/dir/blob.bin", data, mode=0o600)
        assert sb.read_file("sub/dir/blob.bin") == data
        inside = sb.exec("sha256sum /work/sub/dir/blob.bin; stat -c %a /work/sub/dir/blob.bin").stdout.split()
        assert inside[0] == hashlib.sha256(data).hexdigest() and inside[-1] == "600"
        sb.write_file("empty", b"")
        assert sb.read_file("empty") == b""
        with pytest.raises(FileNotFoundError):
            sb.read_file("/work/nope")
    _assert_host_and_pool_fine(sandbox_pool)


def test_eight_sandboxes_run_concurrently(sandbox_pool) -> None:
    async def episode(pool: SandboxPool, i: int) -> tuple[str, float]:
        async with pool.lease() as sb:
            await sb.awrite_file("me.txt", str(i).encode())
            res = await sb.aexec("sleep 1; cat me.txt; ls /work")
            return res.stdout, res.duration_s

    async def main() -> list[tuple[str, float]]:
        pool = SandboxPool(size=8, limits=LIMITS)
        await pool.start()
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(*(episode(pool, i) for i in range(8)))
            wall = time.monotonic() - t0
        finally:
            await pool.close()
        assert wall < 8 * 1.0, f"8 x 1 s episodes took {wall:.1f} s: not concurrent"
        return results

    results = asyncio.run(main())
    assert [r[0] for r in results] == [f"{i}me.txt\n" for i in range(8)]  # isolated /work each
    _assert_host_and_pool_fine(sandbox_pool)


def test_lease_is_fresh_health_checked_and_removed(sandbox_pool) -> None:
    with sandbox_pool.lease_sync() as sb:
        sb.write_file("dirty", b"1")
        first = sb.id
    with sandbox_pool.lease_sync() as sb2:
        assert sb2.id != first and sb2.exec("ls /work").stdout == ""
    deadline = time.monotonic() + 10
    while any(i.id == first for i in list_sandboxes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(i.id == first for i in list_sandboxes()), "a released container was not removed"
    # a warm container killed behind the pool's back is replaced, never handed out
    with sandbox_pool._cv:
        victim = sandbox_pool._ready[0] if sandbox_pool._ready else None
    if victim is None:
        sandbox_pool.start_sync()  # refill and wait
        victim = sandbox_pool._ready[0]
    docker_client().api.kill(victim.id)
    unhealthy0 = sandbox_pool.stats["unhealthy"]
    for _ in range(2):
        with sandbox_pool.lease_sync() as sb:
            assert sb.id != victim.id and sb.exec("true").exit_code == 0
    assert sandbox_pool.stats["unhealthy"] == unhealthy0 + 1
    _assert_host_and_pool_fine(sandbox_pool)


def test_cancelled_lease_leaks_nothing(sandbox_pool) -> None:
    async def main() -> str:
        holder: dict[str, str] = {}

        async def hold() -> None:
            async with sandbox_pool.lease() as sb:
                holder["id"] = sb.id
                await asyncio.sleep(30)

        task = asyncio.create_task(hold())
        while "id" not in holder:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return holder["id"]

    cid = asyncio.run(main())
    deadline = time.monotonic() + 10
    while any(i.id == cid for i in list_sandboxes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(i.id == cid for i in list_sandboxes())
    _assert_host_and_pool_fine(sandbox_pool)


def test_dead_container_raises_sandbox_crashed(docker_sandbox) -> None:
    sb = Sandbox(docker_sandbox, LIMITS)
    try:
        docker_client().api.kill(sb.id)
        with pytest.raises(SandboxCrashed) as info:
            sb.exec("true")
        assert info.value.reason == "exited" and "not running" in str(info.value)
        assert not sb.is_alive()
    finally:
        sb.close()
    sb2 = Sandbox(docker_sandbox, LIMITS)
    docker_client().api.remove_container(sb2.id, force=True)
    with pytest.raises(SandboxCrashed) as info:
        sb2.exec("true")
    assert info.value.reason == "removed"
    sb2.close()  # idempotent on a vanished container


def test_missing_image_is_unavailable_with_the_fix(docker_sandbox) -> None:
    with pytest.raises(SandboxUnavailable, match="make setup"):
        Sandbox("odyssey-sandbox:does-not-exist")
    with pytest.raises(SandboxUnavailable, match="odyssey sandbox build"):
        SandboxPool(1, image="odyssey-sandbox:does-not-exist").start_sync()


_HOLDER = """
import sys, time
from sandbox.container import SandboxLimits
from sandbox.pool import SandboxPool
pool = SandboxPool(1, limits=SandboxLimits(memory="96m", work_size="16m", tmp_size="8m", shm_size="4m"))
pool.start_sync()
sb = pool.acquire_sync()
print(sb.id, flush=True)
time.sleep(600)
"""


def test_sigkilled_owner_leaks_nothing_after_the_reaper(sandbox_leak_check, docker_sandbox) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sandbox_leak_check.track_pid(proc.pid)
    try:
        leased_id = proc.stdout.readline().strip()
        assert leased_id, "the holder process did not start"
        deadline = time.monotonic() + 20
        owned = []
        while time.monotonic() < deadline:  # the leased one plus its warm replacement
            owned = [i for i in list_sandboxes() if i.owner_pid == proc.pid]
            if len(owned) >= 2:
                break
            time.sleep(0.1)
        assert len(owned) >= 2 and leased_id in {i.id for i in owned}
        assert all(i.owner_alive for i in owned) and not any(i.reapable for i in owned)
    finally:
        proc.send_signal(signal.SIGKILL)  # no finally, no atexit: only the reaper can clean up
        proc.wait()
    assert all(i.reapable for i in list_sandboxes() if i.owner_pid == proc.pid)
    removed = reap()
    assert {i.name for i in owned} <= set(removed)
    assert not [i for i in list_sandboxes() if i.owner_pid == proc.pid]


def test_pool_reports_an_image_that_vanished(docker_sandbox) -> None:
    tag = "odyssey-sandbox:test-vanishing"
    images = docker_client().images
    images.get(docker_sandbox).tag(tag)
    pool = SandboxPool(1, image=tag, limits=LIMITS, acquire_timeout_s=60)
    try:
        pool.start_sync()
        images.remove(tag)  # untag only: the default image keeps the layers
        with pool.lease_sync() as sb:  # the warm one still works
            assert sb.exec("true").exit_code == 0
        t0 = time.monotonic()
        with pytest.raises(SandboxUnavailable, match="make setup"):
            pool.acquire_sync()  # its replacement cannot be created: a clear error, not a 60 s hang
        assert time.monotonic() - t0 < 30
    finally:
        pool.close_sync()
        if any(tag in img.tags for img in images.list(name="odyssey-sandbox")):
            images.remove(tag)


def test_the_next_odyssey_run_reaps_a_sigkilled_owner(sandbox_leak_check, docker_sandbox) -> None:
    """No live pool anywhere, no `sandbox gc`: the start of the next `odyssey rollout` reclaims the leases
    (even one that then fails on its config)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sandbox_leak_check.track_pid(proc.pid)
    try:
        assert proc.stdout.readline().strip(), "the holder process did not start"
        deadline = time.monotonic() + 20
        while len([i for i in list_sandboxes() if i.owner_pid == proc.pid]) < 2:  # + its warm replacement
            assert time.monotonic() < deadline, "the holder's pool did not refill"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(
        [sys.executable, "-m", "rl.cli", "rollout", "/nonexistent/config.yaml"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "no such config file" in run.stderr, run.stderr[-2000:]
    assert not [i for i in list_sandboxes() if i.owner_pid == proc.pid]


# ---- memory the agent can pin beyond the OOM killer's reach; escapes from the timeout; file-type tricks ----

#: Fills every mount the agent can write to (found in /proc/self/mountinfo, not assumed): first data up to
#: the mount's size (files of at most RLIMIT_FSIZE each), then, with argv[3] == "files", empty files with
#: 255-byte names until the kernel refuses an inode, or with "xattrs", user xattrs of 1000 bytes (the most
#: memory per KiB of tmpfs inode space) until the inode space is gone; then attaches a System V segment of
#: argv[1] bytes and, with argv[2] == "hold", sleeps holding it. Prints {mount: [data MiB, files, xattrs]}
#: and the memory cgroup's usage in MiB.
FLOODER = r"""
import ctypes, errno, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
mounts = []
for line in open("/proc/self/mountinfo"):
    mp = line.split()[4]
    try:
        p = os.path.join(mp, ".probe")
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(p)
        mounts.append(mp)
    except OSError:
        pass
got = {}
for mp in mounts:
    data = files = xattrs = 0
    for i in range(64):
        try:
            with open(f"{mp}/data{i}", "wb") as f:
                while True:
                    f.write(b"d" * (1 << 20))
                    data += 1
        except OSError as err:
            if err.errno != errno.EFBIG:  # a file at RLIMIT_FSIZE: go on with the next one
                break
    try:
        while sys.argv[3] == "files" and files < 300000:
            os.close(os.open(f"{mp}/{files:08d}" + "n" * 247, os.O_WRONLY | os.O_CREAT, 0o600))
            files += 1
    except OSError:
        pass
    try:
        while sys.argv[3] == "xattrs" and xattrs < 1000000:
            os.setxattr(f"{mp}/data0", f"user.{xattrs}", b"v" * 1000)
            xattrs += 1
    except OSError:
        pass
    got[mp] = [data, files, xattrs]
shm = int(sys.argv[1])
sid = libc.shmget(0, shm, 0o1000 | 0o600)
if sid >= 0:
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, shm)
usage = int(open("/sys/fs/cgroup/memory/memory.usage_in_bytes").read()) >> 20
print((got, usage), flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)
"""


TOUCH_8_MIB = "x = bytearray(8 << 20); x[::4096] = b'z' * len(x[::4096]); print('ok')"


@pytest.mark.parametrize("kind", ["files", "xattrs"])
@pytest.mark.parametrize("memory", ["256m", "512m"])
def test_inode_floods_in_every_writable_mount_leave_room_and_come_back(docker_sandbox, memory, kind) -> None:
    """Every mount the agent can write to filled at once: data up to each size, then empty files with the
    longest names up to each inode cap (or xattrs up to each inode space: the most memory per inode slot),
    plus System V shared memory held by a detached process. The caps make all of that fit the memory limit
    with room for commands (`SandboxLimits`' arithmetic), so a normal command still runs; once the agent's
    processes end and its files are removed, the memory comes back. 512m: the default limits; 256m: the
    test limits. Before the caps (65536 inodes per tmpfs, an unbounded /dev/shm) the flood itself was
    OOM-killed at both, and every later command with it."""
    from sandbox.container import PROCESS_RESERVE, TMPFS_MOUNTS, _parse_bytes

    lim = SandboxLimits() if memory == "512m" else LIMITS
    assert _parse_bytes(lim.memory) == _parse_bytes(memory)
    shm = _parse_bytes(lim.shm_size)
    with Sandbox(docker_sandbox, lim) as sb:
        t0 = time.monotonic()
        res = sb.exec(["python3", "-c", FLOODER, str(shm), "once", kind], timeout_s=120)
        assert res.exit_code == 0 and not res.oom_killed, res
        got, usage_mib = eval(res.stdout)  # noqa: S307  what the flooder printed
        flood_s = time.monotonic() - t0
        holder = ["bash", "-c", 'setsid python3 -c "$1" "$2" hold "$3" >/dev/null 2>&1 &', "h", FLOODER,
                  str(shm), kind]  # fmt: skip
        sb.exec(holder)  # its flood finds every mount full already; it holds the System V segment
        time.sleep(1.0)
        for _ in range(3):  # everything pinned at once: commands still run and get memory
            ok = sb.exec(["python3", "-c", TOUCH_8_MIB])
            assert (ok.exit_code, ok.stdout, ok.oom_killed) == (0, "ok\n", False), (got, ok)
        assert sb.exec("echo fine").stdout == "fine\n"
        # the writable mounts are the ones the limits bound, and each stopped at its bound
        caps = lim.inode_caps()
        assert set(got) == {*caps, "/dev/mqueue"}, got
        for mount, cap in caps.items():
            data, files, xattrs = got[mount]
            size = _parse_bytes(getattr(lim, TMPFS_MOUNTS[mount][0]))
            assert data <= size >> 20 and (files if kind == "files" else xattrs) > cap // 2, (mount, got)
            assert files <= cap and xattrs * 1000 <= cap * 1024, (mount, got[mount], cap)
        assert got["/dev/mqueue"][1] <= 8, got
        assert got["/dev/shm"][0] <= shm >> 20, got
        # the agent ends its processes and removes its files: the memory comes back
        sb.exec("kill -9 -1; true")
        mounts = "/work /tmp /dev/shm /dev/mqueue"
        clean = sb.exec(f"find {mounts} -mindepth 1 -delete; ls -A {mounts}")
        assert clean.exit_code == 0 and clean.stdout.split() == sorted(f"{m}:" for m in mounts.split()), clean
        room = (_parse_bytes(lim.memory) - 2 * PROCESS_RESERVE) >> 20
        big = sb.exec(["python3", "-c", f"x = bytearray({room} << 20); x[::4096] = b'z' * len(x[::4096])"],
                      timeout_s=60)  # fmt: skip
        assert big.exit_code == 0 and not big.oom_killed, (room, big)
        print(f"flood {memory} {kind}: {flood_s:.1f} s, cgroup usage {usage_mib} MiB, {got}")


TRACEME = (
    "import ctypes, os, signal, time\n"
    "ctypes.CDLL(None).ptrace(0, 0, None, None)  # PTRACE_TRACEME: its parent becomes its tracer\n"
    "os.kill(os.getpid(), signal.SIGSTOP)  # a ptrace stop, reported to the tracer's waitpid\n"
    "time.sleep(300)\n"
)


def test_a_process_that_ptrace_stops_itself_is_killed_at_the_timeout(sandbox_pool) -> None:
    """A command that makes the keeper its tracer and stops itself is neither reported as finished nor left
    running: it is killed at the timeout with the rest of its tree (a setsid'ed, a double-forked and a
    new-process-group one do the same thing)."""
    with sandbox_pool.lease_sync() as sb:
        script = sb.exec(["bash", "-c", 'printf %s "$1" > /work/traceme.py', "w", TRACEME])
        assert script.exit_code == 0
        for cmd in (
            ["python3", "/work/traceme.py"],
            ["bash", "-c", "setsid python3 traceme.py & (python3 traceme.py &); "
                           "set -m; python3 traceme.py & exec python3 traceme.py"],
        ):  # fmt: skip
            t0 = time.monotonic()
            res = sb.exec(cmd, timeout_s=2)
            took = time.monotonic() - t0
            assert res.timed_out and res.exit_code == 137, (cmd, res)
            assert 1.9 < took < 2 + 1.5, took
            assert _processes(sb) == IDLE, cmd
        assert sb.exec("echo usable").stdout == "usable\n"
    _assert_host_and_pool_fine(sandbox_pool)


def test_file_helpers_refuse_special_files_at_once(sandbox_pool) -> None:
    """read_file/write_file on a FIFO (with and without a peer), a socket, a device, a symlink to
    /dev/zero, a terminal nobody writes to, a directory, a huge sparse file, and on a path a background
    process keeps swapping between a file and a FIFO: each call ends within a few seconds with an error
    naming the problem (or, for the swapped path, the file's bytes), never blocks until the timeout (before:
    60 s for each FIFO read, then "exit 137: no message")."""
    setup = (
        "mkfifo /work/fifo /work/fifo2; (exec 3<>/work/fifo2; sleep 300) >/dev/null 2>&1 & "
        "ln -s /dev/zero /work/zero; ln -s /dev/null /work/null; mkdir /work/dir; "
        "truncate -s 15m /work/sparse; python3 -c 'import os, time; m, s = os.openpty(); "
        "os.symlink(os.ttyname(s), \"/work/pty\"); time.sleep(300)' >/dev/null 2>&1 & "
        "for i in $(seq 200); do [ -L /work/pty ] && break; sleep 0.05; done; "
        "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/work/sock\")'"
    )
    with sandbox_pool.lease_sync() as sb:
        assert sb.exec(setup).exit_code == 0
        cases = [
            ("read", "/work/fifo", "FIFO"), ("write", "/work/fifo", "FIFO"),
            ("read", "/work/fifo2", "FIFO"), ("write", "/work/fifo2", "FIFO"),
            ("read", "/work/sock", "socket"), ("write", "/work/sock", "socket"),
            ("read", "/work/zero", "larger than 1048576 bytes"), ("write", "/work/null", "character device"),
            ("read", "/dev/tty", "character device"), ("read", "/work/pty", "nothing to read now"),
            ("read", "/work/dir", "directory"), ("write", "/work/dir", "directory"),
            ("read", "/work/sparse", "larger than 1048576 bytes"),
        ]  # fmt: skip
        for op, path, why in cases:
            t0 = time.monotonic()
            with pytest.raises(OSError, match=why):
                if op == "read":
                    sb.read_file(path, max_bytes=1 << 20)
                else:
                    sb.write_file(path, b"data")
            assert time.monotonic() - t0 < 3, (op, path)
        assert sb.read_file("/work/sparse", max_bytes=16 << 20) == bytes(15 << 20)
        swapper = "while :; do rm -f /work/s; echo text > /work/s; rm -f /work/s; mkfifo /work/s; done"
        sb.exec(["bash", "-c", 'setsid bash -c "$1" >/dev/null 2>&1 &', "s", swapper])
        for i in range(20):
            t0 = time.monotonic()
            try:
                assert sb.read_file("/work/s") in (b"", b"text\n", b"mine")  # either writer's, or none yet
            except OSError as err:
                assert "FIFO" in str(err) or "No such file" in str(err), err
            try:
                sb.write_file("/work/s", b"mine")
            except OSError as err:  # ENXIO: the path became a FIFO between the check and open(O_NONBLOCK)
                assert any(w in str(err) for w in ("FIFO", "No such file", "No such device or address")), err
            assert time.monotonic() - t0 < 3, i
    _assert_host_and_pool_fine(sandbox_pool)


#: a script that leaves leases held at interpreter exit, each kept alive a different way
_LEASE_AT_EXIT = """
import sandbox
from sandbox.container import SandboxLimits
from sandbox.pool import SandboxPool
from tests.sandbox_fixtures import TEST_LIMITS_KW

pool = SandboxPool(1, limits=SandboxLimits(**TEST_LIMITS_KW))
pool.start_sync()
plain = pool.lease_sync()
ids = [plain.__enter__().id]
def episode():
    with pool.lease_sync() as sb:
        yield sb
gen = episode()
ids.append(next(gen).id)
class Cycle:
    def __init__(self):
        self.cm = pool.lease_sync()
        self.sb = self.cm.__enter__()
        self.me = self
sandbox.kept = Cycle()  # referenced from a package imported before concurrent.futures: finalized last
ids.append(sandbox.kept.sb.id)
print(" ".join(ids), flush=True)
# module teardown as it happens when the lease is finalized late: the thread pool module's globals are
# gone (submitting raised "TypeError: 'NoneType' object does not support the context manager protocol")
import atexit, concurrent.futures.thread
atexit.register(setattr, concurrent.futures.thread, "_global_shutdown_lock", None)
"""


def test_leases_held_at_interpreter_exit_leave_no_error_and_no_container(sandbox_leak_check) -> None:
    """Leases still open when the interpreter exits (a module global, a suspended generator, a reference
    cycle), finalized after the thread pools are gone: no "Exception ignored" on stderr, no container left
    (before: the release submitted to a torn-down thread pool and printed a TypeError)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LEASE_AT_EXIT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and len(proc.stdout.split()) == 3, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    left = [i for i in list_sandboxes() if i.id in proc.stdout.split()]
    assert not left, f"leases held at exit left containers behind: {[i.name for i in left]}"
