"""MLflow's UI on the link a run prints: headless Chromium against a real ``mlflow server`` whose store a
stored run was logged to (no training; far cheaper than ``test_e2e.py``'s deployment run).

MLflow 3's UI keeps one view per browser, GenAI for a fresh one, and that choice wins over the
experiment's kind tag: a bare run link lands on the GenAI pages ("Evaluation runs"). The printed link
names the model-training view; the page must show it, with the run's description as a table.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ragen_core.state_folder import remember_ui_ports
from tests.ragen_core.tracking.test_core_metrics import config, stored_run, train_and_log
from tests.test_e2e import chromium, find_chromium, free_port, group, mlflow_server_cmd, wait_healthy

pytestmark = pytest.mark.slow

#: what only the GenAI view's pages show (its side bar and a run's breadcrumb)
GENAI_ONLY = "Evaluation runs"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_printed_link_opens_the_run_on_the_model_training_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    browser = find_chromium()
    state = tmp_path / "state"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path)
    tracker, mlflow_run = train_and_log(cfg, stored_run(cfg, "view"), state)

    port = free_port()  # not MLflow's 5000: the link follows the port `ragen ui` serves the folder on
    ui = f"http://127.0.0.1:{port}"
    remember_ui_ports({"mlflow": port, "prefect": free_port()}, state)  # as `ragen ui --mlflow-port` does
    link = tracker.run_url(mlflow_run)
    assert link is not None and link.startswith(ui + "/")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAGEN_"))}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    log = tmp_path / "mlflow.log"
    with group(mlflow_server_cmd(state, port), log, env=env, cwd=tmp_path) as proc:
        wait_healthy(f"{ui}/health", proc, log, "mlflow server")
        doms = {}
        for name, page in (("printed", link), ("bare", link.split("?")[0])):
            for attempt, budget in enumerate((20_000, 40_000)):  # slower machines: more time
                doms[name] = chromium(
                    browser, tmp_path / f"chromium-{name}-{attempt}", page, "--dump-dom", budget_ms=budget
                )
                if "BanditTest (held out)" in doms[name]:
                    break
            (tmp_path / f"{name}-page.html").write_text(doms[name])
    printed, bare = doms["printed"], doms["bare"]
    assert "BanditTest (held out)" in printed and "<table" in printed, (
        f"the run page does not show the description's validation table; DOM in {tmp_path}"
    )
    assert GENAI_ONLY not in printed, f"the printed link opened the GenAI view; DOM in {tmp_path}"
    # what the link's view query is for: without it a fresh browser gets the GenAI view
    assert GENAI_ONLY in bare, f"a bare run link no longer opens the GenAI view; DOM in {tmp_path}"
