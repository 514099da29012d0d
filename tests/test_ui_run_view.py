"""MLflow's UI on the link a run prints: headless Chromium against a real ``mlflow server`` whose store a
stored run was logged to (no training; far cheaper than ``test_e2e.py``'s deployment run).

MLflow 3's UI keeps one view per browser, GenAI for a fresh one, and that choice wins over the
experiment's kind tag: a bare run link lands on the GenAI pages ("Evaluation runs"). The printed link
names the model-training view; the page must show it, with the run's description as a table.
"""

from __future__ import annotations

import html
import os
import re
import urllib.request
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
    sweep_link = published_sweep(tmp_path, state)  # on the same server: one start for both pages
    with group(mlflow_server_cmd(state, port), log, env=env, cwd=tmp_path) as proc:
        wait_healthy(f"{ui}/health", proc, log, "mlflow server")
        doms = {}
        for name, page in (("printed", link), ("bare", link.split("?")[0]), ("sweep", sweep_link)):
            for attempt, budget in enumerate((20_000, 40_000)):  # slower machines: more time
                doms[name] = chromium(
                    browser, tmp_path / f"chromium-{name}-{attempt}", page, "--dump-dom", budget_ms=budget
                )
                if "BanditTest (held out)" in doms[name] or "Sweep" in doms[name]:
                    break
            (tmp_path / f"{name}-page.html").write_text(doms[name])
        # the sweep's parent run: its description shows the groups' table and the curves, served by
        # the same MLflow UI (Prefect's report artifact links the same images)
        sweep = doms["sweep"]
        images = re.findall(r'<img[^>]*src="([^"]*get-artifact\?path=report%2Fcurve_[^"]*)"', sweep)
        assert images, f"the sweep's description shows no curve; DOM in {tmp_path}"
        with urllib.request.urlopen(html.unescape(images[0]), timeout=30) as r:
            assert r.read(8) == b"\x89PNG\r\n\x1a\n"  # the image the page shows is the curve
    assert "<table" in sweep and "Sweep" in sweep, (
        f"the sweep's description did not render; DOM in {tmp_path}"
    )
    printed, bare = doms["printed"], doms["bare"]
    assert "BanditTest (held out)" in printed and "<table" in printed, (
        f"the run page does not show the description's validation table; DOM in {tmp_path}"
    )
    assert GENAI_ONLY not in printed, f"the printed link opened the GenAI view; DOM in {tmp_path}"
    # what the link's view query is for: without it a fresh browser gets the GenAI view
    assert GENAI_ONLY in bare, f"a bare run link no longer opens the GenAI view; DOM in {tmp_path}"


def published_sweep(tmp_path: Path, state: Path) -> str:
    """A sweep parent with two finished members (a group of two seeds), its report published as a
    sweep publishes it; the parent run's link."""
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.sweep.report import build_report, publish_report
    from ragen_core.sweep.tags import GROUP_TAG, MEMBER_TAG, SEED_TAG, SWEEP_TAG
    from ragen_core.tracking.tracker import Tracker
    from tests.ragen_core.sweep.test_sweep_report import synthetic_history

    cfg = TrackingConfig(experiment="ui-sweep")
    parent = Tracker(cfg, state)
    pid = parent.start("sweep-ui", {"sweep.name": "ui"}, tags={SWEEP_TAG: "ui"})
    for seed in (0, 1):
        child = Tracker(cfg, state)
        tags = {MEMBER_TAG: f"a-s{seed}", GROUP_TAG: "a", SEED_TAG: str(seed), "ragen.sweep_index": str(seed)}
        child.start(f"a-s{seed}", {"trainer.seed": seed}, parent_run_id=pid, tags=tags)
        for k, m in synthetic_history(seed, 3, None, steps=4).items():
            child.log_iteration(k, m)
        child.end("FINISHED")
    publish_report(
        build_report(parent.tracking_uri, pid), parent, tmp_path / "sweep-report", log_artifacts=True
    )
    link = parent.run_url(pid)
    parent.end("FINISHED")
    assert link is not None
    return link
