"""rl/trajectory.py: validation, Arrow round-trip (small and 1,048,576 tokens), store atomicity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rl.trajectory import (
    SCHEMA,
    Trajectory,
    TrajectoryStore,
    TurnSpan,
    trajectories_from_batch,
    trajectories_to_batch,
    trajectory_from_batch,
)
from tests.traj_factory import assert_traj_equal, make_traj, step

REPO = Path(__file__).resolve().parents[1]
LAYOUT = [
    ("prompt", 7),
    ("assistant", 5),
    ("observation", 6),
    ("assistant", 4),
    ("observation", 3),
    ("assistant", 2),
]


def _rich_traj(seed: int = 0, version: int | None = 1, routed: bool = True) -> Trajectory:
    return make_traj(
        LAYOUT,
        step_infos=[step(subgoals=["a"]), step(tool_errors=["unknown tool 'x'"], tool_calls=0)],
        n_moe_layers=3 if routed else None,
        seed=seed,
        outcome=0.5,
        terminated=True,
        rewards={"outcome": 0.5, "total": 0.5},
        turn_rewards=[0.1, -0.2, 0.0],
        metadata={
            "env_id": "arith",
            "task_id": f"t{seed}",
            "seed": np.int64(seed),
            "policy_version": version,
        },
    )


# ---- the dataclass -----------------------------------------------------------------------------


def test_views_and_coercion():
    t = make_traj(LAYOUT, generated_tail=1)
    assert t.n_tokens == 27 and t.n_assistant_turns == 3
    assert [s.start for s in t.assistant_spans()] == [7, 18, 25]
    assert t.n_generated == 4 + 3 + 1
    assert t.last_generated_index() == 25 and t.last_generated_index(t.assistant_spans()[0]) == 10

    # lists / bool / wider ints are coerced to the documented dtypes when lossless
    u = Trajectory(
        tokens=[1, 2, 3],
        loss_mask=np.array([False, True, True]),
        rollout_logprobs=np.array([np.nan, -1.0, -2.0]),
        routed_experts=np.ones((3, 2, 2), dtype=np.int64),
        turns=[{"role": "prompt", "start": 0, "end": 1}, TurnSpan("assistant", 1, 3)],
    )
    assert u.tokens.dtype == np.int32 and u.loss_mask.dtype == np.uint8
    assert u.rollout_logprobs.dtype == np.float32 and u.routed_experts.dtype == np.uint16


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(tokens=np.zeros(4, dtype=np.float32)), "must hold integers"),
        (dict(tokens=np.array([1, 2, 2**40, 3])), r"fit int32"),
        (dict(tokens=np.zeros((2, 2), dtype=np.int32)), "1-D"),
        (dict(loss_mask=np.array([0, 1, 2, 0])), "only 0 and 1"),
        (dict(loss_mask=np.zeros(3)), r"shape \[T=4\]"),
        (dict(rollout_logprobs=np.zeros(5, np.float32)), r"shape \[T=4\]"),
        (dict(rollout_logprobs=np.zeros(4, np.int32)), "floating point"),
        (dict(routed_experts=np.zeros((4, 2), np.uint16)), "n_moe_layers, k"),
        (dict(routed_experts=np.full((4, 1, 2), 70000)), "fit uint16"),
        (dict(turns=[TurnSpan("user", 0, 4)]), "role"),
        (dict(turns=[TurnSpan("prompt", 0, 2), TurnSpan("assistant", 1, 4)]), "overlaps"),
        (dict(turns=[TurnSpan("prompt", 0, 2), TurnSpan("assistant", 2, 9)]), "outside"),
        (dict(turns=[TurnSpan("prompt", 0, 4)]), "outside every assistant span"),
        (dict(step_infos=[{}, {}]), "at most one per assistant turn"),
        (dict(step_infos=["x"]), "list of dicts"),
        (dict(turn_rewards=[1.0, 2.0]), "one per assistant turn"),
    ],
)
def test_validation_errors(change, match):
    base = dict(
        tokens=np.arange(4, dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1], np.uint8),
        rollout_logprobs=np.array([np.nan, np.nan, -1, -1], np.float32),
        turns=[TurnSpan("prompt", 0, 2), TurnSpan("assistant", 2, 4)],
    )
    base.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        Trajectory(**base)


# ---- Arrow round-trip --------------------------------------------------------------------------


def test_arrow_record_roundtrip():
    trajs = [_rich_traj(0), _rich_traj(1, routed=False, version=None)]
    for t in trajs:
        assert_traj_equal(trajectory_from_batch(trajectories_to_batch([t])), t)
    batch = trajectories_to_batch(trajs)
    assert batch.schema.equals(SCHEMA) and batch.num_rows == 2
    back = trajectories_from_batch(batch)
    assert_traj_equal(back[0], trajs[0])
    assert_traj_equal(back[1], trajs[1])
    assert back[0].metadata["seed"] == 0  # numpy scalars in metadata are stored as JSON numbers
    empty = Trajectory(tokens=[], loss_mask=[], rollout_logprobs=[], routed_experts=np.zeros((0, 7, 2)))
    assert_traj_equal(trajectory_from_batch(trajectories_to_batch([empty])), empty)


def test_unserialisable_fields_are_clear_errors():
    t = _rich_traj(0)
    t.step_infos[0]["obj"] = object()
    with pytest.raises(TypeError, match="step_infos must be JSON-serialisable"):
        trajectories_to_batch([t])
    t = _rich_traj(0)
    t.metadata["policy_version"] = "v3"
    with pytest.raises(TypeError, match="policy_version"):
        trajectories_to_batch([t])


def test_store_roundtrip_batches_order_and_filters(tmp_path):
    store = TrajectoryStore(tmp_path, compression="zstd")
    written = [_rich_traj(i, version=i % 3) for i in range(7)]
    store.append(written[0])
    store.append(written[1:5], max_batch_tokens=40)  # several record batches in one file
    store.append(written[5:])
    assert len(store.files()) == 3 and len(store) == 7
    for a, b in zip(store.read_all(), written, strict=True):
        assert_traj_equal(a, b)
    assert store.count(policy_version=1) == 2
    assert store.count(min_policy_version=1) == 4
    assert [t.metadata["task_id"] for t in store.iter(policy_version=2)] == ["t2", "t5"]
    # a second store object on the same dir (another process's view) sees the same data
    assert len(TrajectoryStore(tmp_path)) == 7
    with pytest.raises(ValueError, match="at least one"):
        store.append([])


def test_store_roundtrip_1m_tokens(tmp_path):
    """One 1,048,576-token trajectory with routed_experts [T, 7, 2] uint16 survives byte for byte.

    Raw payload is 4 (token) + 1 (mask) + 4 (logprob) + 28 (experts) = 37 bytes/token; uncompressed
    storage must add < 1 % on top. Timing is measured in bench/trajectory.py, not here.
    """
    T = 1 << 20
    t = make_traj(
        [("prompt", 1000), ("assistant", T // 2 - 1000), ("observation", 1000), ("assistant", T // 2 - 1000)],
        step_infos=[step()],
        n_moe_layers=7,
        topk=2,
        metadata={"policy_version": 0},
    )
    assert t.n_tokens == T
    store = TrajectoryStore(tmp_path)
    path = store.append(t)
    bytes_per_token = path.stat().st_size / T
    assert 37 <= bytes_per_token < 37 * 1.01, bytes_per_token
    (u,) = store.read_all()
    assert_traj_equal(u, t)
    assert u.routed_experts.shape == (T, 7, 2)
    assert not u.tokens.flags.writeable  # zero-copy views into the memory-mapped file


# ---- atomicity -----------------------------------------------------------------------------------


def test_leftover_temp_file_is_ignored_with_warning(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.append(_rich_traj(0))
    # a complete, valid Arrow file that was never renamed is still not a record
    full = tmp_path / ".crashed-writer.arrow.tmp"
    with pa.ipc.new_file(str(full), SCHEMA) as w:
        w.write_batch(trajectories_to_batch([_rich_traj(1)]))
    (tmp_path / ".half.arrow.tmp").write_bytes(b"ARROW1\x00\x00garbage")
    with pytest.warns(RuntimeWarning, match="ignoring temporary file"):
        assert [t.metadata["task_id"] for t in store.read_all()] == ["t0"]
    os.utime(full, (0, 0))  # make one of them old
    assert store.remove_stale_temp(older_than_s=3600) == [full]


def test_truncated_file_is_skipped_with_warning(tmp_path):
    store = TrajectoryStore(tmp_path)
    good = store.append(_rich_traj(0))
    data = store.append(_rich_traj(1)).read_bytes()
    # e.g. a non-atomic copy from another filesystem: a final name with half the bytes
    for i, cut in enumerate((len(data) // 2, len(data) - 3, 10)):
        (tmp_path / f"zz-truncated{i}.arrow").write_bytes(data[:cut])
    with pytest.warns(RuntimeWarning, match="skipping corrupt file zz-truncated"):
        got = store.read_all()
    assert [t.metadata["task_id"] for t in got] == ["t0", "t1"]
    assert good.exists() and len(store) == 2


def test_silent_change_fails_the_checksum_and_skips_the_file(tmp_path):
    """A token id changed on disk keeps the file structurally valid; the per-batch CRC catches it."""
    store = TrajectoryStore(tmp_path)
    t = _rich_traj(0)
    marker = np.arange(1000, 1016, dtype=np.int32)
    t = Trajectory(**{**vars(t), "tokens": np.concatenate([marker, t.tokens[16:]])})
    path = store.append(t)
    store.append(_rich_traj(1))
    data = bytearray(path.read_bytes())
    at = bytes(data).find(marker.tobytes())
    assert at > 0
    data[at : at + 4] = np.int32(7).tobytes()
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=f"skipping corrupt file {path.name}.*fails its checksum"):
        got = store.read_all()
    assert [x.metadata["task_id"] for x in got] == ["t1"] and len(store) == 1


def _old_file(path, traj, version: bytes) -> None:
    """Write `traj` as a store file of an older schema version (1 or 2: no token_versions column; 1-3: no
    image columns)."""
    from rl.trajectory import _schema_of

    old = _schema_of(int(version)).with_metadata({b"odyssey.trajectory.schema_version": version})
    batch = trajectories_to_batch([traj])
    batch = pa.RecordBatch.from_arrays([batch.column(n) for n in old.names], schema=old)
    if version != b"1":  # version 2 carries a CRC-32 per record batch
        from rl.trajectory import batch_crc32

        old = old.with_metadata(
            {**old.metadata, b"odyssey.trajectory.batch_crc32": f"[{batch_crc32(batch)}]".encode()}
        )
        batch = batch.replace_schema_metadata(old.metadata)
    with pa.ipc.new_file(str(path), old) as w:
        w.write_batch(batch)


@pytest.mark.parametrize("version", [b"1", b"2", b"3"])
def test_older_stores_still_read(tmp_path, version):
    """Files written before checksums (schema "1"), before token_versions (schema "2") and before images
    (schema "3") read back unchanged, with token_versions None (1, 2) and no images."""
    t = _rich_traj(0)
    _old_file(tmp_path / "00-old.arrow", t, version)
    store = TrajectoryStore(tmp_path)
    store.append(_rich_traj(1))
    got = store.read_all()
    assert [x.metadata["task_id"] for x in got] == ["t0", "t1"] and len(store) == 2
    assert np.array_equal(got[0].tokens, t.tokens) and got[0].step_infos == t.step_infos
    assert got[0].token_versions is None or version == b"3"
    assert got[0].images == {} and got[0].image_spans == []


def test_unknown_schema_version_is_an_error(tmp_path):
    schema = SCHEMA.with_metadata({b"odyssey.trajectory.schema_version": b"999"})
    with pa.ipc.new_file(str(tmp_path / "x.arrow"), schema) as w:
        w.write_batch(trajectories_to_batch([_rich_traj(0)]).replace_schema_metadata(schema.metadata))
    with pytest.raises(ValueError, match="schema version"):
        TrajectoryStore(tmp_path).read_all()


_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from rl.trajectory import TrajectoryStore
    from tests.traj_factory import make_traj, step

    mode, root = sys.argv[1], sys.argv[2]

    class DiesMidWrite(TrajectoryStore):
        def _write_file(self, path, batches):
            super()._write_file(path, batches[:1])   # part of the file reaches the disk ...
            os.kill(os.getpid(), signal.SIGKILL)     # ... and the process dies before the rename

    def traj(i, n):
        return make_traj([("prompt", 16), ("assistant", n)], [step()], n_moe_layers=2, seed=abs(i),
                         metadata={{"i": i}})

    if mode == "self_kill":
        TrajectoryStore(root).append(traj(0, 100))
        DiesMidWrite(root).append([traj(i, 1000) for i in (1, 2, 3)], max_batch_tokens=1000)
    else:  # loop until the parent kills us
        store = TrajectoryStore(root, fsync=False)
        for i in range(10**6):
            store.append([traj(i, 50_000), traj(-i - 1, 10)])
    """
)


