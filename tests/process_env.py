"""The environment a CLI child process of a test starts from: the one pytest itself started with.

In-process tests (Typer's CliRunner, flows called directly, ``init_ray``) configure this process as a run
would: ``flows.settings.configure_environment`` sets ``PREFECT_LOCAL_STORAGE_PATH``, ``RAGEN_STATE_DIR``,
Ray's auth mode and so on, and a setting already present wins over a run's own default. A child process
that inherited them would write its Prefect results into another test's folder. Children therefore start
from this snapshot (taken when ``tests/conftest.py`` imports this module, before any test runs), as a
user's shell would, plus what the test chooses.
"""

from __future__ import annotations

import os

BASELINE: dict[str, str] = dict(os.environ)
# What a user's shell would not carry into a run of their own: a crash hook, another server, a cluster.
NOT_INHERITED = (
    "RAGEN_CRASH_AT",
    "MLFLOW_TRACKING_URI",
    "PREFECT_API_URL",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
)


def child_env(**overrides: str) -> dict[str, str]:
    """The start-up environment without ``NOT_INHERITED``, then ``overrides``."""
    env = {k: v for k, v in BASELINE.items() if k not in NOT_INHERITED}
    env.update(overrides)
    return env
