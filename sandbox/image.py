"""The sandbox base image, built with no container registry: debootstrap rootfs -> `docker import`.

    debootstrap --variant=minbase --include=python3,... bookworm ROOTFS MIRROR     (~90-150 s)
    add user `agent` (uid/gid 1000) to ROOTFS/etc/{passwd,group,shadow}; mkdir /work; strip caches/docs
    tar --numeric-owner -C ROOTFS -c . -> docker import --change 'USER 1000:1000' --change 'WORKDIR /work' ...

Versioning: the tag is `odyssey-sandbox:<version>`, where <version> is the first 10 hex digits of the
SHA-256 of the build recipe (`recipe()`: suite, variant, packages, user, env, and `RECIPE_REVISION`,
which is bumped by hand whenever this file changes how the rootfs is made). Changing the recipe thus
changes `DEFAULT_IMAGE`, and `make setup` builds the new one; an old image is never silently reused.

The build is idempotent (an existing tag is kept unless `force=True`), prints one progress line per
step with the elapsed time, and turns each missing prerequisite into `SandboxUnavailable` naming the fix.

CLI (`odyssey sandbox ...`, dispatched by rl/cli.py to `cli_main`; also `python -m sandbox.image ...`):
    build [--tag T] [--extra-packages P ...] [--force] [--mirror URL]   build an image
    ensure                                   build DEFAULT_IMAGE only when absent (used by `make setup`)
    ls                                       list Odyssey images and sandbox containers on this host
    gc [--all]                               run the reaper now (--all: remove every Odyssey container)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sandbox.client import docker_client
from sandbox.errors import SandboxError, SandboxUnavailable

SUITE = "bookworm"
#: bash, coreutils, grep, sed, tar, findutils, util-linux, login (su) come with minbase (Essential: yes)
BASE_PACKAGES: tuple[str, ...] = ("python3-minimal", "python3")
AGENT_USER, AGENT_UID = "agent", 1000
WORKDIR = "/work"
IMAGE_ENV: dict[str, str] = {
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
RECIPE_REVISION = 1  # bump when the rootfs steps below change
IMAGE_REPO = "odyssey-sandbox"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_ONE_LINE_RE = re.compile(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)")
BUILD_FIX = "run `make setup` (or `odyssey sandbox build`)"


def recipe(extra_packages: Sequence[str] = ()) -> dict:
    """Everything that determines the image's content; its hash is the image version."""
    return {
        "revision": RECIPE_REVISION,
        "suite": SUITE,
        "variant": "minbase",
        "packages": sorted(set(BASE_PACKAGES) | set(extra_packages)),
        "user": [AGENT_USER, AGENT_UID],
        "workdir": WORKDIR,
        "env": IMAGE_ENV,
    }


def image_version(extra_packages: Sequence[str] = ()) -> str:
    """Short hash of `recipe(extra_packages)`: 10 hex digits."""
    blob = json.dumps(recipe(extra_packages), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


DEFAULT_IMAGE = f"{IMAGE_REPO}:{image_version()}"


def image_exists(tag: str) -> bool:
    """True when the daemon has an image tagged `tag`. Raises `SandboxUnavailable` when the daemon is down."""
    from docker.errors import ImageNotFound

    try:
        docker_client().images.get(tag)
        return True
    except ImageNotFound:
        return False


def debian_mirror(files: Sequence[str] | None = None) -> str:
    """The Debian mirror apt is configured with (so debootstrap reaches the same registry apt does).

    Reads one-line `deb URL SUITE ...` entries and deb822 `.sources` stanzas; picks the first URI that
    serves `SUITE` and ends in /debian. `ODYSSEY_DEBIAN_MIRROR` overrides; falls back to deb.debian.org.
    """
    if os.environ.get("ODYSSEY_DEBIAN_MIRROR") and files is None:
        return os.environ["ODYSSEY_DEBIAN_MIRROR"]
    if files is None:
        files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]
    for path in files:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for line in text.splitlines():  # one-line format: deb [opts] URL SUITE COMPONENTS...
            m = _ONE_LINE_RE.match(line)
            if m and m.group(2) == SUITE and m.group(1).rstrip("/").endswith("/debian"):
                return m.group(1).rstrip("/")
        for stanza in re.split(r"\n\s*\n", text):  # deb822 format
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, val = line.split(":", 1)
                    fields[key.strip().lower()] = val.split()
            uris, suites = fields.get("uris", []), fields.get("suites", [])
            for uri in uris:
                if SUITE in suites and uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    return DEFAULT_MIRROR


