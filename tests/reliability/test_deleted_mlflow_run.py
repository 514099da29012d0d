"""A run whose MLflow run was deleted (MLflow's trash) is not resumed into an obscure store error: one line
says it was deleted and gives the command that restores it; after that command the resume works."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ragen_core.config.tracking import TrackingConfig
from ragen_core.errors import describe, is_user_error
from ragen_core.tracking.offline import TrackingError
from ragen_core.tracking.tracker import Tracker
from tests.process_env import child_env
from tests.test_e2e import tool


def test_resuming_a_deleted_mlflow_run_says_how_to_restore_it(tmp_path: Path) -> None:
    """Before: ``failed to start run 'r': MlflowException: The run ... must be in the 'active' state``."""
    first = Tracker(TrackingConfig(experiment="deleted"), tmp_path)
    run_id = first.start("r", {"a": 1})
    assert first.log_iteration(0, {"x": 1.0})
    first.end("KILLED")
    first.client.delete_run(run_id)

    with pytest.raises(TrackingError) as caught:
        Tracker(TrackingConfig(experiment="deleted"), tmp_path).start("r", {"a": 1}, run_id=run_id)
    message = describe(caught.value)
    assert is_user_error(caught.value) and "\n" not in message, message
    assert f"MLflow run {run_id} of this run was deleted" in message and "mlflow runs restore" in message
    command = next(p for p in message.split("`") if "runs restore" in p)  # as the user would paste it
    env_part, _, cli = command.partition(" ")
    key, _, uri = env_part.partition("=")
    assert key == "MLFLOW_TRACKING_URI", command
    restored = subprocess.run(
        [tool("mlflow"), *cli.split()[1:]],
        env=child_env(**{key: uri, "MLFLOW_DISABLE_TELEMETRY": "true"}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.fspath(tmp_path),
    )
    assert restored.returncode == 0, restored.stderr[-2000:]

    again = Tracker(TrackingConfig(experiment="deleted"), tmp_path)
    assert again.start("r", {"a": 1}, run_id=run_id) == run_id
    assert again.logged_steps == {0}
    again.end()
