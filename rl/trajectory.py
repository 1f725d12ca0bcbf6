"""The Arrow codec of `Trajectory` and an append-only on-disk store for it.

The record types (`Trajectory`, `TurnSpan`, `StepInfo`) live in envs/trajectory.py, a numpy-only leaf
that envs/, rewards/ and rl/ all import; they are re-exported here, so `from rl.trajectory import
Trajectory, TurnSpan, TrajectoryStore` keeps working.

`TrajectoryStore(dir)` appends batches of trajectories as Arrow IPC *file* format files, one
file per `append` call. Each file is written to a hidden temporary name in the same directory,
flushed, fsync'ed, and then renamed with `os.replace` (atomic on POSIX), so a reader sees either
the whole file or nothing. A truncated or otherwise unreadable `.arrow` file is skipped with a
warning, never read as a partial record. See docs/trajectory.md.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from time import time_ns
from typing import Any

import numpy as np
import pyarrow as pa

from envs.trajectory import ROLES, StepInfo, Trajectory, TurnSpan

SCHEMA_VERSION = "1"
_VERSION_KEY = b"odyssey.trajectory.schema_version"

# ---- Arrow schema ---------------------------------------------------------------------------------

_JSON = pa.large_string()
_SPAN_TYPE = pa.struct([("role", pa.string()), ("start", pa.int64()), ("end", pa.int64())])

SCHEMA = pa.schema(
    [
        ("tokens", pa.large_list(pa.int32())),
        ("loss_mask", pa.large_list(pa.uint8())),
        ("rollout_logprobs", pa.large_list(pa.float32())),
        ("routed_experts", pa.large_list(pa.uint16())),  # flattened [T * n_moe_layers * k], null if absent
        ("routed_experts_shape", pa.list_(pa.int32())),  # trailing dims [n_moe_layers, k], null if absent
        ("turns", pa.list_(_SPAN_TYPE)),
        ("step_infos", pa.large_string()),  # JSON list of dicts
        ("outcome", pa.float64()),
        ("terminated", pa.bool_()),
        ("truncated", pa.bool_()),
        ("infra_error", pa.string()),
        ("reward_error", pa.string()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("turn_rewards", pa.list_(pa.float64())),
        ("policy_version", pa.int64()),  # copy of metadata["policy_version"] for cheap filtering
        ("metadata", pa.large_string()),  # JSON dict
    ],
    metadata={_VERSION_KEY: SCHEMA_VERSION.encode()},
)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _dumps(name: str, obj: Any) -> str:
    try:
        return json.dumps(obj, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"Trajectory.{name} must be JSON-serialisable (str/int/float/bool/None/list/dict, "
            f"numpy scalars ok) to be stored: {e}"
        ) from e


def _large_list(arrays: list[np.ndarray | None], value_type: pa.DataType) -> pa.LargeListArray:
    lengths = np.array([0 if a is None else a.size for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [a.reshape(-1) for a in arrays if a is not None]
    if len(present) == 1:
        flat = present[0]  # zero-copy for the common single-trajectory append
    elif present:
        flat = np.concatenate(present)
    else:
        flat = np.zeros(0, dtype=value_type.to_pandas_dtype())
    mask = None
    if any(a is None for a in arrays):
        mask = pa.array([a is None for a in arrays], type=pa.bool_())
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type), mask=mask)


def trajectories_to_batch(trajs: Sequence[Trajectory]) -> pa.RecordBatch:
    """Encode trajectories as one Arrow RecordBatch (one row each) in `SCHEMA`.

    Big arrays become large_list columns of their native dtype (int32 / uint8 / float32 / uint16),
    so they are stored as raw little-endian buffers and decoded zero-copy. Heterogeneous dicts
    (step_infos, metadata) are JSON strings.
    """
    if not trajs:
        raise ValueError("trajectories_to_batch needs at least one Trajectory")
    for i, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise TypeError(f"item {i} is a {type(t).__name__}, expected rl.trajectory.Trajectory")
    re = [t.routed_experts for t in trajs]
    pv = []
    for t in trajs:
        v = t.metadata.get("policy_version")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"metadata['policy_version'] must be an int or None, got {v!r}")
        pv.append(None if v is None else int(v))
    cols = [
        _large_list([t.tokens for t in trajs], pa.int32()),
        _large_list([t.loss_mask for t in trajs], pa.uint8()),
        _large_list([t.rollout_logprobs for t in trajs], pa.float32()),
        _large_list(re, pa.uint16()),
        pa.array([None if a is None else list(a.shape[1:]) for a in re], type=pa.list_(pa.int32())),
        pa.array([[(s.role, s.start, s.end) for s in t.turns] for t in trajs], type=pa.list_(_SPAN_TYPE)),
        pa.array([_dumps("step_infos", [i.to_dict() for i in t.step_infos]) for t in trajs], _JSON),
        pa.array([t.outcome for t in trajs], type=pa.float64()),
        pa.array([bool(t.terminated) for t in trajs], type=pa.bool_()),
        pa.array([bool(t.truncated) for t in trajs], type=pa.bool_()),
        pa.array([t.infra_error for t in trajs], type=pa.string()),
        pa.array([t.reward_error for t in trajs], type=pa.string()),
        pa.array([list(t.rewards.items()) for t in trajs], type=pa.map_(pa.string(), pa.float64())),
        pa.array([t.turn_rewards for t in trajs], type=pa.list_(pa.float64())),
        pa.array(pv, type=pa.int64()),
        pa.array([_dumps("metadata", t.metadata) for t in trajs], type=pa.large_string()),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)


def _flat(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1] int64, values) of a large_list column, both zero-copy."""
    return col.offsets.to_numpy(zero_copy_only=True), col.values.to_numpy(zero_copy_only=True)


