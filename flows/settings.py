"""Process environment for ragen-flow's services, set before Prefect, MLflow or Ray are imported.

Embedded defaults (README's main job): Prefect starts an ephemeral local server with its state in
``.state/prefect``; MLflow writes a local SQLite store in ``.state``; no telemetry anywhere; no
downloads. Anything already set in the environment wins (e.g. ``PREFECT_API_URL`` or
``MLFLOW_TRACKING_URI`` pointing at real servers).
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR = Path(os.environ.get("RAGEN_STATE_DIR", ".state"))


def configure_environment(state_dir: str | os.PathLike[str] | None = None) -> Path:
    state = Path(state_dir or STATE_DIR).resolve()
    state.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(state / "prefect" / "results"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        # Stored results are read back on a cache hit; pickles would run whatever a crafted file holds.
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAGEN_STATE_DIR": str(state),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return state
