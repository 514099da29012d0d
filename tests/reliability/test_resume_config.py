"""A resume reads the config its stored iterations were made with: a config.yaml edited by hand (its
SHA256SUMS recomputed) is refused naming the keys; an accepted extension of trainer.iterations is
recorded in MLflow as a history, not warned about."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ragen_core.config import DEFAULT_CONFIG, load_config
from ragen_core.config.tracking import TrackingConfig
from ragen_core.integrity import record
from ragen_core.run.resume import ResumeError, resume_config
from ragen_core.run.run_dir import RunDir, create_run
from tests.reliability.cli import clear_error, run_cli


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))
    return create_run(load_config(DEFAULT_CONFIG, ["trainer.iterations=2", "sft=null"]), "edited")


def _edit_lr(run: RunDir) -> None:
    text = run.config_path.read_text()
    assert "actor_lr: 0.0001" in text, text[:2000]
    run.config_path.write_text(text.replace("actor_lr: 0.0001", "actor_lr: 0.001"))
    record(run.config_path)  # SHA256SUMS recomputed: the digest no longer tells


def test_hand_edited_config_is_refused_on_resume(run: RunDir, tmp_path: Path) -> None:
    _edit_lr(run)
    out = run_cli(["train", "--resume", run.root.name], tmp_path)
    clear_error(out, "config.yaml was edited", "learner.optim.actor_lr: recorded 0.0001, config.yaml 0.001")
    assert "start a new run" in out.stderr


def test_unedited_config_and_documented_extension_pass(run: RunDir) -> None:
    cfg, changes = resume_config(run.root, run.config(), 0, None, ["trainer.iterations=4"])
    assert cfg.trainer.iterations == 4 and set(changes) == {"trainer.iterations"}
    _edit_lr(run)
    with pytest.raises(ResumeError, match=r"learner\.optim\.actor_lr"):
        resume_config(run.root, run.config(), 0, None, ["trainer.iterations=4"])


def test_extended_iterations_recorded_as_history(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ragen_core.tracking.tracker import Tracker

    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", system_metrics=False)
    run_id = None
    for iterations in (2, 4, 8):
        tracker = Tracker(tracking, tmp_path)
        with caplog.at_level(logging.WARNING):
            run_id = tracker.start("r", {"trainer": {"iterations": iterations}, "seed": 1}, run_id=run_id)
        tracker.end()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    got = tracker.client.get_run(run_id)
    assert got.data.tags["ragen.resume.trainer.iterations"] == "2 -> 4 -> 8"
    assert got.data.params["trainer.iterations"] == "2"  # MLflow keeps a param's first value
