"""Digests recorded when a file is written and checked when it is read (ragen_core.integrity)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from ragen_core.integrity import (
    SUMS_NAME,
    CorruptFileError,
    intact,
    read_sums,
    record,
    record_tree,
    recorded,
    sha256_file,
    verify,
    verify_tree,
)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_record_writes_sha256sum_format_that_coreutils_checks(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"hello")
    (tmp_path / "b.json").write_text("{}")
    record(tmp_path / "a.bin")
    record(tmp_path / "b.json")
    assert recorded(tmp_path / "a.bin") == hashlib.sha256(b"hello").hexdigest()
    assert set(read_sums(tmp_path)) == {"a.bin", "b.json"}
    done = subprocess.run(["sha256sum", "-c", SUMS_NAME], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_verify_names_the_corrupt_file_and_the_fix(tmp_path: Path) -> None:
    f = tmp_path / "rollouts.parquet"
    f.write_bytes(bytes(range(256)) * 64)
    record(f)
    assert verify(f)
    flip_byte(f, 1000)
    os.utime(f, ns=(1, 1))  # a new mtime: the memo cannot hide the change
    with pytest.raises(CorruptFileError, match=r"rollouts\.parquet: corrupt file.*rerun the rollout stage"):
        verify(f, fix="rerun the rollout stage")
    assert not intact(f)


def test_missing_recorded_file_and_unrecorded_file(tmp_path: Path) -> None:
    f = tmp_path / "metrics.json"
    f.write_text("{}")
    assert verify(f) is False  # nothing recorded: nothing to check against
    assert not intact(f)  # ... so a cache must not trust it
    record(f)
    f.unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        verify(f)


def test_tree_digest_covers_nested_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "policy" / "model.safetensors").write_bytes(os.urandom(5000))
    (ckpt / "optim.pt").write_bytes(os.urandom(100))
    sums = record_tree(ckpt)
    assert set(sums) == {"policy/model.safetensors", "optim.pt"}
    assert verify_tree(ckpt) and intact(ckpt)
    flip_byte(ckpt / "policy" / "model.safetensors", 4096)
    os.utime(ckpt / "policy" / "model.safetensors", ns=(2, 2))
    with pytest.raises(CorruptFileError, match=r"policy/model\.safetensors: corrupt"):
        verify_tree(ckpt)
    assert not intact(ckpt)


def test_memo_sees_a_rewrite(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"one")
    first = sha256_file(f)
    f.write_bytes(b"two")
    os.utime(f, ns=(3, 3))  # same size: the new mtime is what tells the memo
    assert sha256_file(f) != first


def test_corrupt_sums_file_is_named(tmp_path: Path) -> None:
    (tmp_path / SUMS_NAME).write_text("not a digest line\n")
    with pytest.raises(CorruptFileError, match=f"{SUMS_NAME}: line 1"):
        read_sums(tmp_path)
