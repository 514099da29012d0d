"""Shared pytest configuration: markers that are not listed in pyproject.toml."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: end-to-end test with real servers (Prefect, MLflow), a process worker and headless Chromium",
    )
