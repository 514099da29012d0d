"""Trajectory Parquet files: round trip, atomic writes, clear errors on bad files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ragen_core.integrity import record
from ragen_core.learner.batch import to_token_batch
from ragen_core.trajectory import (
    SCHEMA_VERSION_KEY,
    Trajectory,
    TrajectoryFileError,
    read_table,
    read_trajectories,
    to_table,
    write_trajectories,
)


def make_traj(i: int, n_tokens: int = 12) -> Trajectory:
    mask = [0] * 5 + [1] * (n_tokens - 5)
    return Trajectory(
        run_id="r",
        iteration=3,
        split="train",
        env_tag="SimpleSokoban",
        group_id=i // 2,
        env_id=i,
        seed=10000 + i // 2,
        turn_count=2,
        success=i % 2 == 0,
        truncated=False,
        reward=10.7 - i,
        format_penalty=-0.1 * (i % 3),
        score=10.7 - i - 0.1 * (i % 3),
        input_ids=list(range(100 + i, 100 + i + n_tokens)),
        loss_mask=mask,
        turn_index=[0] * 5 + [1] * (n_tokens - 5),
        rollout_logprobs=[-0.5 * m for m in mask],
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "Turn 1: ünïcode √"}],
        actions=[["Up", "Left"], []],
        turn_rewards=[-0.2, 10.9],
        info={"k": [1, 2]},
    )


def test_round_trip_gives_identical_rows_and_tensors(tmp_path: Path) -> None:
    trajs = [make_traj(i, n_tokens=8 + i) for i in range(6)]
    path = write_trajectories(trajs, tmp_path / "iter_0" / "rollouts.parquet")
    back = read_trajectories(path)
    assert [b.input_ids for b in back] == [t.input_ids for t in trajs]
    assert back[1].messages == trajs[1].messages and back[0].info == {"k": [1, 2]}
    a = to_token_batch(to_table(trajs))
    b = to_token_batch(read_table(path))
    for name in (
        "input_ids",
        "attention_mask",
        "loss_mask",
        "turn_index",
        "rollout_logprobs",
        "scores",
        "group_ids",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert b.input_ids.shape == (6, 13)
    assert b.attention_mask.sum().item() == sum(8 + i for i in range(6))
    meta = pq.read_schema(path).metadata
    assert meta[SCHEMA_VERSION_KEY] == b"2"
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"


def test_pandas_reads_a_usable_frame(tmp_path: Path) -> None:
    path = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "r.parquet")
    df = pd.read_parquet(path)
    assert len(df) == 4 and df["success"].sum() == 2
    assert df.groupby("group_id")["score"].std().notna().all()


def test_same_content_gives_byte_identical_files(tmp_path: Path) -> None:
    a = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "a.parquet")
    b = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "b.parquet")
    assert a.read_bytes() == b.read_bytes()


def test_mismatched_token_columns_are_rejected() -> None:
    t = make_traj(0)
    t.loss_mask = t.loss_mask[:-1]
    with pytest.raises(ValueError, match="differ in length"):
        to_table([t])


def test_truncated_and_corrupt_files_name_the_file(tmp_path: Path) -> None:
    path = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "good.parquet")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(TrajectoryFileError, match=r"truncated\.parquet.*truncated or corrupt"):
        read_table(truncated)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(data[:100] + bytes(200) + data[300:])
    with pytest.raises(TrajectoryFileError, match=r"corrupt\.parquet"):
        read_trajectories(corrupt)
    with pytest.raises(TrajectoryFileError, match="no such trajectory file"):
        read_table(tmp_path / "missing.parquet")
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(to_table([make_traj(0)]).replace_schema_metadata({}), foreign)
    with pytest.raises(TrajectoryFileError, match="not a ragen-flow trajectory file"):
        read_table(foreign)


def test_unwritable_directory_gives_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root ignores permission bits: use a path under a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "sub" / "r.parquet"
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        target = ro / "r.parquet"
    with pytest.raises(OSError, match="cannot write trajectories"):
        write_trajectories([make_traj(0)], target)


WRITER = """
import sys, time
import ragen_core.trajectory as tr
from tests.ragen_core.test_trajectory import make_traj

# A slow disk: every Parquet write stalls after its bytes are out, before fsync and rename, so a
# kill lands inside a write whatever the machine's speed.
real_write = tr.pq.write_table
def slow_write(*args, **kwargs):
    real_write(*args, **kwargs)
    time.sleep(float(sys.argv[2]))
tr.pq.write_table = slow_write
trajs = [make_traj(i, n_tokens=400) for i in range(50)]
print("ready", flush=True)
while True:
    tr.write_trajectories(trajs, sys.argv[1])
