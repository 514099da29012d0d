"""The real ``ragen`` CLI in a subprocess, for the reproductions that must fail before any work: no
Prefect server is needed (a command that reaches one has already started work), and each run is
timed."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.process_env import child_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "bandit-tiny.yaml"
TINY = ["--set", "trainer.iterations=2", "--set", "sft=null", "--set", "trainer.backend=local"]


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(args: list[str], state: Path, timeout: float = 120, **env: str) -> Ran:
    """``python -m flows.cli ARGS`` with ``state`` as the state folder, one torch thread."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=child_env(RAGEN_STATE_DIR=str(state), OMP_NUM_THREADS="1", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Ran(out.returncode, out.stdout, out.stderr, time.perf_counter() - t0)


def clear_error(out: Ran, *needles: str, max_lines: int = 3) -> str:
    """A user error: rc 1, a few lines, no traceback, no ``internal error``, every needle named."""
    text = out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]
    assert 1 <= len(lines) <= max_lines, text[-3000:]
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)
    return out.stderr