class _Progress:
    """Prints `[sandbox build +12.3s] (2/6) message` lines."""

    def __init__(self, n_steps: int, sink: Callable[[str], None]) -> None:
        self.t0, self.n, self.i, self.sink = time.monotonic(), n_steps, 0, sink

    def step(self, msg: str) -> None:
        self.i += 1
        self.note(f"({self.i}/{self.n}) {msg}")

    def note(self, msg: str) -> None:
        self.sink(f"[sandbox build +{time.monotonic() - self.t0:6.1f}s] {msg}")


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "building the sandbox image needs root (debootstrap creates device nodes and root-owned files): "
            "run `sudo make setup` or `sudo .venv/bin/odyssey sandbox build`"
        )
    for tool, pkg in (("debootstrap", "debootstrap"), ("tar", "tar")):
        if shutil.which(tool) is None:
            raise SandboxUnavailable(
                f"`{tool}` is not installed: run `apt-get install -y {pkg}` (or `make setup`)"
            )
    docker_client()  # raises SandboxUnavailable naming the fix when the daemon is down


def _umount_below(root: Path) -> None:
    """Unmount anything debootstrap left mounted under `root` (proc, sys) so deleting it is safe."""
    prefix = str(root.resolve()) + "/"
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def _run_debootstrap(rootfs: Path, packages: Sequence[str], mirror: str, log: Path, prog: _Progress) -> None:
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(rootfs), mirror]
    last, next_beat = "", time.monotonic() + 15
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            last = line.strip() or last
            if time.monotonic() >= next_beat:  # heartbeat: debootstrap prints hundreds of lines
                prog.note(f"    debootstrap: {last}")
                next_beat = time.monotonic() + 15
        rc = proc.wait()
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SandboxUnavailable(
            f"debootstrap failed (exit {rc}); last lines of {log}:\n{tail}\n"
            f"Check that the Debian mirror {mirror} is reachable (it is read from /etc/apt/sources.list*); "
            "override it with `--mirror URL` or ODYSSEY_DEBIAN_MIRROR."
        )


def _configure_rootfs(rootfs: Path) -> None:
    """Add the non-root agent user, create /work, and strip what a sandbox never needs."""
    etc = rootfs / "etc"
    entries = {
        "passwd": f"{AGENT_USER}:x:{AGENT_UID}:{AGENT_UID}:Odyssey agent:{WORKDIR}:/bin/bash\n",
        "group": f"{AGENT_USER}:x:{AGENT_UID}:\n",
        "shadow": f"{AGENT_USER}:!:19000:0:99999:7:::\n",  # "!": no password login, so `su agent` is moot
    }
    for name, line in entries.items():
        path = etc / name
        text = path.read_text() if path.exists() else ""
        if not any(row.split(":")[0] == AGENT_USER for row in text.splitlines()):
            path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)
    work = rootfs / WORKDIR.lstrip("/")
    work.mkdir(exist_ok=True)
    os.chown(work, AGENT_UID, AGENT_UID)
    work.chmod(0o755)
    (rootfs / "tmp").chmod(0o1777)
    python = rootfs / "usr/local/bin/python"
    if not python.exists():
        python.symlink_to("/usr/bin/python3")
    for junk in (
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
    ):
        target = rootfs / junk
        if target.is_dir():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def _split_tag(tag: str) -> tuple[str, str]:
    repo, sep, version = tag.rpartition(":")
    if not sep or "/" in version:
        return tag, "latest"
    return repo, version