"""


def test_killed_writer_never_replaces_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.parquet"
    good = [make_traj(i) for i in range(3)]
    write_trajectories(good, path)
    root = Path(__file__).resolve().parents[2]
    killed_mid_write = 0
    for delay in (0.05, 0.3, 0.7, 1.2):
        before = path.read_bytes()
        leftovers = set(tmp_path.glob(".rollouts.parquet.*.tmp"))
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), "0.5"], cwd=root, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rows = read_trajectories(path)  # whatever is there is a complete file: old or new
        assert len(rows) in (3, 50)
        if len(rows) == 3:
            assert path.read_bytes() == before
        killed_mid_write += bool(set(tmp_path.glob(".rollouts.parquet.*.tmp")) - leftovers)
    # The test only means something if some kills landed inside a write.
    assert killed_mid_write >= 1


# ------------------------------------------------------------------------------ integrity (checksums)


def test_a_flipped_byte_that_parquet_still_reads_is_reported_as_corrupt(tmp_path: Path) -> None:
    path = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "rollouts.parquet")
    assert (tmp_path / "SHA256SUMS").read_text().endswith("  rollouts.parquet\n")  # recorded at write
    table = pq.read_table(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(TrajectoryFileError, match=r"rollouts\.parquet: corrupt file: its sha256 .*rerun"):
        read_table(path)
    # Without the record the same file is read as before (nothing to check it against).
    (tmp_path / "SHA256SUMS").unlink()
    pq.write_table(table, tmp_path / "unrecorded.parquet")  # written by someone else: no record
    assert read_table(tmp_path / "unrecorded.parquet").num_rows == 4


def test_a_table_just_written_is_served_from_memory_only_while_its_file_is_unchanged(tmp_path: Path) -> None:
    path = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "rollouts.parquet")
    first = read_table(path)
    assert read_table(path) is first, "the filter and learn stages get the table the rollout stage wrote"
    from_disk = pq.read_table(path)
    assert first.equals(from_disk.select(first.schema.names), check_metadata=True)
    assert first.schema.equals(from_disk.select(first.schema.names).schema, check_metadata=True)
    # Another writer replaces the file (and records it): the new content is read, not the old table.
    other = to_table([make_traj(i) for i in range(6)]).replace_schema_metadata(from_disk.schema.metadata)
    pq.write_table(other, path)
    record(path)
    assert read_table(path).num_rows == 6
    # A file changed behind the record is checked, as any other: the memory copy is not served.
    path = write_trajectories([make_traj(i) for i in range(4)], tmp_path / "again.parquet")
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(TrajectoryFileError, match="corrupt file"):
        read_table(path)
    # A file read (and checked against its record) once is read from memory the second time.
    pq.write_table(other, tmp_path / "theirs.parquet")
    record(tmp_path / "theirs.parquet")
    theirs = read_table(tmp_path / "theirs.parquet")
    assert read_table(tmp_path / "theirs.parquet") is theirs
    # Only the last two written tables are kept.
    kept = write_trajectories([make_traj(i) for i in range(2)], tmp_path / "a.parquet")
    held = read_table(kept)
    for name in ("b", "c"):
        write_trajectories([make_traj(i) for i in range(2)], tmp_path / f"{name}.parquet")
    again = read_table(kept)
    assert again is not held and again.equals(held)


def test_a_column_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    import pyarrow as pa

    table = to_table([make_traj(i) for i in range(2)])
    i = table.schema.get_field_index("score")
    bad = table.set_column(i, pa.field("score", pa.string()), pa.array(["1.0", "oops"]))
    pq.write_table(bad.replace_schema_metadata(table.schema.metadata), tmp_path / "text-score.parquet")
    with pytest.raises(
        TrajectoryFileError, match=r"text-score\.parquet: column 'score' has type string, expected float"
    ):
        read_trajectories(tmp_path / "text-score.parquet")


def test_a_full_disk_names_the_file_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from ragen_core.storage import StorageWriteError

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    target = tmp_path / "iter_0001" / "rollouts.parquet"
    with pytest.raises(StorageWriteError) as err:
        write_trajectories([make_traj(0)], target)
    assert str(err.value).startswith(
        f"{target}: cannot write trajectories: No space left on device; "
        "free disk space or choose another trainer.run_root"
    )
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC and err.value.user_error
    assert os.listdir(target.parent) == []  # no temporary file left behind


def test_files_of_an_older_schema_version_stay_readable_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    """v1 files (iteration column numbered from 0) have the same columns: runs written before the
    renumbering still resume and rerun. A version this code does not know is refused by name."""
    from ragen_core.trajectory import schema_version

    table = to_table([make_traj(i) for i in range(2)])
    for version in ("1", "9"):
        pq.write_table(
            table.replace_schema_metadata({SCHEMA_VERSION_KEY: version.encode()}),
            tmp_path / f"v{version}.parquet",
        )
    assert schema_version(tmp_path / "v1.parquet") == "1"
    assert read_table(tmp_path / "v1.parquet").equals(table)
    with pytest.raises(
        TrajectoryFileError, match=r"v9\.parquet: trajectory schema v9, this ragen-flow reads v1 and v2"
    ):
        read_table(tmp_path / "v9.parquet")
