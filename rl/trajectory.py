"""The Arrow codec of `Trajectory` and an append-only on-disk store for it.

The record types (`Trajectory`, `TurnSpan`, `StepInfo`) live in envs/trajectory.py, a numpy-only leaf
that envs/, rewards/ and rl/ all import; they are re-exported here, so `from rl.trajectory import
Trajectory, TurnSpan, TrajectoryStore` keeps working. Schema 3 adds the `token_versions` column (the
policy version that sampled each generated token); stores of schema 1 read with `token_versions=None`.
Schema 4 adds the images: `images` (the PNG bytes, content-addressed: the key is recomputed as their
sha256 on read) and `image_spans` (where each image's tokens sit); older stores read with no images.

`TrajectoryStore(dir)` appends batches of trajectories as Arrow IPC *file* format files, one
file per `append` call. Each file is written to a hidden temporary name in the same directory,
flushed, fsync'ed, and then renamed with `os.replace` (atomic on POSIX), so a reader sees either
the whole file or nothing. Store files are untrusted input when read: every record batch is
validated (`RecordBatch.validate(full=True)`: offsets, lengths, UTF-8) before anything decodes it
and checked against the CRC-32 of its content written with it (schema version 2), so a damaged
file (truncated, overwritten, bit rot) is skipped as a whole with a warning naming it, never read
as changed data and never able to crash the reader. See docs/trajectory.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from time import time_ns
from typing import Any

import numpy as np
import pyarrow as pa

from envs.trajectory import ROLES, ImageSpan, StepInfo, Trajectory, TurnSpan
from model.image_tokens import image_token_ids

SCHEMA_VERSION = "4"  # see _UPGRADES for what each version changed and how older ones are read
_VERSION_KEY = b"odyssey.trajectory.schema_version"
_CRC_KEY = b"odyssey.trajectory.batch_crc32"  # JSON list: the CRC-32 of each record batch, in order

# ---- Arrow schema ---------------------------------------------------------------------------------

_JSON = pa.large_string()
_SPAN_TYPE = pa.struct([("role", pa.string()), ("start", pa.int64()), ("end", pa.int64())])
_IMAGE_SPAN_TYPE = pa.struct([("sha256", pa.string()), ("start", pa.int64()), ("end", pa.int64()),
                              ("grid_h", pa.int32()), ("grid_w", pa.int32())])

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
        ("token_versions", pa.large_list(pa.int32())),  # [T] policy version per token, null if absent (3)
        ("images", pa.large_list(pa.large_binary())),  # PNG bytes of each distinct image (4)
        ("image_spans", pa.list_(_IMAGE_SPAN_TYPE)),  # where each image's token block sits (4)
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
        _large_list([t.token_versions for t in trajs], pa.int32()),
        pa.array([list(t.images.values()) for t in trajs], type=pa.large_list(pa.large_binary())),
        pa.array([[(s.sha256, s.start, s.end, s.grid_h, s.grid_w) for s in t.image_spans] for t in trajs],
                 type=pa.list_(_IMAGE_SPAN_TYPE)),
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
    arrays = ("tokens", "loss_mask", "rollout_logprobs", "routed_experts", "token_versions")
    flat = {k: _flat(c[k]) for k in arrays}
    versions_null = c["token_versions"].is_null().to_pylist()
    py = {
        k: c[k].to_pylist()
        for k in c
        if k not in flat and k not in ("step_infos", "metadata", "images")  # decoded per row
    }

    def arr(k: str, r: int) -> np.ndarray:
        off, vals = flat[k]
        return vals[off[r] : off[r + 1]]

    for r in rows:
        shape = py["routed_experts_shape"][r]
        traj = Trajectory(
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
            token_versions=None if versions_null[r] else arr("token_versions", r),
            images={hashlib.sha256(b).hexdigest(): b for b in (x.as_py() for x in c["images"][r].values)},
            image_spans=[ImageSpan(**d) for d in py["image_spans"][r]],
        )
        check_image_tokens(traj)
        yield traj


def check_image_tokens(traj: Trajectory) -> None:
    """Raise ValueError unless the tokens of every image span are exactly the image block of its grid
    (model.image_tokens.image_token_ids): the record checks structure, this checks the layout."""
    for i, sp in enumerate(traj.image_spans):
        want = image_token_ids(sp.grid_h, sp.grid_w)
        got = traj.tokens[sp.start : sp.end]
        if got.shape[0] != len(want) or not np.array_equal(got, want):
            raise ValueError(
                f"Trajectory.image_spans[{i}] covers tokens [{sp.start}, {sp.end}) that are not the image "
                f"block of a {sp.grid_h}x{sp.grid_w} grid ({len(want)} tokens: model.image_tokens."
                "image_token_ids); record spans from the encoder's image positions "
                "(model.tokenizer.encode_chat_images)"
            )


def trajectory_from_batch(batch: pa.RecordBatch, row: int = 0) -> Trajectory:
    """Decode row `row` of a store-schema RecordBatch. Arrays are zero-copy read-only views."""
    return next(_decode_rows(batch, [row]))


def trajectories_from_batch(batch: pa.RecordBatch) -> list[Trajectory]:
    """Inverse of `trajectories_to_batch`."""
    return list(_decode_rows(batch, range(batch.num_rows)))


# ---- integrity: checksums, versions ------------------------------------------------------------------


class CorruptStoreFile(Exception):
    """A store file that must not be read (damaged, or not what its header says); the reader skips it."""


class NewerStoreVersion(ValueError):
    """A store file written by a newer Odyssey: raised, never skipped (that would silently lose data)."""


def batch_crc32(batch: pa.RecordBatch) -> int:
    """CRC-32 of a store-schema batch's content, column by column over exactly the logical data (the
    numeric list columns and the JSON strings as raw buffers, the small columns through their Python
    values). Equal for a batch and for what reading its file back gives. Only call it on a batch that
    passed `validate(full=True)`: it reads the buffers the offsets point into."""
    crc = 0
    for name, col in zip(batch.schema.names, batch.columns):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(np.asarray(col.is_null(), dtype=np.uint8).tobytes(), crc)
        if pa.types.is_large_list(col.type) and pa.types.is_large_binary(col.type.value_type):
            crc = _binary_list_crc32(col, crc)
        elif pa.types.is_large_list(col.type):
            offsets, values = _flat(col)
            crc = zlib.crc32(np.ascontiguousarray(offsets).tobytes(), crc)
            crc = zlib.crc32(memoryview(np.ascontiguousarray(values)).cast("B"), crc)
        elif pa.types.is_large_string(col.type):
            _, offsets_buf, data = col.buffers()
            offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=len(col) + 1, offset=8 * col.offset)
            crc = zlib.crc32(offsets.tobytes(), crc)
            if data is not None:
                crc = zlib.crc32(memoryview(data)[int(offsets[0]) : int(offsets[-1])], crc)
        else:
            crc = zlib.crc32(json.dumps(col.to_pylist(), default=repr).encode(), crc)
    return crc


def _binary_list_crc32(col: pa.LargeListArray, crc: int) -> int:
    """CRC-32 of a large_list<large_binary> column (the images): list offsets, then each row's blobs (their
    lengths and bytes), relative to where the column's data starts, so equal content gives equal CRCs."""
    offsets = col.offsets.to_numpy(zero_copy_only=True)
    crc = zlib.crc32(np.ascontiguousarray(offsets - offsets[0]).tobytes(), crc)
    blobs = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    _, boff_buf, data = blobs.buffers()
    boff = np.frombuffer(boff_buf, dtype=np.int64, count=len(blobs) + 1, offset=8 * blobs.offset)
    crc = zlib.crc32(np.ascontiguousarray(boff - boff[0]).tobytes(), crc)
    if data is not None:
        crc = zlib.crc32(memoryview(data)[int(boff[0]) : int(boff[-1])], crc)
    return crc


