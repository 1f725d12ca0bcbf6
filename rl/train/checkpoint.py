"""Checkpoints in `<run_dir>/checkpoints/`: written whole or not at all, never half picked up.

    path = write_checkpoint(run_dir, step=10, fill=lambda tmp: ..., keep=3)
    latest = latest_checkpoint(run_dir)       # Path of the newest complete one, or None

Layout of one checkpoint, `checkpoints/step-000010/`:

    learner/       the learner's own save(dir): model (safetensors), optimizer, scheduler, balancer bias, RNG
    driver.json    the loop's state: step, weights version, task cursor, in-flight / queued samples (their
                   seeds), counters, RNG state, how many metrics lines and which store files belong to it
    buffer.arrow   the experience buffer (complete and partial groups)
    COMPLETE       written last: {"step": 10}

`fill(tmp)` writes everything but the marker into a temporary directory `.step-000010.tmp-<pid>` next to
the final one; then COMPLETE is written and fsync'ed, and the directory is renamed into place
(`os.replace`, atomic). A reader only ever takes directories named `step-<N>` that hold a valid
COMPLETE marker, so a run killed while writing leaves a temporary directory that is ignored (and
removed by the next `write_checkpoint`). After a new checkpoint, only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from rl.trajectory import _fsync_dir

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{6,})$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


def is_complete(path: Path) -> bool:
    """A checkpoint directory with a valid COMPLETE marker naming its own step."""
    m = _NAME.match(path.name)
    if not m or not path.is_dir():
        return False
    try:
        return int(json.loads((path / MARKER).read_text())["step"]) == int(m.group(1))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def checkpoint_step(path: Path) -> int:
    m = _NAME.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (step-NNNNNN)")
    return int(m.group(1))


def write_checkpoint(run_dir: str | Path, step: int, fill: Callable[[Path], None], keep: int) -> Path:
    """Write checkpoint `step` (see the module docstring); returns its final path."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp-*"):  # left by a writer that died
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        fill(tmp)
        marker = tmp / MARKER
        with open(marker, "w") as f:
            json.dump({"step": int(step)}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step written again (a resumed run): replace it whole
            old = root / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