def _decode_rows(batch: pa.RecordBatch, rows: Sequence[int]) -> Iterator[Trajectory]:
    """Decode `rows` of a store-schema batch; columns are converted once per batch, not per row."""
    if not rows:
        return
    c = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    flat = {k: _flat(c[k]) for k in ("tokens", "loss_mask", "rollout_logprobs", "routed_experts")}
    py = {
        k: c[k].to_pylist()
        for k in c
        if k not in flat and k not in ("step_infos", "metadata")  # JSON columns: decoded per row
    }

    def arr(k: str, r: int) -> np.ndarray:
        off, vals = flat[k]
        return vals[off[r] : off[r + 1]]

    for r in rows:
        shape = py["routed_experts_shape"][r]
        yield Trajectory(
            tokens=arr("tokens", r),
            loss_mask=arr("loss_mask", r),
            rollout_logprobs=arr("rollout_logprobs", r),
            routed_experts=None if shape is None else arr("routed_experts", r).reshape(-1, *shape),
            turns=[TurnSpan(d["role"], d["start"], d["end"]) for d in py["turns"][r]],
            step_infos=json.loads(c["step_infos"][r].as_py()),
            outcome=py["outcome"][r],
            terminated=py["terminated"][r],
            truncated=py["truncated"][r],
            infra_error=py["infra_error"][r],
            reward_error=py["reward_error"][r],
            rewards=dict(py["rewards"][r]),
            turn_rewards=py["turn_rewards"][r],
            metadata=json.loads(c["metadata"][r].as_py()),
        )


def trajectory_from_batch(batch: pa.RecordBatch, row: int = 0) -> Trajectory:
    """Decode row `row` of a store-schema RecordBatch. Arrays are zero-copy read-only views."""
    return next(_decode_rows(batch, [row]))


def trajectories_from_batch(batch: pa.RecordBatch) -> list[Trajectory]:
    """Inverse of `trajectories_to_batch`."""
    return list(_decode_rows(batch, range(batch.num_rows)))


# ---- store -------------------------------------------------------------------------------------

_counter = itertools.count()


