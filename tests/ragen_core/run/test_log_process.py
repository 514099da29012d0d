"""The run's MLflow logging process (``tracking.background: process``) against a real local store: the
run is handed over and back with every logged step, calls run in order, a bug is raised in the
training process, a dead logging process takes the tracker offline without losing anything, and a
killed training process's logging process finishes what it received while a resume waits for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ragen_core.config.tracking import TrackingConfig
from ragen_core.run.log_process import (
    LOCK_NAME,
    NICE_VAR,
    EarlierLoggingError,
    ProcessStepLog,
    open_step_log,
    wait_for_earlier_logging,
)
from ragen_core.run.run_dir import RunDir
from ragen_core.run.step_log import LocalStepLog, StepLogger
from ragen_core.tracking.tracker import LOGGED_STEPS_TAG, Tracker


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local store for the module (the first one of a machine builds the schema: seconds)."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(autouse=True)
def _local_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def started(state_dir: Path, tmp_path: Path, name: str) -> tuple[Tracker, StepLogger]:
    """A tracker holding a new MLflow run, and the step logger of an (empty) run folder."""
    tracker = Tracker(TrackingConfig(experiment="log-process"), state_dir)
    tracker.start(name, {})
    root = tmp_path / name
    root.mkdir()
    return tracker, StepLogger(tracker, RunDir(root), name, iterations=5)


def history(tracker: Tracker, run_id: str, key: str = "a") -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    return sorted((int(m.step), m.value) for m in client.get_metric_history(run_id, key))


def test_the_run_is_handed_over_and_back_with_every_step(state_dir: Path, tmp_path: Path) -> None:
    tracker, logger = started(state_dir, tmp_path, "handover")
    run_id = tracker.run_id
    assert run_id is not None
    logger.log_step(0, {"a": 0.0})  # the training process logs step 0 before the loop
    log = open_step_log("process", logger)
    assert isinstance(log, ProcessStepLog)
    assert log.wait_ready() >= 0.0
    for k in (1, 2, 3):
        log.submit("log_step", k, {"a": float(k)})
    log.submit("set_tags", {"echo_trap.test": "step 3"})
    log.flush()  # the training process's tracker is current again
    assert tracker.logged_steps == {0, 1, 2, 3}
    assert history(tracker, run_id) == [(k, float(k)) for k in range(4)]
    log.submit("log_step", 3, {"a": 99.0})  # a logged step is not logged again, in either process
    log.submit("log_step", 4, {"a": 4.0})
    log.close()
    assert tracker.logged_steps == {0, 1, 2, 3, 4}
    run = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(run_id)
    assert run.data.tags[LOGGED_STEPS_TAG] == "0-4"  # the marker stayed whole across both processes
    assert run.data.tags["echo_trap.test"] == "step 3"
    assert history(tracker, run_id) == [(k, float(k)) for k in range(5)]
    assert log.process.returncode == 0
    tracker.end()


def test_a_bug_in_a_call_is_raised_in_the_training_process(state_dir: Path, tmp_path: Path) -> None:
    tracker, logger = started(state_dir, tmp_path, "bug")
    log = ProcessStepLog(logger)
    log.submit("log_step", 1, {"a": 1.0})
    log.submit("log_step", 2, {"a": "high"})  # not a number: a bug, not a store failure
    log.submit("log_step", 3, {"a": 3.0})  # queued behind it: must not run
    with pytest.raises(TypeError, match="not a number") as raised:
        log.flush()
    assert any("in the MLflow logging process" in note for note in raised.value.__notes__)
    with pytest.raises(TypeError, match="not a number"):
        log.submit("log_step", 4, {"a": 4.0})
    with pytest.raises(ValueError, match="unknown step-log call 'log_metrics'"):
        log.submit("log_metrics", 5)
    log.close()
    assert tracker.offline is None
    assert history(tracker, tracker.run_id or "") == [(1, 1.0)]
    tracker.end()


def test_a_dead_logging_process_takes_the_tracker_offline(state_dir: Path, tmp_path: Path) -> None:
    tracker, logger = started(state_dir, tmp_path, "dead")
    log = ProcessStepLog(logger)
    log.submit("log_step", 1, {"a": 1.0})
    log.flush()
    os.kill(log.pid, signal.SIGINT)  # Ctrl-C is the training process's to handle: ignored here
    log.submit("log_step", 2, {"a": 2.0})
    log.flush()
    assert tracker.logged_steps == {1, 2} and tracker.offline is None
    log.process.kill()
    log.process.wait()
    log.submit("log_step", 3, {"a": 3.0})  # raises nothing: training goes on
    log.flush()
    log.close()
    assert tracker.offline is not None
    assert "logging process" in tracker.offline and "exited with code -9" in tracker.offline
    msg = tracker.offline_message("dead", logger.run.root)
    assert msg is not None and "`ragen train --resume dead`" in msg  # step 3 is in the run folder
    assert history(tracker, tracker.run_id or "") == [(1, 1.0), (2, 2.0)]
    tracker.end()  # offline: releases the run without a store call


TRAINING_PROCESS = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from ragen_core.run.log_process import ProcessStepLog
    from ragen_core.run.run_dir import RunDir
    from ragen_core.run.step_log import StepLogger
    from ragen_core.tracking.tracker import Tracker
    from ragen_core.config.tracking import TrackingConfig

    state, root, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    tracker = Tracker(TrackingConfig(experiment="log-process"), state)
    print(tracker.start("killed", {}), flush=True)
    log = ProcessStepLog(StepLogger(tracker, RunDir(root), "killed", n))
    for k in range(1, n + 1):
        log.submit("log_step", k, {"a": float(k)})
    os.kill(os.getpid(), 9)  # before any flush: the logging process still has work queued
""")


