"""Shared pytest configuration: markers that are not listed in pyproject.toml."""

from __future__ import annotations

import pytest

import ragen_core  # noqa: F401  # before torch: pins MKL's reproducible mode
import tests.process_env  # noqa: F401  # snapshots the start-up environment before any test changes it


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: end-to-end test with real servers (Prefect, MLflow), a process worker and headless Chromium",
    )
