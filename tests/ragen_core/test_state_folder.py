"""The state folder's remembered UI ports (``ui.json``): what every link to MLflow and Prefect is built
from, so that a UI served on other ports (``ragen ui --mlflow-port N``) is where links open."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.reporting import flow_run_url
from ragen_core.state_folder import (
    DEFAULT_UI_PORTS,
    mlflow_ui_url,
    prefect_ui_url,
    remember_ui_ports,
    ui_ports,
    ui_ports_path,
)


def test_a_state_folder_without_ui_json_uses_the_default_ports(tmp_path: Path) -> None:
    assert ui_ports(tmp_path) == DEFAULT_UI_PORTS == {"mlflow": 5000, "prefect": 4200}
    assert mlflow_ui_url(tmp_path) == "http://127.0.0.1:5000"
    assert prefect_ui_url(tmp_path) == "http://127.0.0.1:4200"


def test_remembered_ports_are_read_back(tmp_path: Path) -> None:
    remember_ui_ports({"mlflow": 5055, "prefect": 4255}, tmp_path)
    assert ui_ports(tmp_path) == {"mlflow": 5055, "prefect": 4255}
    assert mlflow_ui_url(tmp_path) == "http://127.0.0.1:5055"
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


@pytest.mark.parametrize(
    "text", ["", "{not json", "[5055]", '{"mlflow": "5055"}', '{"mlflow": 70000}', '{"mlflow": true}']
)
def test_an_unreadable_or_odd_ui_json_falls_back_to_the_defaults(tmp_path: Path, text: str) -> None:
    """A link is a courtesy: a broken file never fails a run, and the next `ragen ui` rewrites it."""
    ui_ports_path(tmp_path).write_text(text)
    assert ui_ports(tmp_path)["mlflow"] == 5000


def test_a_flow_run_link_opens_on_the_remembered_prefect_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flow run of the ephemeral server (no PREFECT_API_URL): the link is the UI `ragen ui` serves."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))
    remember_ui_ports({"mlflow": 5055, "prefect": 4255}, tmp_path)
    with temporary_settings(restore_defaults={PREFECT_API_URL, PREFECT_UI_URL}):
        assert flow_run_url("0f1e") == "http://127.0.0.1:4255/runs/flow-run/0f1e"
