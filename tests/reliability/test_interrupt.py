"""Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group, with the ephemeral
Prefect server started by the run. The run stops within seconds, exits 130 with one line naming the
resume command, leaves no process, and the resume logs every MLflow step exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.flows.test_train import mlflow_steps, only_run
from tests.reliability import procs

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow

ITERATIONS = 6


def _wait_for(proc: object, path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]  # type: ignore[attr-defined]
        time.sleep(0.2)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param((), id="local"),
        # validation every iteration: the signal lands in a rollout or a validation of the Ray actors
        pytest.param(("trainer.backend=ray", "trainer.eval_every=1"), id="ray-validation"),
    ],
)
@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_ctrl_c_to_the_process_group_stops_the_run_in_seconds(
    sig: signal.Signals, code: int, said: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    """Before: the server died first and the flow retried against it for 75-151 s (139 s on the ray
    backend in validation), then exited 1 on `ConnectError` with Prefect's "Error logging to API" lines."""
    with procs.ray_current_cluster_kept():
        _interrupt_and_resume(sig, code, said, extra, tmp_path)


def _interrupt_and_resume(
    sig: signal.Signals, code: int, said: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    marker = procs.new_marker()
    args = procs.tiny_train_args(tmp_path, "sft=null", f"trainer.iterations={ITERATIONS}", *extra)
    proc, out, err = procs.launch(args, tmp_path, marker)
    try:
        _wait_for(proc, err, "iteration 1/", timeout=300)
        sent = time.monotonic()
        os.killpg(proc.pid, sig)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
        print(f"exit {rc} {took:.1f} s after the signal")
        text = out.read_text() + err.read_text()
        assert rc == code, text[-3000:]
        assert took <= 10, text[-3000:]
        for noise in (
            "Error logging to API",
            "ConnectError",
            "Traceback",
            "internal error",
            "Crash detected",
        ):
            assert noise not in text, text[-3000:]
        run = only_run(tmp_path)
        lines = [line for line in text.splitlines() if said in line]
        assert lines == [f"{said}; nothing is lost: resume with `ragen train --resume {run.name}`"], text[
            -2000:
        ]
        procs.assert_gone(marker, timeout=5)
    finally:
        procs.kill_tree(marker)

    procs.resume_to_the_end(run.name, tmp_path, marker)
    assert mlflow_steps(tmp_path, run) == list(range(ITERATIONS + 1))  # step 0: the start's validation
