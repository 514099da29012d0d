"""A run folder with a part that is a symbolic link to another place (``RUN/eval -> /elsewhere``) is refused
in one line before anything is written through it: its files would land outside the run, maybe in another
run's folder. Before, a resume or a rerun wrote through the link without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.run.run_dir import RunFileError, find_run, linked_part
from tests.reliability.cli import clear_error, run_cli


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "linked"
    (run / "iter_0001" / "checkpoint").mkdir(parents=True)
    (run / "run.json").write_text('{"run_id": "linked"}')
    (run / "config.yaml").write_text("trainer: {iterations: 2}\n")
    return run


@pytest.mark.parametrize("part", ["eval", "iter_0002", "iter_0001/checkpoint"])
def test_a_linked_part_is_named(part: str, tmp_path: Path) -> None:
    run = _run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if (run / part).exists():
        (run / part).rmdir()
    (run / part).symlink_to(elsewhere)
    assert linked_part(run) == run / part
    with pytest.raises(RunFileError) as caught:
        find_run(str(run))
    message = str(caught.value)
    assert "\n" not in message and f"{run / part} is a symbolic link (to {elsewhere})" in message
    assert "cp -a" in message


def test_a_run_without_links_opens(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert linked_part(run) is None and find_run(str(run)).root == run


def test_resume_refuses_a_linked_eval_folder_before_any_work(
    tmp_path: Path, cli_start_seconds: float
) -> None:
    run = _run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "eval").symlink_to(elsewhere)
    out = run_cli(["train", "--resume", str(run)], tmp_path)
    clear_error(out, f"{run / 'eval'} is a symbolic link")
    assert out.seconds < cli_start_seconds + 10, out.seconds
    assert list(elsewhere.iterdir()) == []