def build_image(
    tag: str | None = None,
    extra_packages: Sequence[str] = (),
    force: bool = False,
    progress: Callable[[str], None] | None = print,
    mirror: str | None = None,
) -> str:
    """Build the sandbox image and return its tag.

    tag: defaults to `odyssey-sandbox:<image_version(extra_packages)>` (== DEFAULT_IMAGE without extras).
    extra_packages: Debian package names added to debootstrap's --include (e.g. "git", "gcc").
    force: rebuild even when the tag exists. progress: sink for progress lines (None = silent).
    Raises `SandboxUnavailable` (not root, no debootstrap, no daemon, mirror unreachable), naming the fix.
    """
    sink = progress or (lambda _msg: None)
    bad = [p for p in extra_packages if not _PACKAGE_RE.match(p)]
    if bad:
        raise ValueError(f"invalid Debian package name(s) {bad}: use names like `git` or `build-essential`")
    tag = tag or f"{IMAGE_REPO}:{image_version(extra_packages)}"
    prog = _Progress(6, sink)
    prog.step(f"checking prerequisites for {tag} (root, debootstrap, tar, Docker daemon)")
    docker_client()
    if not force and image_exists(tag):
        prog.note(f"{tag} already exists; nothing to do (pass --force to rebuild)")
        return tag
    _check_prerequisites()
    mirror = mirror or debian_mirror()
    packages = recipe(extra_packages)["packages"]
    work = Path(
        tempfile.mkdtemp(prefix="odyssey-rootfs-", dir=os.environ.get("ODYSSEY_BUILD_DIR", "/var/tmp"))
    )
    rootfs, log, tarball = work / "rootfs", work / "debootstrap.log", work / "rootfs.tar"
    try:
        prog.step(
            f"debootstrap {SUITE} minbase + {','.join(packages)} from {mirror} (about 2 min; log {log})"
        )
        _run_debootstrap(rootfs, packages, mirror, log, prog)
        prog.step(
            f"configuring rootfs: user {AGENT_USER} (uid {AGENT_UID}), {WORKDIR}, stripping caches and docs"
        )
        _umount_below(rootfs)
        _configure_rootfs(rootfs)
        prog.step("packing rootfs (tar --numeric-owner)")
        subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
        size_mb = tarball.stat().st_size / 2**20
        prog.step(f"docker import ({size_mb:.0f} MiB) as {tag}")
        repo, version = _split_tag(tag)
        old_id = docker_client().images.get(tag).id if image_exists(tag) else None
        changes = [f"USER {AGENT_UID}:{AGENT_UID}", f"WORKDIR {WORKDIR}", 'CMD ["sleep", "infinity"]']
        changes += [f"ENV {k}={v}" for k, v in IMAGE_ENV.items()]
        changes += [f"LABEL odyssey.image=1 odyssey.image_version={image_version(extra_packages)}"]
        docker_client().api.import_image_from_file(
            str(tarball), repository=repo, tag=version, changes=changes
        )
        if not image_exists(tag):
            raise SandboxUnavailable(f"docker import finished but {tag} is not listed; see the daemon's log")
        if old_id and old_id != docker_client().images.get(tag).id:
            _remove_quietly(old_id)  # the replaced build, now untagged (kept if containers still use it)
        prog.step("smoke test: python3, non-root user, writable /work")
        try:
            _check_runs(tag)
        except Exception:
            docker_client().images.remove(tag, force=True)  # never leave a broken image under the tag
            raise
    finally:
        _umount_below(rootfs) if rootfs.exists() else None
        shutil.rmtree(work, ignore_errors=True)
    prog.note(f"done: {tag}")
    return tag


def _remove_quietly(image_id: str) -> None:
    from docker.errors import APIError

    try:
        docker_client().images.remove(image_id)
    except APIError:
        pass


