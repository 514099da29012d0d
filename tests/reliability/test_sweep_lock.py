"""One ``ragen sweep run`` of a sweep at a time: a second one while the first runs its members is
refused in one line naming the holder; the lock of a holder that died is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.sweep import SweepRequest, run_sweep
from flows.train import TrainRequest
from ragen_core.sweep.spec import load_sweep
from ragen_core.sweep.state import SweepState, sweep_lock
from tests.flows.test_sweep import FakeTrain
from tests.process_env import child_env
from tests.ragen_core.sweep.test_sweep_spec import write_sweep

#: MLflow's local store and a CLI process per test (~10-20 s each on 2 busy cores)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_state")]

ROOT = Path(__file__).resolve().parents[2]


class SecondRunDuringFirstMember(FakeTrain):
    """While the first member trains, ``ragen sweep run`` of the same file in another process."""

    def __init__(self, state: Path, path: Path) -> None:
        super().__init__(state)
        self.path = path
        self.second: subprocess.CompletedProcess[str] | None = None
        self.took = 0.0

    def __call__(self, request: TrainRequest) -> dict:
        if self.second is None:
            t0 = time.monotonic()
            self.second = subprocess.run(
                [sys.executable, "-m", "flows.cli", "sweep", "run", str(self.path)],
                cwd=ROOT,
                env=child_env(RAGEN_STATE_DIR=str(self.state)),
                capture_output=True,
                text=True,
                timeout=120,
            )
            self.took = time.monotonic() - t0
        return super().__call__(request)


def _sweep_file(tmp_path: Path, name: str) -> Path:
    return write_sweep(
        tmp_path / "s.yaml",
        name=name,
        overrides=[f"trainer.run_root={tmp_path / 'runs'}"],
        members=[{"name": "a"}, {"name": "b"}],
    )


def test_a_second_run_of_a_sweep_in_flight_is_refused_naming_the_holder(state: Path, tmp_path: Path) -> None:
    """Before: both ran every member (4 runs for 2 members, two MLflow parent runs, both exit 0)."""
    path = _sweep_file(tmp_path, "locked")
    fake = SecondRunDuringFirstMember(state, path)
    out = run_sweep(SweepRequest(path=str(path)), train_fn=fake, state_dir=state)
    assert sorted(fake.keys()) == ["a-s0", "b-s0"] and sorted(out["finished"]) == ["a-s0", "b-s0"]
    second = fake.second
    assert second is not None
    error = " ".join(second.stderr.split())
    print(f"second run refused in {fake.took:.1f} s: {error}")
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert len(second.stderr.strip().splitlines()) <= 2, second.stderr  # one line (maybe wrapped)
    assert f"sweep is in use by process {os.getpid()} on " in error and "run it again" in error, error
    assert fake.took < 20, fake.took  # a CLI start on a busy machine; no Prefect, no training
    # the lock went with the first run: the sweep runs again (nothing left to train)
    again = FakeTrain(state)
    run_sweep(SweepRequest(path=str(path)), train_fn=again, state_dir=state)
    assert again.keys() == []


def test_the_lock_of_a_dead_holder_is_taken_over(state: Path, tmp_path: Path) -> None:
    path = _sweep_file(tmp_path, "stale")
    folder = SweepState.folder(state, load_sweep(path))
    folder.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from ragen_core.sweep.state import sweep_lock; "
            "sweep_lock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)",
            str(folder),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(Exception, match=f"sweep is in use by process {holder.pid}"):
            sweep_lock(folder).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    fake = FakeTrain(state)
    out = run_sweep(SweepRequest(path=str(path)), train_fn=fake, state_dir=state)
    assert sorted(out["finished"]) == ["a-s0", "b-s0"]
