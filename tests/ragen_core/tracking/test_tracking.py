"""MLflow tracking against a real local store (sqlite + artifact folder in tmp_path)."""

from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragen_core.config.tracking import TrackingConfig, flatten_params, resolve_tracking_uri
from ragen_core.tracking.background import BackgroundLog
from ragen_core.tracking.keys import format_steps, metric_key, parse_steps
from ragen_core.tracking.offline import TrackingError
from ragen_core.tracking.tracker import (
    CHANGED_PARAMS_TAG,
    ITERATION_KEY,
    LOGGED_STEPS_TAG,
    PARENT_TAG,
    SKIPPED_KEY,
    Tracker,
)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local store for the module (creating the sqlite schema takes several seconds)."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(autouse=True)
def _local_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory


def make(state_dir: Path, experiment: str = "test", **kw) -> Tracker:
    return Tracker(TrackingConfig(experiment=experiment, **kw), state_dir)


def client(state_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{state_dir.resolve()}/mlflow.db")


def test_uri_resolution_and_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    cfg = TrackingConfig()
    assert (
        resolve_tracking_uri(cfg, tmp_path / ".state")
        == f"sqlite:///{(tmp_path / '.state').resolve()}/mlflow.db"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert resolve_tracking_uri(cfg, ".state") == "http://example:5000"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="sqlite:///x.db"), ".state") == "sqlite:///x.db"
    with pytest.raises(ValueError):
        TrackingConfig(unknown=1)

    assert metric_key("val-env/Bandit/pass@16") == "val-env/Bandit/pass_at_16"
    assert metric_key("a//b/./c?") == "a/b/c_"
    assert flatten_params({"a": {"b": 1, "c": [1, 2], "d": None, "e": "x"}, "f": True, "g": {}}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "a.d": "null",
        "a.e": "x",
        "f": "true",
        "g": "{}",
    }