def _same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    return a.equals(b, check_metadata=False)


# columns newer than version 1, and the version that added them
_ADDED_IN = {"token_versions": 3, "images": 4, "image_spans": 4}


def _schema_of(version: int) -> pa.Schema:
    """The columns a file of schema `version` holds."""
    return pa.schema([f for f in SCHEMA if _ADDED_IN.get(f.name, 1) <= version])


# How each older schema version is read: a function from a validated batch of that version to one of the
# next version, chained up to SCHEMA_VERSION. To add version N+1 (say a new column): write the batch
# upgrade from N (append the column with the value old data implies), add it here under str(N), add the
# column to SCHEMA, bump SCHEMA_VERSION; every older store stays readable through the chain.
#   "1" -> "2": the same columns; version 2 files also carry a CRC-32 per record batch (_CRC_KEY).
#   "2" -> "3": a `token_versions` column (the policy version of each generated token), null before.
#   "3" -> "4": `images` and `image_spans` columns (the images a trajectory shows), empty before.


def _add_null_token_versions(batch: pa.RecordBatch) -> pa.RecordBatch:
    column = pa.nulls(batch.num_rows, type=pa.large_list(pa.int32()))
    return pa.RecordBatch.from_arrays([*batch.columns, column], schema=_schema_of(3))


def _add_no_images(batch: pa.RecordBatch) -> pa.RecordBatch:
    n = batch.num_rows
    images = pa.array([[] for _ in range(n)], type=pa.large_list(pa.large_binary()))
    spans = pa.array([[] for _ in range(n)], type=pa.list_(_IMAGE_SPAN_TYPE))
    return pa.RecordBatch.from_arrays([*batch.columns, images, spans], schema=_schema_of(4))


_UPGRADES: dict[str, Callable[[pa.RecordBatch], pa.RecordBatch]] = {
    "1": lambda batch: batch,
    "2": _add_null_token_versions,
    "3": _add_no_images,
}
_CHECKSUMMED_FROM = 2  # files of this version and later must carry a CRC per record batch