SMOKE_COMMAND = "id -u && python3 -c 'import json, sqlite3; print(json.dumps([1]))' && touch /work/ok"
SMOKE_OUTPUT = [str(AGENT_UID), "[1]"]


def _check_runs(tag: str) -> None:
    """One plain `docker run` of the new image (no network): python3 runs, as the agent uid, /work is
    writable. The same command in a hardened `Sandbox` is tests/test_sandbox.py::test_image_smoke."""
    from docker.errors import ContainerError

    try:
        out = docker_client().containers.run(
            tag, ["sh", "-c", SMOKE_COMMAND], remove=True, network_disabled=True
        )
    except ContainerError as err:
        raise SandboxError(f"smoke test of {tag} failed: {err}") from err
    if out.decode(errors="replace").split() != SMOKE_OUTPUT:
        raise SandboxError(f"smoke test of {tag} failed: printed {out!r}, expected {SMOKE_OUTPUT}")


def ensure_image(tag: str = DEFAULT_IMAGE, progress: Callable[[str], None] | None = print) -> str:
    """Build `tag` when it is absent (the default tag's recipe is this file's), else do nothing."""
    if image_exists(tag):
        if progress:
            progress(f"[sandbox] image {tag} present")
        return tag
    if tag != DEFAULT_IMAGE and not tag.startswith(f"{IMAGE_REPO}:"):
        raise SandboxUnavailable(
            f"image {tag} is missing and is not an Odyssey image; build or pull it yourself"
        )
    return build_image(tag=tag, progress=progress)


def _cmd_ls() -> int:
    from sandbox.reaper import list_sandboxes

    client = docker_client()
    print("images:")
    for img in client.images.list(filters={"label": "odyssey.image=1"}):
        size = img.attrs.get("Size", 0) / 2**20
        print(f"  {', '.join(img.tags) or img.short_id:40s} {size:7.1f} MiB")
    rows = list_sandboxes()
    print(f"sandbox containers: {len(rows)}")
    for row in rows:
        print(
            f"  {row.name:32s} {row.status:9s} owner={row.owner_host}:{row.owner_pid}"
            f"{'' if row.owner_alive else ' (dead)'} age={row.age_s:.0f}s ttl={row.ttl_s:.0f}s"
        )
    return 0


def _cmd_gc(all_: bool) -> int:
    from sandbox.reaper import reap

    removed = reap(everything=all_)
    print(f"removed {len(removed)} sandbox container(s){': ' + ' '.join(removed) if removed else ''}")
    return 0


def cli_main(argv: list[str]) -> int:
    """`odyssey sandbox build|ensure|ls|gc ...` (argv excludes "sandbox")."""
    parser = argparse.ArgumentParser(
        prog="odyssey sandbox", description="Docker sandbox image and containers"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the sandbox image (debootstrap rootfs + docker import)")
    b.add_argument(
        "--tag", default=None, help=f"image tag (default {DEFAULT_IMAGE}, or a hash tag with extras)"
    )
    b.add_argument("--extra-packages", nargs="*", default=[], metavar="PKG", help="extra Debian packages")
    b.add_argument("--force", action="store_true", help="rebuild even when the tag exists")
    b.add_argument("--mirror", default=None, help="Debian mirror URL (default: the one apt uses)")
    sub.add_parser("ensure", help=f"build {DEFAULT_IMAGE} only if it is missing")
    sub.add_parser("ls", help="list Odyssey images and sandbox containers")
    g = sub.add_parser("gc", help="remove sandbox containers whose owner died or whose TTL passed")
    g.add_argument("--all", action="store_true", help="remove every Odyssey sandbox container on this host")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            tag = build_image(args.tag, args.extra_packages, force=args.force, mirror=args.mirror)
            print(tag)
            return 0
        if args.cmd == "ensure":
            ensure_image()
            return 0
        if args.cmd == "ls":
            return _cmd_ls()
        return _cmd_gc(args.all)
    except (SandboxError, ValueError) as err:
        print(f"odyssey sandbox {args.cmd}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