class TrajectoryStore:
    """Append-only directory of Arrow IPC files, one file per `append` call.

    File names `<time_ns>-<pid>-<seq>-<rand>.arrow` sort in write order per process and never
    collide across processes, so many rollout workers may append to one directory at once.
    Writes go to `.<name>.tmp` in the same directory, are fsync'ed, then `os.replace`d into place.

    Args:
        root: directory (created if missing).
        compression: Arrow IPC buffer compression, None | "lz4" | "zstd" (see bench/trajectory.py).
        fsync: fsync the file and directory around the rename (durable across power loss, not just
            process crashes). Costs a disk flush per append.
    """

    SUFFIX = ".arrow"
    TMP_SUFFIX = ".tmp"

    def __init__(self, root: str | os.PathLike, compression: str | None = None, fsync: bool = True):
        if compression not in (None, "lz4", "zstd"):
            raise ValueError(f"compression must be None, 'lz4' or 'zstd', got {compression!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.fsync = fsync
        self._warned: set[str] = set()

    # ---- writing ----
    def append(self, trajs: Trajectory | Iterable[Trajectory], max_batch_tokens: int = 1 << 26) -> Path:
        """Atomically write `trajs` as one new file and return its path.

        Trajectories are grouped into record batches of at most `max_batch_tokens` tokens each
        (one trajectory may exceed it alone); the whole file becomes visible at once or not at all.
        """
        if isinstance(trajs, Trajectory):
            trajs = [trajs]
        trajs = list(trajs)
        if not trajs:
            raise ValueError("TrajectoryStore.append needs at least one Trajectory")
        batches = [trajectories_to_batch(g) for g in _group_by_tokens(trajs, max_batch_tokens)]
        name = f"{time_ns():020d}-{os.getpid()}-{next(_counter):06d}-{uuid.uuid4().hex[:8]}{self.SUFFIX}"
        final = self.root / name
        tmp = self.root / f".{name}{self.TMP_SUFFIX}"
        try:
            self._write_file(tmp, batches)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_dir(self.root)
        return final

    def _write_file(self, path: Path, batches: list[pa.RecordBatch]) -> None:
        options = pa.ipc.IpcWriteOptions(compression=self.compression)
        with open(path, "wb") as f:
            with pa.ipc.new_file(f, SCHEMA, options=options) as writer:
                for b in batches:
                    writer.write_batch(b)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    # ---- reading ----
    def files(self) -> list[Path]:
        """Complete data files, in write order. Warns (once per file) about temporary files left behind."""
        out = []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") and p.name.endswith(self.TMP_SUFFIX):
                self._warn_once(
                    p,
                    f"TrajectoryStore: ignoring temporary file {p.name} (an in-progress write by another "
                    "process, or left by a writer that crashed; remove_stale_temp() deletes old ones)",
                )
            elif p.suffix == self.SUFFIX and not p.name.startswith("."):
                out.append(p)
        return out

    def _open(self, path: Path) -> pa.ipc.RecordBatchFileReader | None:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        except (pa.ArrowInvalid, OSError) as e:
            self._warn_once(
                path, f"TrajectoryStore: skipping unreadable file {path.name} (truncated or corrupt): {e}"
            )
            return None
        version = (reader.schema.metadata or {}).get(_VERSION_KEY)
        if version != SCHEMA_VERSION.encode():
            raise ValueError(
                f"{path}: trajectory schema version {version!r}, this code reads {SCHEMA_VERSION!r}; "
                "read it with the Odyssey version that wrote it"
            )
        return reader

    def _batches(self) -> Iterator[pa.RecordBatch]:
        for path in self.files():
            reader = self._open(path)
            if reader is None:
                continue
            try:
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            except (pa.ArrowInvalid, OSError) as e:
                self._warn_once(path, f"TrajectoryStore: skipping corrupt file {path.name}: {e}")
                continue
            yield from batches

    def __iter__(self) -> Iterator[Trajectory]:
        return self.iter()

    def iter(
        self, policy_version: int | None = None, min_policy_version: int | None = None
    ) -> Iterator[Trajectory]:
        """Yield stored trajectories in write order, optionally only those with
        metadata["policy_version"] == policy_version and/or >= min_policy_version.

        Arrays are zero-copy, read-only views into the memory-mapped file (`.copy()` to modify).
        """
        for batch in self._batches():
            yield from _decode_rows(batch, _matching_rows(batch, policy_version, min_policy_version))

    def read_all(
        self, policy_version: int | None = None, min_policy_version: int | None = None
    ) -> list[Trajectory]:
        return list(self.iter(policy_version, min_policy_version))

    def count(self, policy_version: int | None = None, min_policy_version: int | None = None) -> int:
        """Number of stored trajectories (matching the filter); reads only the policy_version column."""
        return sum(len(_matching_rows(b, policy_version, min_policy_version)) for b in self._batches())

    def __len__(self) -> int:
        return self.count()

    def remove_stale_temp(self, older_than_s: float = 3600.0) -> list[Path]:
        """Delete temporary files older than `older_than_s` (crash leftovers); returns what was removed."""
        now = time_ns() / 1e9
        removed = []
        for p in self.root.iterdir():
            if p.name.startswith(".") and p.name.endswith(self.TMP_SUFFIX):
                try:
                    if now - p.stat().st_mtime >= older_than_s:
                        p.unlink()
                        removed.append(p)
                except FileNotFoundError:
                    pass  # its writer finished and renamed it meanwhile
        return removed

    def _warn_once(self, path: Path, msg: str) -> None:
        if path.name not in self._warned:
            self._warned.add(path.name)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _group_by_tokens(trajs: list[Trajectory], max_tokens: int) -> list[list[Trajectory]]:
    groups: list[list[Trajectory]] = [[]]
    n = 0
    for t in trajs:
        if groups[-1] and n + t.n_tokens > max_tokens:
            groups.append([])
            n = 0
        groups[-1].append(t)
        n += t.n_tokens
    return groups


def _matching_rows(batch: pa.RecordBatch, version: int | None, min_version: int | None) -> list[int]:
    if version is None and min_version is None:
        return list(range(batch.num_rows))
    pv = batch.column(batch.schema.get_field_index("policy_version")).to_pylist()
    return [
        i
        for i, v in enumerate(pv)
        if v is not None and (version is None or v == version) and (min_version is None or v >= min_version)
    ]


__all__ = [
    "ROLES",
    "SCHEMA",
    "StepInfo",
    "Trajectory",
    "TrajectoryStore",
    "TurnSpan",
    "trajectories_from_batch",
    "trajectories_to_batch",
    "trajectory_from_batch",
]
