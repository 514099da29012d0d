"""MLflow's UI, as a researcher opens it, on a FrozenLake iteration's episode traces: headless
Chromium against a real ``mlflow server`` whose store the step log wrote (no training, so this stays
far cheaper than ``test_e2e.py``'s deployment run).

What the unit tests cannot see is the UI's own rendering: the chat view renders Markdown, where a
FrozenLake grid outside a code fence lost its line breaks and underscores, and the trace list showed
only groups the filter kept. Here the rendered page must show a grid line by line in a code block
and a dropped group's episode in the list, tagged ``ragen.filter: dropped``.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import pytest

from tests.ragen_core.tracking.test_episode_traces import config, frozen_lake_rollouts
from tests.test_e2e import chromium, find_chromium, free_port, group, mlflow_server_cmd, wait_healthy

pytestmark = pytest.mark.slow


def grid_shown_line_by_line(dom: str, grid: str) -> bool:
    """Whether a ``<pre>`` block of the page holds ``grid``'s lines in order, one per line (the
    code view may number its lines)."""
    pattern = "\n".join(r"\d*" + re.escape(line) for line in grid.splitlines())
    blocks = (
        html.unescape(re.sub(r"<[^>]+>", "", b)) for b in re.findall(r"<pre[^>]*>(.*?)</pre>", dom, re.S)
    )
    return any(re.search(pattern, b) for b in blocks)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_traces_tab_shows_a_grid_line_by_line_and_a_dropped_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from ragen_core.run.run_dir import create_run
    from ragen_core.run.stages import filter_stage
    from ragen_core.run.step_log import StepLogger
    from ragen_core.tracking.tracker import Tracker
    from ragen_core.trajectory import read_table, write_trajectories

    browser = find_chromium()
    state = tmp_path / "state"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, "tracking.experiment=lake-ui")
    run = create_run(cfg, "lake-ui")
    # group 0 fails on the action budget, group 1 reaches the goal; the filter keeps one of the two
    write_trajectories(frozen_lake_rollouts("<think>up</think><answer>Up || Up</answer>"), run.rollouts(1))
    filter_stage(cfg, run, 1)
    tracker = Tracker(cfg.tracking, state)
    with tracker:
        mlflow_run = tracker.start("lake-ui", {})
        StepLogger(tracker, run, "lake-ui", cfg.trainer.iterations).log_rollouts(1)
    traces = MlflowClient(tracker.tracking_uri).search_traces(
        locations=[str(tracker.experiment_id)], run_id=mlflow_run
    )
    shown = next(t for t in traces if t.info.state == "ERROR")  # a failed multi-turn episode
    assert {t.info.tags["ragen.filter"] for t in traces} == {"kept", "dropped"}
    row = next(
        r
        for r in read_table(run.rollouts(1)).to_pylist()
        if r["env_id"] == int(shown.info.trace_metadata["ragen.env_id"])
    )
    grids = [
        m["content"].split("State:\n")[1].split("\nYou have")[0]
        for m in row["messages"]
        if m["role"] == "user"
    ]
    assert len(grids) > 1

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAGEN_"))}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    log = tmp_path / "mlflow.log"
    with group(mlflow_server_cmd(state, port), log, env=env, cwd=tmp_path) as proc:
        wait_healthy(f"{url}/health", proc, log, "mlflow server")
        page = (
            f"{url}/#/experiments/{tracker.experiment_id}/traces?selectedEvaluationId={shown.info.trace_id}"
        )
        dom = ""
        for attempt, budget in enumerate((20_000, 40_000)):  # slower machines: more time
            dom = chromium(browser, tmp_path / f"chromium-{attempt}", page, "--dump-dom", budget_ms=budget)
            if "ragen.filter: dropped" in dom and grid_shown_line_by_line(dom, grids[-1]):
                break
        (tmp_path / "traces-page.html").write_text(dom)
    assert "ragen.filter: dropped" in dom, (
        f"the Traces list shows no dropped group's episode; DOM in {tmp_path}"
    )
    assert grid_shown_line_by_line(dom, grids[-1]), (
        f"the episode's chat view does not show the grid {grids[-1]!r} line by line; DOM in {tmp_path}"
    )
