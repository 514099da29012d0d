"""The registry: one registered model per config (or sweep group), a version per run's kept policy with
its run, step and validation success as tags, the run's own aliases; ``models:/<run id>@best`` resolves
for runs registered so and for those registered before (a model per run). Real MLflow store, stored
runs (no training)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from ragen_core.run.logged_models import log_kept_models, registry_name, resolve_model_uri, run_alias
from ragen_core.run.run_dir import RunDir
from tests.ragen_core.tracking.test_core_metrics import config, stored_run, train_and_log


@pytest.fixture(autouse=True)
def _local_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "state"))


def _registered(tmp_path: Path, name: str, **info: str) -> tuple[RunDir, MlflowClient, dict[str, str]]:
    """A stored run (validated at 0 and 2) with a policy folder after step 2, logged and its kept
    policies registered as a finished run does."""
    cfg = config(tmp_path)
    run = stored_run(cfg, name)
    run.update_info(**info)
    policy = run.policy_after(2)
    policy.mkdir(parents=True)
    (policy / "config.json").write_text("{}")
    tracker, _ = train_and_log(cfg, run, tmp_path / "state")
    tracker.run_id = run.info()["mlflow_run_id"]
    models = log_kept_models(tracker, run, {"final": 2, "best": 2})
    assert set(models) == {"final", "best"}
    return run, MlflowClient(tracking_uri=tracker.tracking_uri), models


def test_the_seeds_of_one_config_are_versions_of_one_registered_model(tmp_path: Path) -> None:
    a, client, _ = _registered(tmp_path, "seed0", config_name="bandit-tiny")
    b, _, _ = _registered(tmp_path, "seed1", config_name="bandit-tiny")
    assert registry_name(a.info()) == registry_name(b.info()) == "bandit-tiny"
    # registering leaves MLflow's process-wide tracking URI unset, as it found it (setting it to the
    # default sent every later default client to ./mlflow.db)
    assert not mlflow.is_tracking_uri_set()
    assert [m.name for m in client.search_registered_models()] == ["bandit-tiny"]  # not one per run
    versions = client.search_model_versions("name='bandit-tiny'")
    assert len(versions) == 2
    for run in (a, b):
        run_id = run.info()["run_id"]
        assert run.info()["registered_model"] == "bandit-tiny"
        version = client.get_model_version_by_alias("bandit-tiny", run_alias(run_id, "best"))
        assert (
            client.get_model_version_by_alias("bandit-tiny", run_alias(run_id, "final")).version
            == version.version
        )
        # the version says what it is and what it reached, on the Models page
        assert version.tags["ragen.run_id"] == run_id and version.tags["ragen.step"] == "2"
        assert version.tags["val-env/Bandit/success"] == "0.7500"
        assert version.tags["val-env/BanditTest/success"] == "0.1250"
        # the short form finds the run's policy by its run tag
        got = resolve_model_uri(f"models:/{run_id}@best", _tracker(tmp_path), tmp_path / "cache")
        assert got.folder == run.policy_after(2) and got.run_id == run_id and got.step == 2


def test_a_sweep_group_is_one_registered_model(tmp_path: Path) -> None:
    run, client, _ = _registered(
        tmp_path, "ab.no-filter-s0", sweep="ab", sweep_member="no-filter-s0", sweep_group="no-filter"
    )
    assert run.info()["registered_model"] == "ab.no-filter"
    alias = run_alias(run.info()["run_id"], "best")
    assert "." not in alias  # what MLflow refuses in an alias
    assert (
        client.get_model_version_by_alias("ab.no-filter", alias).tags["ragen.run_id"] == run.info()["run_id"]
    )


def test_a_run_registered_before_keeps_its_own_model_and_aliases(tmp_path: Path) -> None:
    """A run without a config name (created before 2026-12-05) keeps the model named after it, with
    the plain aliases: resuming it appends to its history, it does not move it."""
    run, client, _ = _registered(tmp_path, "old")
    run_id = run.info()["run_id"]
    assert registry_name(run.info()) == run_id
    assert client.get_model_version_by_alias(run_id, "best").tags["ragen.step"] == "2"
    got = resolve_model_uri(f"models:/{run_id}@final", _tracker(tmp_path), tmp_path / "cache")
    assert got.folder == run.policy_after(2)


def test_an_unknown_run_in_a_models_uri_says_where_it_looked(tmp_path: Path) -> None:
    from ragen_core.run.logged_models import ModelURIError

    _registered(tmp_path, "seed0", config_name="bandit-tiny")
    with pytest.raises(ModelURIError, match="not in the MLflow registry"):
        resolve_model_uri("models:/no-such-run@best", _tracker(tmp_path), tmp_path / "cache")


def _tracker(tmp_path: Path):
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.tracking.tracker import Tracker

    return Tracker(TrackingConfig(), tmp_path / "state")
