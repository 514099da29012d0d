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
    """What importing the libraries a command loads before its checks costs on this machine now
    (torch, Prefect, MLflow: ``ragen --help`` loads none of them): an answer that needs no work gets
    this plus 10 s, so a loaded machine does not fail the test while the work a defect did (a model
    loaded, a run started: tens of seconds) still would."""
    t0 = time.perf_counter()
    code = "import torch, prefect, mlflow, flows.cli"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0
