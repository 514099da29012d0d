"""The sweep report (``ragen_core.sweep.report``): its numbers against those recomputed from the
child runs in MLflow, the files it writes, and the Echo-Trap thresholds it judges each member by."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragen_core.config.tracking import TrackingConfig
from ragen_core.monitor import MonitorConfig, detect
from ragen_core.sweep.report import build_report, monitor_from_params, publish_report
from ragen_core.sweep.tags import ERROR_TAG, GROUP_TAG, MEMBER_TAG, SEED_TAG, SWEEP_TAG
from ragen_core.tracking.tracker import PARENT_TAG, Tracker

pytestmark = pytest.mark.usefixtures("local_state")


def synthetic_history(
    seed: int, peak_at: int, spike_at: int | None, steps: int = 10
) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for k in range(steps + 1):
        m = {
            "val-env/success": min(1.0, 0.1 * k) if k <= peak_at else 0.1 * peak_at - 0.05 * (k - peak_at),
            "val-env/Bandit/success": 0.3 + 0.01 * seed + 0.02 * k,
        }
        if k > 0:
            m.update(
                {
                    "rollout/in_group_std": 0.5 - 0.01 * k,
                    "actor/entropy": 2.0 - 0.05 * k + 0.01 * seed,
                    "actor/grad_norm": 50.0 if k == spike_at else 1.0 + 0.01 * k,
                    "response_length/mean": 40.0 - k,
                    "perf/total_num_tokens": 1000.0 + 10 * k + seed,
                    "pass@8": 0.5,
                }
            )
        out[k] = m
    return out


@pytest.mark.slow  # a real MLflow store
def test_report_numbers_equal_those_recomputed_from_the_child_runs(state: Path, tmp_path: Path) -> None:
    cfg = TrackingConfig(experiment="report-test")
    parent = Tracker(cfg, state)
    pid = parent.start("sweep-r", {"sweep.name": "r"}, tags={SWEEP_TAG: "r"})
    # (peak, grad spike): a-s1 falls from its peak at 4 to 0.6 x it and spikes at 8, b-s0 spikes at 7;
    # the others fall less than 20% from their peak, at most once, and give no signal
    plan = {("a", 0): (8, None), ("a", 1): (4, 8), ("a", 2): (7, None), ("b", 0): (9, 7), ("b", 1): (9, None)}
    truth: dict[str, dict[int, dict[str, float]]] = {}
    for i, ((group, seed), (peak_at, spike_at)) in enumerate(plan.items()):
        key = f"{group}-s{seed}"
        child = Tracker(cfg, state)
        child.start(
            key,
            {"trainer.seed": seed},
            parent_run_id=pid,
            tags={MEMBER_TAG: key, GROUP_TAG: group, SEED_TAG: str(seed), "ragen.sweep_index": str(i)},
        )
        truth[key] = synthetic_history(seed, peak_at, spike_at)
        for k, m in truth[key].items():
            child.log_iteration(k, m)
        child.end("FINISHED")
    bad = Tracker(cfg, state)
    bad.start(
        "b-s2",
        {},
        parent_run_id=pid,
        tags={
            MEMBER_TAG: "b-s2",
            GROUP_TAG: "b",
            SEED_TAG: "2",
            "ragen.sweep_index": "9",
            ERROR_TAG: "invalid config: boom",
        },
    )
    bad.end("FAILED")
    parent.end("FAILED")

    # the parent/child structure, through the MLflow API
    client = MlflowClient(tracking_uri=parent.tracking_uri)
    exp = client.get_experiment_by_name("report-test").experiment_id
    children = client.search_runs([exp], filter_string=f"tags.`{PARENT_TAG}` = '{pid}'")
    assert sorted(r.data.tags[MEMBER_TAG] for r in children) == sorted([*truth, "b-s2"])
    assert client.get_run(pid).data.tags[SWEEP_TAG] == "r"

    # default compare keys: one env tag, so its series replaces the (identical) aggregate
    assert build_report(parent.tracking_uri, pid).compare == ["val-env/Bandit/success"]
    report = build_report(parent.tracking_uri, pid, compare=["val-env/success", "val-env/*/success"])
    assert report.compare == ["val-env/success", "val-env/Bandit/success"]
    by_key = {m.key: m for m in report.members}
    assert [m.key for m in report.members] == [*truth, "b-s2"]  # expansion order
    assert by_key["b-s2"].status == "FAILED" and by_key["b-s2"].error == "invalid config: boom"
    assert [m.key for m in report.failed] == ["b-s2"]
    for key, hist in truth.items():
        m = by_key[key]
        run = client.get_run(m.mlflow_run_id)
        assert m.status == "FINISHED" and m.iterations == 10
        for metric in report.compare:
            series = [(k, v[metric]) for k, v in sorted(hist.items())]
            best = max(v for _, v in series)
            assert m.metrics[metric].final == pytest.approx(series[-1][1])
            assert m.metrics[metric].peak == pytest.approx(best)
            assert m.metrics[metric].peak_step == next(k for k, v in series if math.isclose(v, best))
        assert m.tokens == pytest.approx(sum(v["perf/total_num_tokens"] for k, v in hist.items() if k > 0))
        assert m.wall_s == pytest.approx((run.info.end_time - run.info.start_time) / 1000)
        series_by_key: dict[str, list[tuple[int, float]]] = {}
        for k, v in hist.items():
            for name, x in v.items():
                series_by_key.setdefault(name, []).append((k, x))
        signals = detect(series_by_key, MonitorConfig())
        assert m.collapse_step == min((s.step for s in signals), default=None)
    assert by_key["a-s1"].collapse_step == 6  # 0.3 and 0.25 are below 0.8 x its peak 0.4
    assert by_key["a-s1"].signals == ["val_success_drop@6", "grad_norm_spike@8"]
    assert by_key["a-s0"].collapse_step is None

    groups = {g.name: g for g in report.groups}
    assert [g.name for g in report.groups] == ["a", "b"]
    assert (groups["a"].n_finished, groups["b"].n_finished, groups["b"].n_failed) == (3, 2, 1)
    for gname, g in groups.items():
        keys = [k for k in truth if k.startswith(gname + "-")]
        for metric in report.compare:
            finals = [by_key[k].metrics[metric].final for k in keys]
            peaks = [by_key[k].metrics[metric].peak for k in keys]
            assert g.final[metric].mean == pytest.approx(statistics.fmean(finals))
            assert g.final[metric].std == pytest.approx(statistics.stdev(finals))
            assert g.peak[metric].mean == pytest.approx(statistics.fmean(peaks))
            assert g.peak_step[metric].mean == pytest.approx(
                statistics.fmean(by_key[k].metrics[metric].peak_step for k in keys)
            )
        assert g.tokens.mean == pytest.approx(statistics.fmean(by_key[k].tokens for k in keys))
        # mean curve over seeds at one step
        step5 = [truth[k][5]["actor/entropy"] for k in keys]
        point = next(p for p in g.curves["actor/entropy"] if p[0] == 5)
        assert point[1] == pytest.approx(statistics.fmean(step5)) and point[3] == len(keys)
    assert groups["a"].collapsed == 1 and groups["a"].collapse_step.mean == 6
    assert groups["b"].collapsed == 1 and groups["b"].collapse_step.mean == 7

    paths = report.write(tmp_path / "report")
    names = {p.name for p in paths}
    assert {
        "report.md",
        "report.json",
        "overview.png",
        "curve_val-env_success.png",
        "curve_actor_entropy.png",
        "curve_actor_grad_norm.png",
        "curve_rollout_in_group_std.png",
        "curve_response_length_mean.png",
    } <= names
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Failed members" in md and "b-s2" in md and "invalid config: boom" in md
    assert json.loads((tmp_path / "report" / "report.json").read_text())["parent_run_id"] == pid

    # published where a researcher looks: the parent run's description (the groups' table, the curves
    # served by MLflow's UI) and metrics (each group's final and peak), report.html with its curves
    parent = Tracker(cfg, state)
    parent.start("sweep-r", {}, run_id=pid)
    prefect_md = publish_report(report, parent, tmp_path / "published", log_artifacts=True)
    parent.end("FAILED")
    run = client.get_run(pid)
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("**Sweep `r`**: 2 group(s), 6 member(s) (5 finished, 1 failed)."), note
    assert "| a | 3/3 |" in note and "| b | 2/3 |" in note
    image = f"get-artifact?path=report%2Fcurve_val-env_success.png&run_uuid={pid}"
    assert f"](http://127.0.0.1:5000/{image})" in note  # ragen ui's MLflow port for a local store
    assert f"](http://127.0.0.1:5000/{image})" in prefect_md  # Prefect's page cannot show local files
    a_s1 = by_key["a-s1"].mlflow_run_id  # members link their MLflow run pages
    assert f"[`{a_s1}`](http://127.0.0.1:5000/#/experiments/{exp}/runs/{a_s1}?" in prefect_md
    assert (
        f"[`{a_s1}`](http://127.0.0.1:5000/#/experiments/"
        in (tmp_path / "published" / "report.md").read_text()
    )
    for g in ("a", "b"):
        for metric in report.compare:
            final = run.data.metrics[f"final/{g}/{metric}"]
            assert final == pytest.approx(groups[g].final[metric].mean)
            assert run.data.metrics[f"peak/{g}/{metric}"] == pytest.approx(groups[g].peak[metric].mean)
    page = (tmp_path / "published" / "report.html").read_text()
    pngs = sorted(p.name for p in (tmp_path / "published").glob("*.png"))
    assert page.count('src="data:image/png;base64,') == len(pngs) >= 6 and "<table>" in page
    logged = {a.path for a in client.list_artifacts(pid, "report")}
    assert {"report/report.html", "report/report.md", "report/curve_val-env_success.png"} <= logged


def test_collapse_uses_each_child_run_s_own_monitor_thresholds() -> None:
    cfg = monitor_from_params(
        {
            "monitor.grad_spike_factor": "100.0",
            "monitor.std_collapse_ratio": "None",
            "monitor.act_on": '["grad_norm_spike"]',
            "monitor.enabled": "True",
            "trainer.seed": "0",
        },
        None,
    )
    assert (cfg.grad_spike_factor, cfg.std_collapse_ratio, cfg.act_on) == (100.0, None, ["grad_norm_spike"])
    assert monitor_from_params({"monitor.patience": "not a number"}, None) == MonitorConfig()
    forced = MonitorConfig(grad_spike_factor=2.0)
    assert monitor_from_params({"monitor.grad_spike_factor": "100.0"}, forced) is forced
