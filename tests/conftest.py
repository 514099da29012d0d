"""Shared pytest configuration: markers that are not listed in pyproject.toml, shared fixtures."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import ragen_core  # noqa: F401  # before torch: pins MKL's reproducible mode
import tests.process_env  # noqa: F401  # snapshots the start-up environment before any test changes it


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background by a script (`make test &`) ignores SIGINT, and an ignored
    # signal is passed on to every child: the Ctrl-C tests' runs would ignore Ctrl-C as no run in a
    # terminal does. A handler (unlike SIG_IGN) is reset to the default in each child.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers",
        "e2e: end-to-end test with real servers (Prefect, MLflow), a process worker and headless Chromium",
    )


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch intra-op thread for a module's tests: the suite's workers share 2 cores, and tiny
    models run several times faster on one thread than on two fighting for them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prefect_server() -> str:
    """The shared Prefect server's API URL (``tests.prefect_server``), started before the module's tests,
    so that no timed CLI command pays its start-up."""
    from tests.prefect_server import api_url

    return api_url()


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state folder (so one local MLflow store) for a module's tests."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture
def local_state(monkeypatch: pytest.MonkeyPatch, state: Path) -> Path:
    """The module's state folder as this test's ``RAGEN_STATE_DIR``, with MLflow tracking to its
    local store (a ``MLFLOW_TRACKING_URI`` from the caller's shell is ignored)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))
    return state
