"""Damaged run artifacts are named, never trained on nor blamed on reproducibility (a damaged file
used to be trained on, or reported by ``rerun`` as "DIFFERENT").

Each test damages a copy of one real tiny run (tests.flows.test_train's TINY settings, 3 iterations)
as a disk fault or a killed writer would (flipped bytes, a truncated file, a column of the wrong type),
then runs the real CLI on it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.flows.test_train import Result, assert_bitwise_equal, only_run, ragen, train
from tests.flows.test_train import weights as weights_of

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One uninterrupted tiny run (3 iterations); tests damage copies of it, in its state folder
    (its MLflow store knows the run, which ``--resume`` needs)."""
    state = tmp_path_factory.mktemp("integrity")
    out = train(state)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return state, only_run(state)


def copy_run(reference: tuple[Path, Path], tmp_path: Path) -> Path:
    copy = tmp_path / reference[1].name
    shutil.copytree(reference[1], copy)
    return copy


def error_line(out: Result, *needles: str) -> str:
    """The one line of output that says what failed: it must hold every needle (the file, the fix)."""
    lines = [line for line in (out.stderr + out.stdout).splitlines() if all(n in line for n in needles)]
    assert lines, f"no line with {needles}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    print(lines[-1])  # shown with -s: what a user reads
    return lines[-1]


def flip_inside_column(path: Path, column: str) -> None:
    """Flip two adjacent bytes inside ``column``'s pages such that Parquet still reads the file
    (with other values): the damage that only a digest can tell."""
    data = path.read_bytes()
    original = pq.read_table(path).column(column)
    rg = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(
        rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema.startswith(column)
    )
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    for p in range(start, start + chunk.total_compressed_size - 1):
        damaged = bytearray(data)
        damaged[p] ^= 0x01
        damaged[p + 1] ^= 0x01
        try:
            decoded = pq.read_table(pa.BufferReader(bytes(damaged))).column(column)
        except (pa.ArrowException, OSError):
            continue
        if not decoded.equals(original):
            path.write_bytes(bytes(damaged))
            return
    raise AssertionError(f"no readable 2-byte flip in {column} of {path}")


def test_resume_refuses_a_checkpoint_with_flipped_bytes(reference: tuple[Path, Path], tmp_path: Path) -> None:
    """XOR 4,096 bytes inside iteration 2's weights, delete iteration 3's DONE, resume: before,
    rc 0 and iteration 3 trained from the damaged weights."""
    state, _ = reference
    run = copy_run(reference, tmp_path)
    weights = run / "iter_0002" / "checkpoint" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    for i in range(4096, 8192):
        data[i] ^= 0xA5
    weights.write_bytes(bytes(data))
    (run / "iter_0003" / "DONE").unlink()
    trained = (run / "iter_0003" / "checkpoint" / "policy" / "model.safetensors").read_bytes()

    out = ragen(["train", "--resume", str(run)], state)
    assert out.returncode != 0
    error_line(out, f"{weights}: corrupt file", f"delete {run / 'iter_0002' / 'DONE'} and resume")
    assert not (run / "iter_0003" / "DONE").exists()
    assert (
        run / "iter_0003" / "checkpoint" / "policy" / "model.safetensors"
    ).read_bytes() == trained  # nothing trained

    # The fix the message gives is true: iteration 2 is recomputed (bitwise, on CPU), 3 trains from it.
    (run / "iter_0002" / "DONE").unlink()
    repaired = ragen(["train", "--resume", str(run)], state)
    assert repaired.returncode == 0, repaired.stdout[-3000:] + repaired.stderr[-3000:]
    assert_bitwise_equal(weights_of(run, 3), weights_of(reference[1], 3))


def test_rerun_learn_names_a_rollouts_file_with_flipped_bytes(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """Before: "learn of iteration 3: DIFFERENT (26 tensors differ)", blaming reproducibility."""
    state, _ = reference
    run = copy_run(reference, tmp_path)
    rollouts = run / "iter_0003" / "rollouts.parquet"
    flip_inside_column(rollouts, "input_ids")
    out = ragen(["rerun", str(run), "--iteration", "3", "--stage", "learn"], state)
    assert out.returncode not in (0, 2) and "DIFFERENT" not in out.stdout
    error_line(out, f"{rollouts}: corrupt file", "Restore it from a copy")


def test_rerun_rollout_names_a_truncated_stored_file(reference: tuple[Path, Path], tmp_path: Path) -> None:
    """Before: "rollout of iteration 3: DIFFERENT (Parquet files differ)"."""
    state, _ = reference
    run = copy_run(reference, tmp_path)
    rollouts = run / "iter_0003" / "rollouts.parquet"
    rollouts.write_bytes(rollouts.read_bytes()[:-100])
    out = ragen(["rerun", str(run), "--iteration", "3", "--stage", "rollout"], state)
    assert out.returncode not in (0, 2) and "DIFFERENT" not in out.stdout
    recomputed = run / "reruns" / "iter_0003" / "rollouts.parquet"
    error_line(out, f"{rollouts}: corrupt file", f"compared nothing; its own output is {recomputed}")
    # The rerun's own output is intact and is what the stored file held: the repair the message offers.
    assert recomputed.read_bytes() == (reference[1] / "iter_0003" / "rollouts.parquet").read_bytes()


@pytest.mark.parametrize("name", ["run.json", "config.yaml", "iter_0001/metrics.json"])
def test_resume_names_a_damaged_run_file(name: str, reference: tuple[Path, Path], tmp_path: Path) -> None:
    """Truncated: before, a JSON / YAML parser's error naming no file."""
    state, _ = reference
    run = copy_run(reference, tmp_path)
    damaged = run / name
    damaged.write_text(damaged.read_text()[: len(damaged.read_text()) // 2] + "\n  - [")  # no longer parses
    out = ragen(["train", "--resume", str(run)], state)
    assert out.returncode != 0
    error_line(out, f"{damaged}: ", "Restore it from a copy")


def test_show_names_a_column_of_the_wrong_type(reference: tuple[Path, Path], tmp_path: Path) -> None:
    """Before: a traceback from deep inside the summary table."""
    run = reference[1]
    table = pq.read_table(run / "iter_0001" / "rollouts.parquet")
    i = table.schema.get_field_index("score")
    text = table.set_column(
        i, pa.field("score", pa.string()), pa.array([str(v) for v in table.column(i).to_pylist()])
    )
    path = tmp_path / "text-score.parquet"
    pq.write_table(text.replace_schema_metadata(table.schema.metadata), path)
    out = ragen(["show", str(path)], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    error_line(out, str(path), "column 'score' has type string, expected float")
