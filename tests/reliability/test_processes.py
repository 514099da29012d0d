"""Child servers die with their parent: a SIGKILLed ``ragen train`` leaves no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.reliability import procs


@pytest.mark.parametrize("backend", ["ray"])
def test_sigkilled_train_leaves_no_process(backend: str, tmp_path: Path) -> None:
    """RAGEN_CRASH_AT makes the run SIGKILL itself in iteration 2: its Prefect server (and with
    trainer.backend=ray the GCS, raylet, agents and workers) must be gone within a few seconds."""
    marker = procs.new_marker()
    proc, out, err = procs.launch(procs.tiny_train_args(tmp_path, f"trainer.backend={backend}"), tmp_path, marker,
                                  extra_env={"RAGEN_CRASH_AT": "learn:2"})
    try:
        code = proc.wait(timeout=600)
        assert code == -9, out.read_text()[-2000:] + err.read_text()[-3000:]
        killed = time.monotonic()
        left = procs.wait_gone(marker, timeout=10)
        print(f"tree gone {time.monotonic() - killed:.1f} s after the SIGKILL")
        assert not left, "left behind: " + "; ".join(f"{pid} {cmd[:150]}" for pid, cmd in left.items())
    finally:
        procs.kill_tree(marker)