def test_a_killed_training_process_loses_no_step_and_a_resume_waits(state_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "killed"
    root.mkdir()
    n = 40
    script = tmp_path / "train.py"
    script.write_text(TRAINING_PROCESS)
    out = subprocess.run(
        [sys.executable, str(script), str(state_dir), str(root), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == -9, out.stderr
    run_id = out.stdout.split()[0]
    assert (root / LOCK_NAME).exists()
    wait_for_earlier_logging(root)  # returns once the orphaned logging process is done
    tracker = Tracker(TrackingConfig(experiment="log-process"), state_dir)
    tracker.start("killed", {}, run_id=run_id)  # what a resume reads
    assert tracker.logged_steps == set(range(1, n + 1))
    assert history(tracker, run_id) == [(k, float(k)) for k in range(1, n + 1)]  # each step once
    tracker.end()


def test_a_resume_stops_waiting_for_a_stuck_logging_process(tmp_path: Path) -> None:
    import fcntl

    (tmp_path / LOCK_NAME).touch()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path / LOCK_NAME),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(EarlierLoggingError, match="still running after 1 s"):
            wait_for_earlier_logging(tmp_path, timeout_s=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait()
    wait_for_earlier_logging(tmp_path, timeout_s=1.0)  # free again
    with open(tmp_path / LOCK_NAME) as f:  # and nothing of ours holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_logging_process_runs_below_training_and_a_bad_nice_is_named(
    state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker, logger = started(state_dir, tmp_path, "nice")
    monkeypatch.setenv(NICE_VAR, "ten")
    with pytest.raises(ValueError, match=f"{NICE_VAR}='ten'.*0 \\(off\\) to 19"):
        ProcessStepLog(logger)  # before any process is started or lock taken
    assert not (logger.run.root / LOCK_NAME).exists()
    monkeypatch.delenv(NICE_VAR)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    log = ProcessStepLog(logger)
    assert os.getpriority(os.PRIO_PROCESS, log.pid) == min(mine + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine, "training keeps its own priority"
    log.submit("log_step", 1, {"a": 1.0})
    log.close()
    assert tracker.logged_steps == {1}
    tracker.end()


def test_the_other_modes_log_in_this_process(state_dir: Path, tmp_path: Path) -> None:
    for mode in ("thread", "off"):
        tracker, logger = started(state_dir, tmp_path, f"mode-{mode}")
        log = open_step_log(mode, logger)
        assert isinstance(log, LocalStepLog)
        log.submit("log_step", 1, {"a": 1.0})
        if mode == "off":  # at once, in the caller's thread
            assert tracker.logged_steps == {1}
        log.flush()
        log.close()
        assert tracker.logged_steps == {1}
        tracker.end()


def test_background_mode_reads_the_old_bools() -> None:
    assert TrackingConfig().background == "process"
    assert TrackingConfig(background=True).background == "process"
    assert TrackingConfig(background=False).background == "off"
    assert TrackingConfig(background="thread").background == "thread"
    with pytest.raises(ValueError, match="background"):
        TrackingConfig(background="subprocess")


def test_a_step_whose_marker_was_lost_is_logged_again_without_a_duplicate_point(
    state_dir: Path, tmp_path: Path
) -> None:
    """A tracking server that dies between committing a step's metrics and its marker (MLflow's SQL store
    commits them apart) leaves the step unmarked: the resume logs it again. The points carry the step's
    own time (its metrics file's), so the store keeps one point per step, not two."""
    tracker, logger = started(state_dir, tmp_path, "lost-marker")
    run_id = tracker.run_id
    assert run_id is not None
    metrics = {"a": 2.0, "b": 0.5}
    logger.run.iter_dir(2).mkdir(parents=True)
    logger.run.metrics_file(2).write_text(json.dumps(metrics))
    logger.log_step(2, metrics)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    client.delete_tag(run_id, LOGGED_STEPS_TAG)  # the metrics are stored, the marker is not

    resumed = Tracker(TrackingConfig(experiment="log-process"), state_dir)
    assert resumed.start("lost-marker", {}, run_id=run_id) == run_id
    assert resumed.logged_steps == set()
    StepLogger(resumed, logger.run, "lost-marker", iterations=5).log_step(2, metrics)
    assert history(resumed, run_id) == [(2, 2.0)]
    assert history(resumed, run_id, "b") == [(2, 0.5)]
    assert client.get_run(run_id).data.tags[LOGGED_STEPS_TAG] == "2"
    # What the step's own time guards against: the same point at another time is a second point.
    client.log_batch(run_id, metrics=[Metric("b", 0.5, 1, 2)], synchronous=True)
    assert history(resumed, run_id, "b") == [(2, 0.5), (2, 0.5)]
