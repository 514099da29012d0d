"""A state folder whose path an SQLite URL cannot carry is refused in one line, before any work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragen_core.state_folder import check_state_dir
from tests.process_env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["q?mode=ro", "a%20b"])
def test_a_state_folder_with_url_characters_is_refused_before_any_work(
    name: str, tmp_path: Path, cli_start_seconds: float
) -> None:
    """Before (``?``): both databases were written to one file ``<parent>/q`` outside the state folder,
    and the run failed after 10.7 s (50 s here) on ``CommandError: Can't locate revision``."""
    state = tmp_path / name
    args = ["train", "configs/bandit-tiny.yaml", "--set", "trainer.iterations=2", "--set", "sft=null"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=child_env(RAGEN_STATE_DIR=str(state)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    error = " ".join(proc.stderr.split())
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert took < cli_start_seconds + 10, took
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr  # one line, maybe wrapped
    assert str(state) in error and "RAGEN_STATE_DIR" in error and "a folder without" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "something was written"


def test_names_the_urls_carry_are_accepted(tmp_path: Path) -> None:
    """``#``, a lone ``%`` and spaces reach SQLite's file name unchanged (before this check, runs in
    ``a#b`` and ``100%`` trained and logged as anywhere else)."""
    for name in ("my state", "a#b", "100%", "x%zz"):
        check_state_dir(tmp_path / name / ".state")
    with pytest.raises(ValueError, match="holds '\\?'"):
        check_state_dir(tmp_path / "q?mode=ro")
