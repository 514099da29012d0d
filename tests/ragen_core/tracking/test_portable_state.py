"""A state folder copied (``cp -a``) or moved (``mv``) works as its own: the run index finds the copy's
runs, the MLflow store's artifact locations point into the copy, the original is never written, and
``ragen doctor`` names a folder whose records point elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from ragen_core.config.tracking import TrackingConfig
from ragen_core.state_folder import index_entry, locate_run, read_run_index
from ragen_core.tracking.store import moved_locations
from ragen_core.tracking.tracker import Tracker


@pytest.fixture(autouse=True)
def _local_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime: what a copy must leave unchanged."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def client(state: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{state.resolve()}/mlflow.db")


def locations(db: Path) -> list[str]:
    """Every artifact location the store holds (experiments, runs, logged models, model versions)."""
    with sqlite3.connect(db) as con:
        return [
            v
            for q in (
                "SELECT artifact_location FROM experiments",
                "SELECT artifact_uri FROM runs",
                "SELECT artifact_location FROM logged_models",
                "SELECT storage_location FROM model_versions",
            )
            for (v,) in con.execute(q)
        ]


def logged_state(state: Path, tmp_path: Path) -> tuple[str, str]:
    """A store in ``state`` with a run that has an artifact and a registered LoggedModel."""
    tracker = Tracker(TrackingConfig(experiment="exp"), state)
    run = tracker.start("r", {"a": 1})
    (tmp_path / "note.txt").write_text("hello")
    tracker.log_artifact(tmp_path / "note.txt")
    model = tracker.client.create_logged_model(tracker.experiment_id, name="m")
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    tracker.client.log_model_artifacts(model.model_id, str(tmp_path / "model"))
    tracker.client.create_registered_model("reg")
    tracker.client.create_model_version("reg", source=model.artifact_location, run_id=run)
    tracker.end()
    return run, model.model_id


@pytest.mark.parametrize("how", ["copy", "move"])
def test_a_copied_or_moved_store_points_its_artifacts_at_itself(tmp_path: Path, how: str) -> None:
    original, other = tmp_path / "state", tmp_path / "other"
    run, model_id = logged_state(original, tmp_path)
    if how == "copy":
        shutil.copytree(original, other, symlinks=True)  # cp -a
        before = listing(original)
    else:
        original.rename(other)
    assert moved_locations(other / "mlflow.db") == {  # MLflow's default experiment and ours
        (original.resolve() / "mlartifacts" / e).as_uri(): (other.resolve() / "mlartifacts" / e).as_uri()
        for e in ("Default", "exp")
    }
    tracker = Tracker(TrackingConfig(experiment="exp"), other)  # opening the store points it here
    assert moved_locations(other / "mlflow.db") == {}
    here = (other.resolve() / "mlartifacts").as_uri()
    theirs = [loc for loc in locations(other / "mlflow.db") if not loc.startswith(here)]
    assert theirs == [], theirs
    # a resumed run writes its artifacts into the copy, and reads the copy's
    tracker.start("r", {}, run_id=run)
    (tmp_path / "more.txt").write_text("more")
    tracker.log_artifact(tmp_path / "more.txt")
    tracker.end()
    assert {a.path for a in client(other).list_artifacts(run)} == {"note.txt", "more.txt"}
    files = {a.path for a in client(other).list_logged_model_artifacts(model_id)}
    assert files == {"config.json"}
    if how == "copy":
        assert listing(original) == before  # nothing written into the original


def test_a_store_someone_pointed_elsewhere_is_left_alone(tmp_path: Path) -> None:
    """Only locations that follow the state folder's layout (``<folder>/mlartifacts/<experiment>``) move."""
    state = tmp_path / "state"
    Tracker(TrackingConfig(experiment="exp"), state)
    mine = (tmp_path / "elsewhere").as_uri()
    client(state).create_experiment("chosen", artifact_location=mine)
    Tracker(TrackingConfig(experiment="exp"), state)
    assert client(state).get_experiment_by_name("chosen").artifact_location == mine


def test_the_run_index_is_relative_and_an_old_absolute_one_finds_the_copys_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragen_core.config import load_config
    from ragen_core.run.run_dir import create_run

    original, copy = tmp_path / "state", tmp_path / "copy"
    monkeypatch.setenv("RAGEN_STATE_DIR", str(original))
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "bandit-tiny.yaml")
    run = create_run(cfg)
    run_id = run.root.name
    assert read_run_index() == {run_id: f"runs/{run_id}"}
    outside = create_run(cfg, root=tmp_path / "elsewhere")  # a run outside the folder: absolute
    assert read_run_index()[outside.root.name] == str((tmp_path / "elsewhere" / outside.root.name).resolve())
    # as ragen-flow wrote indexes before: absolute entries
    (original / "runs.json").write_text(
        json.dumps({run_id: str(run.root.resolve()), outside.root.name: str(outside.root.resolve())})
    )
    assert locate_run(run_id) == run.root.resolve()  # an old index still loads
    shutil.copytree(original, copy, symlinks=True)
    before = listing(original)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(copy))
    assert locate_run(run_id) == copy / "runs" / run_id  # the copy's run, not the original's
    assert locate_run(outside.root.name) == outside.root.resolve()  # a run outside both: the same one
    assert index_entry(copy / "runs" / run_id) == f"runs/{run_id}"
    # a new run in the copy records the copy's old entries as its own
    new = create_run(cfg)
    assert read_run_index() == {
        run_id: f"runs/{run_id}",
        new.root.name: f"runs/{new.root.name}",
        outside.root.name: str(outside.root.resolve()),
    }
    assert listing(original) == before


def test_doctor_names_the_folder_the_records_point_into_and_fix_points_them_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-made state folder whose runs.json points into another one (and a copied MLflow store)."""
    from flows.cli.doctor import _check_copied_state

    original, copy = tmp_path / "state", tmp_path / "copy"
    logged_state(original, tmp_path)
    run = original / "runs" / "r-0123abcd-ef4567"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (original / "runs.json").write_text(json.dumps({run.name: str(run.resolve())}))
    shutil.copytree(original, copy, symlinks=True)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(copy))

    def doctor(fix: bool) -> list[str]:
        out = Console(width=1000, no_color=True, record=True)
        _check_copied_state(out, fix)
        return out.export_text().splitlines()

    [line] = doctor(fix=False)
    assert line.startswith(
        f"MOVED state folder {copy.resolve()} was copied or moved from {original.resolve()}: "
    )
    assert (
        "runs.json names 1 run(s) there" in line
        and "mlflow.db keeps the artifacts of 2 experiment(s)" in line
    )
    assert "`ragen doctor --fix`" in line
    fixed = doctor(fix=True)
    assert len(fixed) == 3 and all(f.startswith("fixed ") for f in fixed), fixed
    assert doctor(fix=False) == []
    assert read_run_index() == {run.name: f"runs/{run.name}"}
    assert moved_locations(copy / "mlflow.db") == {}
    assert not os.environ.get("MLFLOW_TRACKING_URI")
