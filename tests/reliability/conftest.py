"""Shared fixtures of the reliability tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cli_start_seconds() -> float:
    """What starting the CLI costs on this machine now (``ragen --help``): an answer that needs no
    work gets this plus 10 s, so a loaded machine does not fail the test while the work a defect did
    (a model loaded, a run started: tens of seconds) still would."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flows.cli", "--help"], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0
