"""A store that fails mid-run (disk full under the SQLite store) is said in one line on the terminal; the
tracebacks that MLflow and SQLAlchemy log for it go to ``<state>/logs/libraries.log``.

Before, a full disk printed MLflow's "SQLAlchemy database error" with its whole traceback for each failed
call: about 90 lines during training and 200 for one evaluation, around the one line that matters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.process_env import child_env

ROOT = Path(__file__).resolve().parents[2]

#: SQLite's own failure, raised where MLflow's store writes metrics: MLflow logs it (with its traceback)
#: from its managed session, then raises it on as an MlflowException, as with a real full disk.
DISK_FULL = textwrap.dedent("""
    import sqlite3, sys
    from pathlib import Path
    import sqlalchemy.exc
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    fits = SqlAlchemyStore._update_latest_metrics_if_necessary

    def full(self, logged_metrics, session):  # the params went in; the disk filled before the metrics
        if not logged_metrics:
            return fits(self, logged_metrics, session)
        raise sqlalchemy.exc.OperationalError(
            "INSERT INTO metrics", {}, sqlite3.OperationalError("database or disk is full")
        )

    SqlAlchemyStore._update_latest_metrics_if_necessary = full
    state = Path(sys.argv[1])
""")

EVALUATE = DISK_FULL + textwrap.dedent("""
    from ragen_core.errors import describe
    from ragen_core.run.evaluation import EvaluateError, EvaluateRequest, Policy, log_evaluation

    out = state / "eval.parquet"
    out.write_bytes(b"rows")
    try:
        log_evaluation(EvaluateRequest(policy="m", tags=["Bandit"]), Policy("m", None, None, "m"), [],
                       {"val-env/Bandit/success": 1.0}, out, state)
    except EvaluateError as e:
        print(describe(e), file=sys.stderr)
""")

TRAIN = DISK_FULL + textwrap.dedent("""
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.tracking.tracker import Tracker

    tracker = Tracker(TrackingConfig(experiment="full"), state)
    tracker.start("full-disk", {"a": 1})
    for step in range(3):
        tracker.log_iteration(step, {"x": float(step)})
    tracker.end()
    print(tracker.offline_message("my-run", state / "runs" / "my-run"), file=sys.stderr)
""")


def _run(script: str, state: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", script, str(state)],
        cwd=ROOT,
        env=child_env(RAGEN_STATE_DIR=str(state), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def _in_the_log(state: Path) -> None:
    log = (state / "logs" / "libraries.log").read_text()
    assert "database or disk is full" in log and "Traceback" in log, log[-2000:]


def test_a_full_disk_during_evaluation_is_one_line(tmp_path: Path) -> None:
    text = _run(EVALUATE, tmp_path)
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text and "SQLAlchemy" not in text, text[-3000:]
    assert len(lines) == 2, text[-3000:]  # the tracker's warning as it happens, the command's error
    assert "not logged to MLflow" in lines[-1] and "run the same `ragen evaluate` again" in lines[-1]
    _in_the_log(tmp_path)


def test_a_full_disk_during_training_is_one_line_then_the_resume_command(tmp_path: Path) -> None:
    text = _run(TRAIN, tmp_path)
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text and "SQLAlchemy" not in text, text[-3000:]
    assert len(lines) == 2, text[-3000:]
    assert (
        "failing since log iteration 0" in lines[0] and str(tmp_path / "logs" / "libraries.log") in lines[0]
    )
    assert "`ragen train --resume my-run` logs what is missing" in lines[1]
    _in_the_log(tmp_path)