def _version_of(schema: pa.Schema) -> int:
    """The file's schema version; CorruptStoreFile for garbage, ValueError for a version newer than this
    code reads (a real newer file must not be silently dropped)."""
    raw = (schema.metadata or {}).get(_VERSION_KEY)
    try:
        version = int(raw.decode("ascii")) if raw is not None else None
    except (UnicodeDecodeError, ValueError):
        version = None
    if version is None or version < 1:
        raise CorruptStoreFile(f"schema version {raw!r} is not a version number")
    if version > int(SCHEMA_VERSION):
        raise NewerStoreVersion(
            f"trajectory schema version {version}, this code reads up to {SCHEMA_VERSION}; read the store "
            "with the Odyssey version that wrote it (or a newer one)"
        )
    return version


def _upgrade(batch: pa.RecordBatch, version: int) -> pa.RecordBatch:
    for v in range(version, int(SCHEMA_VERSION)):
        batch = _UPGRADES[str(v)](batch)
    return batch


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
        self._versions: dict[tuple[str, int, int], list[int | None]] = {}  # verified file -> policy versions

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
        crcs = json.dumps([batch_crc32(b) for b in batches]).encode()
        schema = SCHEMA.with_metadata({**SCHEMA.metadata, _CRC_KEY: crcs})
        with open(path, "wb") as f:
            with pa.ipc.new_file(f, schema, options=options) as writer:
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

    def load_file(self, path: str | os.PathLike) -> list[Trajectory] | None:
        """Every trajectory of one store file, or None (with a RuntimeWarning naming the file) when the file
        cannot be trusted: unreadable, truncated, a record batch that fails validation or its checksum,
        unexpected columns, or rows that do not decode. Validation and checksums come before any decoding,
        and a file is all or nothing: either all its rows are returned unchanged or none."""
        path = Path(path)
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            version = _version_of(reader.schema)
            crcs = None
            if version >= _CHECKSUMMED_FROM:
                crcs = json.loads((reader.schema.metadata or {}).get(_CRC_KEY, b"null"))
                if not isinstance(crcs, list) or len(crcs) != reader.num_record_batches:
                    raise CorruptStoreFile("its record batch checksums are missing or do not fit the batches")
            batches = []
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                if not _same_columns(batch.schema, _schema_of(version)):
                    raise CorruptStoreFile(f"record batch {i} has unexpected columns")
                batch.validate(full=True)  # offsets, lengths, UTF-8: before anything reads the buffers
                if crcs is not None and batch_crc32(batch) != crcs[i]:
                    raise CorruptStoreFile(f"record batch {i} fails its checksum (the data changed on disk)")
                batches.append(_upgrade(batch, version))
            return [t for batch in batches for t in _decode_rows(batch, range(batch.num_rows))]
        except (pa.ArrowException, OSError, CorruptStoreFile, ValueError, TypeError, KeyError, IndexError,
                RecursionError) as e:  # fmt: skip
            if isinstance(e, NewerStoreVersion):
                raise
            why = f"{type(e).__name__}: {e}"
            self._warn_once(path, f"TrajectoryStore: skipping corrupt file {path.name}: {why}")
            return None

    def _trajectories(self) -> Iterator[tuple[Path, list[Trajectory]]]:
        for path in self.files():
            trajs = self.load_file(path)
            if trajs is not None:
                self._versions[_file_key(path)] = [t.policy_version for t in trajs]
                yield path, trajs

    def __iter__(self) -> Iterator[Trajectory]:
        return self.iter()

    def iter(
        self, policy_version: int | None = None, min_policy_version: int | None = None
    ) -> Iterator[Trajectory]:
        """Yield stored trajectories in write order, optionally only those with
        metadata["policy_version"] == policy_version and/or >= min_policy_version. Damaged files are
        skipped with a warning naming them (see `load_file`).

        Arrays are zero-copy, read-only views into the memory-mapped file (`.copy()` to modify).
        """
        for _path, trajs in self._trajectories():
            for t in trajs:
                if _version_matches(t.policy_version, policy_version, min_policy_version):
                    yield t

    def read_all(
        self, policy_version: int | None = None, min_policy_version: int | None = None
    ) -> list[Trajectory]:
        return list(self.iter(policy_version, min_policy_version))

    def count(self, policy_version: int | None = None, min_policy_version: int | None = None) -> int:
        """Number of stored trajectories (matching the filter) that `iter` yields: each file is verified
        and decoded once (the result is cached per file, which never changes once written)."""
        n = 0
        for path in self.files():
            versions = self._versions.get(_file_key(path))
            if versions is None:
                trajs = self.load_file(path)
                if trajs is None:
                    continue
                versions = self._versions[_file_key(path)] = [t.policy_version for t in trajs]
            n += sum(_version_matches(v, policy_version, min_policy_version) for v in versions)
        return n

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


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (path.name, st.st_size, st.st_mtime_ns)


def _version_matches(v: int | None, version: int | None, min_version: int | None) -> bool:
    if version is None and min_version is None:
        return True
    return v is not None and (version is None or v == version) and (min_version is None or v >= min_version)


__all__ = [
    "ROLES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "CorruptStoreFile",
    "ImageSpan",
    "NewerStoreVersion",
    "StepInfo",
    "Trajectory",
    "TrajectoryStore",
    "TurnSpan",
    "batch_crc32",
    "check_image_tokens",
    "trajectories_from_batch",
    "trajectories_to_batch",
    "trajectory_from_batch",
]