def test_params_metrics_and_idempotent_resume(state_dir: Path, tmp_path: Path):
    params = {"learner": {f"p{i:03d}": i for i in range(250)}, "model": {"path": "x" * 7000}, "seed": 3}
    tr = make(state_dir)
    run_id = tr.start("run-a", params, tags={"ragen.config_hash": "abc"})
    assert tr.log_iteration(
        0, {"train/Bandit/success": 0.1, "actor/grad_norm": 1.0, "train/Bandit/pass@4": 0.5}
    )
    assert tr.log_iteration(
        1, {"train/Bandit/success": 0.2, "actor/grad_norm": math.nan, "x": math.inf, "y": None}
    )
    assert tr.log_iteration(2, {"train/Bandit/success": 0.3, "actor/grad_norm": 2.0})
    tr.end("FAILED")

    c = client(state_dir)
    run = c.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "run-a"
    assert run.data.tags["ragen.config_hash"] == "abc"
    p = run.data.params
    assert len(p) == 252 and p["learner.p007"] == "7" and p["seed"] == "3"
    assert len(p["model.path"]) == 6000  # cut to MLflow's limit (the full config is an artifact)
    hist = {m.step: m.value for m in c.get_metric_history(run_id, "train/Bandit/success")}
    assert hist == {0: 0.1, 1: 0.2, 2: 0.3}
    assert [m.step for m in c.get_metric_history(run_id, "actor/grad_norm")] == [0, 2]  # NaN skipped
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, SKIPPED_KEY)] == [(1, 3.0)]
    assert [m.step for m in c.get_metric_history(run_id, "train/Bandit/pass_at_4")] == [0]
    assert "x" not in run.data.metrics

    # resume: same run id, RUNNING again, params re-sent without error, no double-logged step
    tr2 = make(state_dir)
    params["seed"] = 4  # changed on resume: kept as first logged, reported in a tag
    assert tr2.start("run-a", params, run_id=run_id) == run_id
    assert c.get_run(run_id).info.status == "RUNNING"
    assert tr2.logged_steps == {0, 1, 2}
    assert tr2.log_iteration(2, {"train/Bandit/success": 0.9}) is False
    assert tr2.log_iteration(3, {"train/Bandit/success": 0.4})
    h = tr2.history(["train/Bandit/success", "train/Bandit/pass@4", "missing"])
    assert h == {
        "train/Bandit/success": [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        "train/Bandit/pass@4": [(0, 0.5)],
    }
    assert parse_steps(c.get_run(run_id).data.tags[LOGGED_STEPS_TAG]) == {0, 1, 2, 3}
    assert c.get_metric_history(run_id, ITERATION_KEY) == []  # the iteration is the step, not a metric
    tr2.end()
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["seed"] == "3" and run.data.tags[CHANGED_PARAMS_TAG] == "seed"

    with pytest.raises(TrackingError, match="cannot resume"):
        make(state_dir).start("x", {}, run_id="0123456789abcdef0123456789abcdef")


def test_default_local_store_in_state_dir(state_dir: Path, tmp_path: Path):
    tr = make(state_dir, experiment="where")
    assert tr.tracking_uri == f"sqlite:///{state_dir.resolve()}/mlflow.db"
    run_id = tr.start("r", {})
    tr.end()
    assert (state_dir / "mlflow.db").is_file()
    art = client(state_dir).get_run(run_id).info.artifact_uri
    assert art.startswith((state_dir.resolve() / "mlartifacts").as_uri())
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_artifacts_transcripts_and_plots(state_dir: Path, tmp_path: Path):
    tr = make(state_dir)
    run_id = tr.start("art", {"a": 1})
    for k in range(12):
        tr.log_iteration(
            k,
            {
                "val-env/Bandit/success": 0.1 + 0.05 * k,
                "val-env/SimpleSokoban/success": 0.02 * k,
                "train/Bandit/success": 0.1 + 0.04 * k,
                "rollout/in_group_std": 0.4 - 0.03 * k,
                "actor/entropy": 1.5 - 0.05 * k,
                "actor/grad_norm": 1.0 + 0.1 * (k % 3),
                "response_length/mean": 60.0 - 2 * k,
            },
        )
    f = tmp_path / "config.yaml"
    f.write_text("a: 1\n")
    tr.log_artifact(f)
    d = tmp_path / "iter_0001"
    d.mkdir()
    (d / "rollouts.parquet").write_bytes(b"PAR1")
    tr.log_artifacts(d, "iterations/iter_0001")
    rows = [
        {"env_tag": "Bandit", "messages": [{"role": "user", "content": f"hi {i}"}], "reward": 1.0}
        for i in range(6)
    ]
    tr.log_transcripts(rows, step=1)
    tr.log_transcripts(rows, step=2)
    tr.log_transcripts(rows, step=2)  # re-logged on resume: the table does not grow
    tr.log_text("<p>iteration 2</p>", "transcripts/iter_0002.html")
    paths = tr.log_plots(tmp_path / "plots", markers={"reward_std_collapse": 8})
    tr.end()

    names = {p.name for p in paths}
    assert {
        "success.png",
        "in_group_std.png",
        "entropy.png",
        "grad_norm.png",
        "response_length.png",
        "overview.png",
    } <= names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000

    c = client(state_dir)
    listed = lambda path=None: {a.path for a in c.list_artifacts(run_id, path)}  # noqa: E731
    top = listed()
    assert {"config.yaml", "iterations", "transcripts", "plots", "transcripts.json", "overview.png"} <= top
    assert listed("iterations/iter_0001") == {"iterations/iter_0001/rollouts.parquet"}
    assert listed("transcripts") == {"transcripts/iter_0002.html"}
    assert {f"plots/{n}" for n in names - {"overview.png"}} == listed("plots")  # the overview is on top
    local = Path(c.download_artifacts(run_id, "transcripts/iter_0002.html", str(tmp_path / "dl")))
    assert local.read_text() == "<p>iteration 2</p>"
    import json

    table = json.loads(
        Path(c.download_artifacts(run_id, "transcripts.json", str(tmp_path / "dl2"))).read_text()
    )
    assert len(table["data"]) == 8 and table["columns"][0] == "step"  # transcripts_per_iteration = 4
    assert "messages" not in table["columns"]  # the table is for scanning; the pages hold the text


def test_log_artifacts_off_uploads_nothing(state_dir: Path, tmp_path: Path):
    tr = make(state_dir, log_artifacts=False)
    run_id = tr.start("noart", {})
    tr.log_iteration(0, {"rollout/in_group_std": 0.3})
    f = tmp_path / "f.txt"
    f.write_text("x")
    tr.log_artifact(f)
    tr.log_transcripts([{"a": 1}], 0)
    assert [p.name for p in tr.log_plots(tmp_path / "p")] == ["in_group_std.png", "overview.png"]
    tr.end()
    assert client(state_dir).list_artifacts(run_id) == []


def test_nested_sweep_runs(state_dir: Path):
    parent = make(state_dir, experiment="sweep")
    pid = parent.start("sweep-parent", {"sweep": "filter.value"})
    kids = []
    for r in (0.25, 0.5):
        t = make(state_dir, experiment="sweep")
        kids.append(t.start(f"member-{r}", {"rollout": {"filter": {"value": r}}}, parent_run_id=pid))
        t.log_iteration(0, {"val-env/Bandit/success": r})
        t.end()
    parent.end()
    c = client(state_dir)
    exp = c.get_experiment_by_name("sweep")
    found = c.search_runs([exp.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{pid}'")
    assert sorted(r.info.run_id for r in found) == sorted(kids)
    with pytest.raises(TrackingError, match="parent run"):
        make(state_dir, experiment="sweep").start("orphan", {}, parent_run_id="f" * 32)


def test_failed_log_batch_takes_the_tracker_offline_and_resume_relogs(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    tr = make(state_dir)
    run_id = tr.start("flaky", {})
    assert tr.log_iteration(4, {"a": 4.0})
    real = tr.client.log_batch

    def boom(*a, **k):
        raise ConnectionError("server went away")

    monkeypatch.setattr(tr.client, "log_batch", boom)
    assert tr.log_iteration(5, {"a": 5.0}) is False  # no raise: training goes on
    assert (
        tr.offline == f"MLflow at {tr.tracking_uri} unreachable since log iteration 5 of run {run_id} "
        "(ConnectionError: server went away)"
    )
    monkeypatch.setattr(
        tr.client, "log_batch", real
    )  # the store is back, yet an offline Tracker no longer tries it
    assert tr.log_iteration(6, {"a": 6.0}) is False
    tr.set_tags({"t": "x"})
    tr.end()
    c = client(state_dir)
    assert c.get_run(run_id).info.status == "RUNNING" and "t" not in c.get_run(run_id).data.tags
    msg = tr.offline_message("r1", state_dir / "runs" / "r1")
    assert msg is not None and msg.startswith(tr.offline) and "`ragen train --resume r1`" in msg

    again = make(state_dir)  # the resumed run: steps 4..6 from the run directory, 4 is skipped
    again.start("flaky", {}, run_id=run_id)
    assert [again.log_iteration(k, {"a": float(k)}) for k in (4, 5, 6)] == [False, True, True]
    again.end()
    assert parse_steps(c.get_run(run_id).data.tags[LOGGED_STEPS_TAG]) == {4, 5, 6}
    assert c.get_run(run_id).info.status == "FINISHED" and again.offline_message("r1", state_dir) is None

    bad = make(state_dir)  # caller bugs still raise (they are not store failures)
    bad.start("bugs", {})
    with pytest.raises(TypeError, match="not a number"):
        bad.log_iteration(6, {"a": "high"})
    with pytest.raises(ValueError, match="both map"):
        bad.log_iteration(7, {"p@1": 1.0, "p_at_1": 2.0})
    assert bad.offline is None
    bad.end()


def test_background_log_keeps_order_and_survives_a_failing_store(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    tr = make(state_dir)
    run_id = tr.start("background", {})
    bg = BackgroundLog()
    for k in range(1, 6):
        bg.submit(tr.log_iteration, k, {"a": float(k)})
    bg.flush()
    hist = client(state_dir).get_metric_history(run_id, "a")
    assert sorted((m.step, m.value) for m in hist) == [(k, float(k)) for k in range(1, 6)]

    real = tr.client.log_batch
    entered, gate = threading.Event(), threading.Event()

    def boom(*a, **k):
        entered.set()
        gate.wait(5)
        raise ConnectionError("server went away")

    monkeypatch.setattr(tr.client, "log_batch", boom)
    bg.submit(tr.log_iteration, 6, {"a": 6.0})
    bg.submit(tr.log_iteration, 7, {"a": 7.0})  # queued behind the failing call: must not be logged
    assert entered.wait(5)
    monkeypatch.setattr(tr.client, "log_batch", real)  # the store is back, yet 7 must not be logged
    gate.set()
    bg.flush()  # a store failure is not raised: the Tracker went offline
    bg.submit(tr.log_iteration, 8, {"a": 8.0})
    bg.close()
    assert tr.offline is not None and "log iteration 6" in tr.offline
    assert tr.logged_steps == {1, 2, 3, 4, 5}  # nothing after the failure, so nothing out of order
    tr.end()

    bugs = BackgroundLog()  # any other error is still raised by the next submit and every flush
    bugs.submit(int, "high")
    with pytest.raises(ValueError, match="high"):
        bugs.flush()
    with pytest.raises(ValueError, match="high"):
        bugs.submit(print, "never runs")
    bugs.close()

    ran = []
    sync = BackgroundLog(enabled=False)
    sync.submit(ran.append, 1)
    assert ran == [1]  # disabled: runs at once, in the caller's thread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match=rf"{uri} unreachable \(connection refused\).*mlflow server"):
        Tracker(TrackingConfig(tracking_uri=uri), tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the same through the environment
    with pytest.raises(TrackingError, match="unset MLFLOW_TRACKING_URI"):
        Tracker(TrackingConfig(), tmp_path)
    assert time.monotonic() - t0 < 10

    # a port that accepts connections but never answers: bounded by connect_timeout_s
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        silent = f"http://127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TrackingError, match=r"no answer within 0\.5 s"):
            Tracker(TrackingConfig(tracking_uri=silent, connect_timeout_s=0.5), tmp_path)
        assert time.monotonic() - t0 < 5


def test_new_stores_start_from_a_cached_empty_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The first new store is built by MLflow and kept, without its default experiment, as the template;
    later new stores are copies that MLflow opens as its own (its default experiment, ours next); a
    damaged template is dropped and the store built anew."""
    from ragen_core.tracking.store import store_template

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    template = store_template()
    assert not template.exists()

    def experiments(state: Path) -> list[tuple[str, str, str]]:
        tr = make(state, experiment="mine")
        tr.start("r", {})
        tr.end()
        return sorted(
            (e.experiment_id, e.name, e.artifact_location) for e in client(state).search_experiments()
        )

    built = experiments(tmp_path / "a")
    assert template.is_file()
    copied = experiments(tmp_path / "b")
    assert [e[:2] for e in built] == [e[:2] for e in copied] == [("0", "Default"), ("1", "mine")]
    # every experiment's artifacts beside its store, MLflow's default one too (not in the working directory)
    assert built[0][2] == (tmp_path / "a" / "mlartifacts" / "Default").resolve().as_uri()
    assert copied[0][2] == (tmp_path / "b" / "mlartifacts" / "Default").resolve().as_uri()
    assert copied[1][2] == (tmp_path / "b" / "mlartifacts" / "mine").resolve().as_uri()

    template.write_bytes(b"not a database")
    assert [e[:2] for e in experiments(tmp_path / "c")] == [("0", "Default"), ("1", "mine")]
    assert template.is_file() and template.read_bytes()[:15] == b"SQLite format 3"  # rebuilt


def test_the_experiment_opens_on_its_runs_in_the_mlflow_ui(state_dir: Path) -> None:
    """Traces would make MLflow's UI open the experiment in its GenAI view; a training experiment is
    created as model development."""
    from ragen_core.tracking.tracker import EXPERIMENT_KIND_TAG

    tr = make(state_dir, experiment="kind")
    tr.start("r", {})
    tr.end()
    exp = client(state_dir).get_experiment_by_name("kind")
    assert exp.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_logged_steps_are_written_as_ranges_and_read_back() -> None:
    for steps in (set(), {0}, {0, 1, 2, 3, 5}, {2, 4, 6}, set(range(200)) - {17}):
        assert parse_steps(format_steps(steps)) == steps
    assert format_steps({0, 1, 2, 3, 5, 7, 8}) == "0-3,5,7-8"


def test_a_run_logged_with_the_old_iteration_marker_resumes_without_relogging(state_dir: Path) -> None:
    """Runs logged before the marker became a tag have a metric ``iteration`` per logged step."""
    from mlflow.entities import Metric

    tr = make(state_dir)
    run_id = tr.start("old", {})
    c = client(state_dir)
    c.log_batch(run_id, metrics=[Metric(ITERATION_KEY, float(k), 1, k) for k in (0, 1)], synchronous=True)
    tr.end()
    again = make(state_dir)
    again.start("old", {}, run_id=run_id)
    assert again.logged_steps == {0, 1}
    assert [again.log_iteration(k, {"a": 1.0}) for k in (1, 2)] == [False, True]
    again.end()
    assert parse_steps(c.get_run(run_id).data.tags[LOGGED_STEPS_TAG]) == {0, 1, 2}
