"""Links into the MLflow UI: the UI that shows a store (the tracking server itself, or for a local store
the one ``ragen ui`` serves on the state folder's remembered port), a run's page on the model-training
view, and an artifact as the UI serves it (an image that a markdown page embeds)."""

from __future__ import annotations

import os
import urllib.parse

from ragen_core.state_folder import mlflow_ui_url
from ragen_core.tracking.keys import MODEL_TRAINING_VIEW


def ui_base(tracking_uri: str, state_dir: str | os.PathLike[str], local_ui: str | None = None) -> str:
    """The MLflow UI that shows the store at ``tracking_uri``: the server itself, or for a local store
    ``local_ui`` (default the UI ``ragen ui`` serves for ``state_dir``)."""
    if urllib.parse.urlparse(tracking_uri).scheme in ("http", "https"):
        return tracking_uri.rstrip("/")
    return local_ui or mlflow_ui_url(state_dir)


def run_page(base: str, experiment_id: str, run_id: str) -> str:
    """A run's page on MLflow's model-training view (a bare link opens the GenAI view in a fresh browser)."""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def artifact_url(base: str, run_id: str, path: str) -> str:
    """Where the MLflow UI at ``base`` serves the run's artifact ``path``."""
    return f"{base}/get-artifact?{urllib.parse.urlencode({'path': path, 'run_uuid': run_id})}"
