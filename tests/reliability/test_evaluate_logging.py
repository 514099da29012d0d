"""An evaluation whose MLflow logging failed (disk full in the store) is not reported as a success: a
user error naming what was not logged and how to log it, and no MLflow run left RUNNING."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ragen_core.errors import describe, is_user_error
from ragen_core.run.evaluation import EvaluateError, EvaluateRequest, Policy, log_evaluation


def test_disk_full_store_fails_the_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))

    log_batch = MlflowClient.log_batch

    def disk_full(self: MlflowClient, *args: object, **kwargs: object) -> None:
        if kwargs.get("metrics"):  # the params went in; the disk filled up before the metrics
            raise OSError(errno.ENOSPC, "No space left on device")
        log_batch(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MlflowClient, "log_batch", disk_full)
    out = tmp_path / "eval.parquet"
    out.write_bytes(b"rows")
    request = EvaluateRequest(policy="m", tags=["Bandit"])
    with pytest.raises(EvaluateError) as caught:
        log_evaluation(
            request, Policy("m", None, None, "m"), [], {"val-env/Bandit/success": 1.0}, out, tmp_path
        )
    message = describe(caught.value)
    assert is_user_error(caught.value) and "\n" not in message
    assert "not logged to MLflow" in message and str(out) in message and "ragen evaluate" in message
    monkeypatch.undo()
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(
        [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()]
    )
    assert runs and all(r.info.status == "FAILED" for r in runs), [r.info.status for r in runs]
