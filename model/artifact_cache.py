"""Compiled and cached artefacts, keyed by what they are built from, never by where the code lives.

    key = content_key(source_bytes, flags, toolchain)      # a hash of every input of the build
    path, built = cached_build("kda_cpu", key, build)      # build(tmp_dir) writes the artefact into tmp_dir

The same inputs give the same key from any checkout or working directory (a `ray job submit` copy of the
repo, another worktree), so a local run and a submitted job share one artefact and nothing is rebuilt
when only the path changes. Layout: `<root>/<name>/<key>/` holds the artefact; root is
`$ODYSSEY_CACHE_DIR`, else `~/.cache/odyssey`.

A process that finds no artefact builds it once, under an exclusive `flock` on `<root>/<name>/<key>.lock`,
and prints one progress line; concurrent processes wait on the lock (printing that they wait) and then
use what the first one built. The kernel releases an flock when its holder dies, even by SIGKILL, so a
build killed midway never blocks later ones (torch's own `FileBaton` leaves a lock file that does). The
build runs in a temporary directory next to the final one and is renamed into place in one step, so a
reader sees a whole artefact or none; the next build removes a killed build's temporary directory.
Every build appends a line to `<root>/<name>/builds.log` (time, pid, key, seconds, working dir), which
tests and bench/startup.py read to show that nothing was rebuilt.

Use this for any artefact that costs start-up time (compiled kernels today); key it by content.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BUILD_LOG = "builds.log"


def cache_root() -> Path:
    """`$ODYSSEY_CACHE_DIR`, else `~/.cache/odyssey`."""
    return Path(os.environ.get("ODYSSEY_CACHE_DIR") or Path.home() / ".cache" / "odyssey")


def content_key(*parts: bytes | str) -> str:
    """A 20-hex-digit SHA-256 of the parts (each length-prefixed, so ("ab", "c") != ("a", "bc"))."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:20]


def say(msg: str) -> None:
    """One progress line on stderr (Ray forwards an actor's stderr to the driver and the job log)."""
    print(f"[odyssey] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path, waiting: str, say: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`; print `waiting` once if another process holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(waiting)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock (so does the process dying)


def cached_build(
    name: str,
    key: str,
    build: Callable[[Path], Any],
    what: str = "",
    say: Callable[[str], None] = say,
) -> tuple[Path, Any]:
    """The directory `<root>/<name>/<key>`, built by `build(tmp_dir)` if it does not exist yet.

    Returns (directory, what `build` returned if this call built it, else None). `build` writes the
    artefact into the empty `tmp_dir` it is given; an exception from it propagates and leaves nothing.
    `what` names the artefact in the progress lines.
    """
    group = cache_root() / name
    final = group / key
    if final.is_dir():
        return final, None
    group.mkdir(parents=True, exist_ok=True)
    label = what or name
    with _exclusive(group / f"{key}.lock", f"waiting for another process to finish building {label}", say):
        if final.is_dir():  # built by the process we waited for
            return final, None
        for stale in group.glob(f".{key}.tmp-*"):  # left by a build that was killed (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=group))
        say(f"building {label} into {final} (once per machine and input version; other processes wait)")
        t0 = time.perf_counter()
        try:
            result = build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is shared by every process
            os.rename(tmp, final)  # atomic: readers see the whole directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.perf_counter() - t0
        line = f"{time.time():.3f} pid={os.getpid()} key={key} seconds={seconds:.1f} cwd={os.getcwd()}\n"
        with open(group / BUILD_LOG, "a") as f:
            f.write(line)
        say(f"built {label} in {seconds:.1f} s")
    return final, result


def build_count(name: str, key: str | None = None) -> int:
    """How many builds of `name` (of `key`, when given) `builds.log` records."""
    log = cache_root() / name / BUILD_LOG
    if not log.is_file():
        return 0
    lines = log.read_text().splitlines()
    return sum(1 for ln in lines if key is None or f" key={key} " in ln)