def _writer(mode: str, root: Path) -> subprocess.Popen:
    script = _WRITER.format(repo=str(REPO))
    return subprocess.Popen([sys.executable, "-c", script, mode, str(root)], cwd=REPO)


def test_writer_killed_mid_write_leaves_no_record(tmp_path):
    proc = _writer("self_kill", tmp_path)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].stat().st_size > 0  # the half-written file is there ...
    store = TrajectoryStore(tmp_path)
    with pytest.warns(RuntimeWarning, match="ignoring temporary file"):
        got = store.read_all()
    assert [t.metadata["i"] for t in got] == [0]  # ... and never read


def test_writer_killed_at_random_point_only_complete_files_visible(tmp_path):
    proc = _writer("loop", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.arrow"))) < 3 and time.monotonic() < deadline:
            assert proc.poll() is None, "writer subprocess died on its own"
            time.sleep(0.01)
        time.sleep(0.013)  # land somewhere in the middle of a later write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    store = TrajectoryStore(tmp_path)
    if any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):  # killed mid-write
        with pytest.warns(RuntimeWarning, match="ignoring temporary file"):
            got = store.read_all()
    else:  # killed between writes: nothing to warn about
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = store.read_all()
    files = store.files()
    assert len(files) >= 3
    assert len(got) == 2 * len(files)  # every visible file is complete: both rows of every append
    for k in range(0, len(got), 2):
        assert got[k].metadata["i"] == -got[k + 1].metadata["i"] - 1
        assert got[k].n_tokens == 50_016 and got[k].routed_experts.shape == (50_016, 2, 2)


# ---- per-token policy versions (schema 3) ------------------------------------------------------


def _versioned(seed: int = 0) -> Trajectory:
    """A partial rollout: generated tokens of versions 4 then 5 (a weight update mid-episode)."""
    t = _rich_traj(seed)
    v = np.full(t.n_tokens, -1, np.int32)
    gen = np.flatnonzero(t.loss_mask)
    v[gen] = np.where(np.arange(gen.size) < gen.size // 2, 4, 5)
    t.token_versions = v
    return Trajectory(**{f: getattr(t, f) for f in t.__dataclass_fields__})


def test_token_versions_roundtrip_and_oldest_version(tmp_path):
    t = _versioned()
    assert t.oldest_version == 4 and _rich_traj(0).oldest_version == 1  # no column: metadata's version
    TrajectoryStore(tmp_path).append([t, _rich_traj(1)])
    back = TrajectoryStore(tmp_path).read_all()
    assert_traj_equal(back[0], t)
    assert back[1].token_versions is None
    with pytest.raises(ValueError, match="token_versions must have shape"):
        Trajectory(tokens=[1, 2], loss_mask=[0, 0], rollout_logprobs=[0.0, 0.0], token_versions=[1])
