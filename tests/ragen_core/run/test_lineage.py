"""The env groups as MLflow dataset inputs when two runs log the same ones at once (sweep members)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow.exceptions import MlflowException

from ragen_core.config import load_config
from ragen_core.config.tracking import TrackingConfig
from ragen_core.run.lineage import log_lineage
from ragen_core.run.run_dir import create_run
from ragen_core.tracking.tracker import Tracker


def _contexts(tracker: Tracker) -> set[str]:
    inputs = tracker.client.get_run(tracker.run_id).inputs.dataset_inputs
    return {t.value for d in inputs for t in d.tags if t.key == "mlflow.data.context"}


@pytest.fixture
def two_members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Tracker, Tracker]:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(overrides=[f"trainer.run_root={tmp_path / 'runs'}"])
    trackers = []
    for name in ("member-a", "member-b"):
        t = Tracker(TrackingConfig(experiment="sweep"), tmp_path / "state")
        t.start(name, {}, tags={})
        trackers.append(t)
    return cfg, (create_run(cfg, "a"), create_run(cfg, "b")), trackers[0], trackers[1]


def test_a_run_that_loses_the_insert_race_for_a_shared_dataset_logs_it_and_stays_online(
    two_members: tuple[Any, Any, Tracker, Tracker],
) -> None:
    """The race as MLflow's SQL store loses it: its lookup missed the row, the other member inserted it
    meanwhile, and this insert hits the unique key. The retry finds the row."""
    cfg, (run_a, run_b), a, b = two_members
    real = b.client.log_inputs
    calls = []

    def lose_the_race(run_id: str, datasets: Any = None, **kw: Any) -> None:
        calls.append(run_id)
        if len(calls) == 1:
            log_lineage(a, cfg, run_a)  # the other member wins
            raise MlflowException(
                "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name, "
                "datasets.digest"
            )
        real(run_id, datasets=datasets, **kw)

    b.client.log_inputs = lose_the_race  # type: ignore[method-assign]
    log_lineage(b, cfg, run_b)
    assert len(calls) == 2 and b.offline is None and a.offline is None
    assert _contexts(a) == _contexts(b) == {"train", "validation"}
    assert "lineage" in run_b.info()["logged_artifacts"]


def test_any_other_store_error_still_takes_the_tracker_offline(
    two_members: tuple[Any, Any, Tracker, Tracker],
) -> None:
    cfg, (_, run_b), _, b = two_members

    def broken(*args: Any, **kw: Any) -> None:
        raise MlflowException("database is locked")

    b.client.log_inputs = broken  # type: ignore[method-assign]
    log_lineage(b, cfg, run_b)
    assert b.offline is not None and "lineage" not in run_b.info().get("logged_artifacts", [])
