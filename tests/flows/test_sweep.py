"""Sweeps: expansion, validation, the MLflow-only report, resume logic, and one real tiny sweep."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.sweep import SweepRequest, run_sweep
from flows.train import TrainRequest
from ragen_core.monitor import MonitorConfig, detect
from ragen_core.run_dir import RunDir
from ragen_core.sweep import (
    ERROR_TAG,
    GROUP_TAG,
    MEMBER_TAG,
    PARENT_TAG,
    SEED_TAG,
    SWEEP_TAG,
    SweepConfig,
    SweepError,
    SweepState,
    build_report,
    expand,
    load_sweep,
    validate_members,
)
from ragen_core.tracking import Tracker, TrackingConfig
from tests.process_env import child_env

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
BANDIT = ROOT / "configs" / "bandit-tiny.yaml"
IMPOSSIBLE = "learner.optim.mini_batch_size=999"  # larger than any filtered batch of bandit-tiny


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local MLflow store for the module (creating the sqlite schema takes seconds)."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, state: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))


def write_sweep(path: Path, **fields) -> Path:
    data = {"name": "t", "base": str(BANDIT), "seeds": [0], **fields}
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------------------------ expansion
def test_expand_is_members_x_grid_x_seeds_with_stable_keys() -> None:
    sweep = SweepConfig(
        name="abl",
        base=str(BANDIT),
        overrides=["trainer.iterations=2"],
        members=[
            {"name": "ppo", "overrides": ["learner.algorithm.adv_estimator=gae"]},
            {"name": "grpo", "overrides": ["learner.algorithm.adv_estimator=grpo"]},
        ],
        grid={"rollout.filter_ratio": [0.25, 0.5], "agent.enable_think": [True, False]},
        seeds=[0, 1, 2],
        seed_keys=["trainer.seed", "learner.seed"],
    )
    members = expand(sweep)
    assert len(members) == 2 * 4 * 3
    assert len({m.key for m in members}) == len(members)
    assert [m.key for m in members] == [m.key for m in expand(sweep)]  # stable
    first = members[0]
    assert first.key == "ppo,filter_ratio=0.25,enable_think=true-s0"
    assert first.group == "ppo,filter_ratio=0.25,enable_think=true"
    # order: sweep overrides, member, grid, seed keys (later ones win)
    assert first.overrides == (
        "trainer.iterations=2",
        "learner.algorithm.adv_estimator=gae",
        "rollout.filter_ratio=0.25",
        "agent.enable_think=true",
        "trainer.seed=0",
        "learner.seed=0",
    )
    assert [m.seed for m in members[:3]] == [0, 1, 2] and len({m.group for m in members[:3]}) == 1
    assert members[-1].key == "grpo,filter_ratio=0.5,enable_think=false-s2"
    assert [m.index for m in members] == list(range(len(members)))
    # grid only, members only, neither
    assert [m.key for m in expand(SweepConfig(name="g", base="x", grid={"a.b": [1, 2]}))] == [
        "b=1-s0",
        "b=2-s0",
    ]
    assert [m.key for m in expand(SweepConfig(name="m", base="x", members=[{"name": "v"}], seeds=[3]))] == [
        "v-s3"
    ]
    assert [m.key for m in expand(SweepConfig(name="n", base="x"))] == ["base-s0"]
    # two grid keys with the same last part keep their full names
    keys = [m.key for m in expand(SweepConfig(name="d", base="x", grid={"train.seed": [1], "val.seed": [2]}))]
    assert keys == ["train.seed=1,val.seed=2-s0"]


def test_sweep_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"base config .* not found"):
        load_sweep(write_sweep(tmp_path / "a.yaml", base="configs/nope.yaml"))
    with pytest.raises(SweepError, match="seeds must be distinct"):
        load_sweep(write_sweep(tmp_path / "b.yaml", seeds=[1, 1]))
    with pytest.raises(SweepError, match="gird"):
        load_sweep(write_sweep(tmp_path / "c.yaml", gird={"a": [1]}))
    with pytest.raises(SweepError, match="member names must be distinct"):
        load_sweep(write_sweep(tmp_path / "d.yaml", members=[{"name": "x"}, {"name": "x"}]))
    # base relative to the sweep file's folder (or a parent) when not relative to the working dir
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text(BANDIT.read_text())
    (tmp_path / "sweeps").mkdir()
    assert Path(load_sweep(write_sweep(tmp_path / "sweeps" / "e.yaml", base="configs/c.yaml")).base).is_file()


def test_validation_reports_the_impossible_member_and_keeps_the_others() -> None:
    sweep = SweepConfig(
        name="v",
        base=str(BANDIT),
        members=[
            {"name": "ok"},
            {"name": "bad", "overrides": [IMPOSSIBLE]},
            {"name": "typo", "overrides": ["learner.optim.mini_bach_size=4"]},
        ],
        seeds=[0, 1],
    )
    configs, errors = validate_members(sweep, expand(sweep))
    assert set(configs) == {"ok-s0", "ok-s1"}
    assert set(errors) == {"bad-s0", "bad-s1", "typo-s0", "typo-s1"}
    assert "mini_batch_size=999" in errors["bad-s0"]
    assert "did you mean learner.optim.mini_batch_size" in errors["typo-s0"]
    assert configs["ok-s1"].trainer.seed == 1


def test_every_shipped_sweep_file_expands_and_validates() -> None:
    files = sorted((ROOT / "sweeps").rglob("*.yaml"))
    assert any("tiny" in f.parts for f in files) and any("paper" in f.parts for f in files)
    for f in files:
        sweep = load_sweep(f)
        members = expand(sweep)
        _, errors = validate_members(sweep, members)
        assert not errors, (f, errors)
        if "tiny" in f.parts:
            assert len(sweep.seeds) == 3, f


# ------------------------------------------------------------------------------------ report
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


def test_report_numbers_equal_those_recomputed_from_the_child_runs(state: Path, tmp_path: Path) -> None:
    cfg = TrackingConfig(experiment="report-test")
    parent = Tracker(cfg, state)
    pid = parent.start("sweep-r", {"sweep.name": "r"}, tags={SWEEP_TAG: "r"})
    plan = {("a", 0): (6, None), ("a", 1): (4, 8), ("a", 2): (5, None), ("b", 0): (9, 7), ("b", 1): (3, None)}
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
    assert by_key["a-s1"].collapse_step == 8 and "grad_norm_spike@8" in by_key["a-s1"].signals
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
    assert groups["a"].collapsed == 1 and groups["a"].collapse_step.mean == 8
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


def test_collapse_uses_each_child_run_s_own_monitor_thresholds() -> None:
    from ragen_core.sweep import _monitor_from_params

    cfg = _monitor_from_params(
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
    assert _monitor_from_params({"monitor.patience": "not a number"}, None) == MonitorConfig()
    forced = MonitorConfig(grad_spike_factor=2.0)
    assert _monitor_from_params({"monitor.grad_spike_factor": "100.0"}, forced) is forced


# ------------------------------------------------------------------------------------ resume logic
class FakeTrain:
    """Stands in for the training flow: continues the member's child run, logs two iterations,
    marks them DONE in the run directory and ends the run (or fails for the keys in ``fail``)."""

    def __init__(self, state: Path, fail: set[str] = frozenset(), delay: float = 0.0) -> None:
        self.state, self.fail, self.delay = state, set(fail), delay
        self.calls: list[tuple[str, TrainRequest]] = []
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def __call__(self, request: TrainRequest) -> dict:
        run = RunDir(request.resume)
        info = run.info()
        key = info["sweep_member"]
        with self.lock:
            self.calls.append((key, request))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay)
            t = Tracker(TrackingConfig(), self.state)
            t.start(
                info["run_id"], {"x": 1}, run_id=info["mlflow_run_id"], parent_run_id=request.parent_run_id
            )
            if key in self.fail:
                t.end("FAILED")
                raise RuntimeError(f"boom in {key}")
            for k in (1, 2):
                t.log_iteration(k, {"val-env/success": 0.1 * k, "perf/total_num_tokens": 10.0})
                run.done_file(k).parent.mkdir(parents=True, exist_ok=True)
                run.done_file(k).write_text("")
            t.end("FINISHED")
            return {"run_id": info["run_id"], "run_dir": str(run.root), "last_iteration": 2}
        finally:
            with self.lock:
                self.active -= 1

    def keys(self) -> list[str]:
        return [k for k, _ in self.calls]


def test_resume_skips_finished_and_retries_failed_only_when_asked(state: Path, tmp_path: Path) -> None:
    path = write_sweep(
        tmp_path / "s.yaml",
        name="resume",
        overrides=[f"trainer.run_root={tmp_path / 'runs'}"],
        members=[{"name": "ok"}, {"name": "crash"}, {"name": "bad", "overrides": [IMPOSSIBLE]}],
        seeds=[0, 1],
    )
    fake = FakeTrain(state, fail={"crash-s0"})
    out = run_sweep(SweepRequest(path=str(path)), train_fn=fake, state_dir=state)
    assert sorted(fake.keys()) == ["crash-s0", "crash-s1", "ok-s0", "ok-s1"]  # the invalid ones never train
    assert sorted(out["failed"]) == ["bad-s0", "bad-s1", "crash-s0"]
    assert sorted(out["finished"]) == ["crash-s1", "ok-s0", "ok-s1"]
    for _, req in fake.calls:  # each member trains its own prepared run under the parent
        assert req.parent_run_id == out["parent_run_id"] and Path(req.resume).is_dir()
        assert req.config == str(BANDIT) and req.run_name and req.run_name.startswith("resume.")
    st = SweepState.load(out["state_file"])
    assert st is not None and st.parent_run_id == out["parent_run_id"]
    assert {k: v.status for k, v in st.members.items()} == {
        "ok-s0": "finished",
        "ok-s1": "finished",
        "crash-s0": "failed",
        "crash-s1": "finished",
        "bad-s0": "failed",
        "bad-s1": "failed",
    }
    assert "boom in crash-s0" in st.members["crash-s0"].error
    assert Path(out["state_file"]).parent.name.startswith("resume-")

    # the parent run and its children in MLflow; the report is in the parent's artifacts
    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    parent = client.get_run(out["parent_run_id"])
    assert parent.info.status == "FAILED" and parent.data.tags[SWEEP_TAG] == "resume"
    assert "crash-s0" in parent.data.tags["ragen.sweep.failed"]
    assert parent.data.tags["ragen.sweep.member.bad-s0"].startswith("failed: invalid config")
    arts = {a.path for a in client.list_artifacts(out["parent_run_id"], "report")}
    assert {"report/report.md", "report/report.json"} <= arts
    report = json.loads((Path(out["report_dir"]) / "report.json").read_text())
    status = {m["key"]: m["status"] for m in report["members"]}
    assert status == {
        "ok-s0": "FINISHED",
        "ok-s1": "FINISHED",
        "crash-s0": "FAILED",
        "crash-s1": "FINISHED",
        "bad-s0": "FAILED",
        "bad-s1": "FAILED",
    }
    children = {m["key"]: m["mlflow_run_id"] for m in report["members"]}
    for key, run_id in children.items():
        tags = client.get_run(run_id).data.tags
        assert tags[PARENT_TAG] == out["parent_run_id"] and tags[MEMBER_TAG] == key
        assert tags[SEED_TAG] == key[-1] and tags[SWEEP_TAG] == "resume"
    assert "mini_batch_size=999" in client.get_run(children["bad-s0"]).data.tags[ERROR_TAG]

    # again: nothing to do (finished skipped, failed not retried); same parent run
    fake2 = FakeTrain(state)
    again = run_sweep(SweepRequest(path=str(path)), train_fn=fake2, state_dir=state)
    assert fake2.calls == [] and again["parent_run_id"] == out["parent_run_id"]

    # a member killed mid-way (state still "running") resumes in its own run directory
    st = SweepState.load(out["state_file"])
    ok0 = st.members["ok-s0"]
    st.members["ok-s0"] = ok0.model_copy(update={"status": "running"})
    st.save(out["state_file"])
    fake3 = FakeTrain(state)
    run_sweep(SweepRequest(path=str(path)), train_fn=fake3, state_dir=state)
    assert fake3.keys() == ["ok-s0"] and fake3.calls[0][1].resume == ok0.run_dir
    assert RunDir(ok0.run_dir).info()["mlflow_run_id"] == ok0.mlflow_run_id  # the same child run

    # --retry-failed: the crashed member again (same run dir); the invalid ones are re-checked, still failed
    fake4 = FakeTrain(state)
    last = run_sweep(SweepRequest(path=str(path), retry_failed=True), train_fn=fake4, state_dir=state)
    assert fake4.keys() == ["crash-s0"] and fake4.calls[0][1].resume == st.members["crash-s0"].run_dir
    assert sorted(last["failed"]) == ["bad-s0", "bad-s1"]
    st = SweepState.load(out["state_file"])
    assert st.members["crash-s0"].status == "finished" and st.members["crash-s0"].attempts == 2
    assert st.members["bad-s0"].attempts == 2
    assert len(list((tmp_path / "runs").iterdir())) == 4  # no member got a second run directory

    # resume=False: a new parent run and new run directories
    fresh = run_sweep(SweepRequest(path=str(path), resume=False), train_fn=FakeTrain(state), state_dir=state)
    assert fresh["parent_run_id"] != out["parent_run_id"]
    assert len(list((tmp_path / "runs").iterdir())) == 8
    assert list(Path(out["state_file"]).parent.glob("state.*.json"))  # the old state is kept


def test_concurrency_bounds_members_at_once(state: Path, tmp_path: Path) -> None:
    path = write_sweep(
        tmp_path / "c.yaml",
        name="conc",
        overrides=[f"trainer.run_root={tmp_path / 'runs'}"],
        grid={"trainer.eval_every": [1, 2]},
        seeds=[0, 1, 2],
        concurrency=2,
    )
    fake = FakeTrain(state, delay=0.3, fail={"eval_every=2-s1"})
    out = run_sweep(SweepRequest(path=str(path)), train_fn=fake, state_dir=state)
    assert len(fake.calls) == 6 and fake.max_active == 2
    assert out["failed"] == ["eval_every=2-s1"] and len(out["finished"]) == 5


# ------------------------------------------------------------------------------------ a real sweep
TINY = [
    "trainer.iterations=1",
    "trainer.eval_every=1",
    "sft.steps=10",
    "sft.episodes_per_tag=16",
    "train.n_groups=[2]",
    "train.group_size=4",
    "val.n_groups=[8]",
    "learner.optim.mini_batch_size=4",
    "learner.optim.micro_batch_size=4",
    "rollout.max_new_tokens=16",
    "trainer.backend=local",
    "tracking.transcripts_per_iteration=1",
]


def ragen(
    args: list[str], state: Path, prefect_home: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    env = child_env(RAGEN_STATE_DIR=str(state), PREFECT_HOME=str(prefect_home), PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:  # whatever it left behind (an ephemeral Prefect server)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        return subprocess.CompletedProcess(args, code, out.read(), "")


@pytest.mark.slow
def test_real_tiny_sweep_reports_the_failed_member_and_completes_the_other(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = write_sweep(
        tmp_path / "tiny.yaml",
        name="tiny-real",
        overrides=[*TINY, f"trainer.run_root={tmp_path / 'runs'}"],
        members=[{"name": "ok"}, {"name": "impossible", "overrides": [IMPOSSIBLE]}],
    )
    out = ragen(["sweep", "run", str(path)], state, tmp_path / "prefect")
    assert out.returncode == 2, out.stdout[-4000:]  # 2: a member failed, the sweep itself ran
    assert "FAILED impossible-s0" in out.stdout
    folder = next((state / "sweeps").glob("tiny-real-*"))
    report = json.loads((folder / "report" / "report.json").read_text())
    members = {m["key"]: m for m in report["members"]}
    assert members["impossible-s0"]["status"] == "FAILED"
    assert "mini_batch_size=999" in members["impossible-s0"]["error"]
    ok = members["ok-s0"]
    assert ok["status"] == "FINISHED" and ok["iterations"] == 1 and ok["tokens"] > 0
    assert list(ok["metrics"]) == ["val-env/Bandit/success"]
    md = (folder / "report" / "report.md").read_text()
    assert "## Failed members" in md and "impossible-s0" in md
    run = RunDir(next((tmp_path / "runs").iterdir()))
    assert run.done_file(1).exists()

    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    parent = client.get_run(report["parent_run_id"])
    assert parent.info.status == "FAILED" and parent.data.tags["ragen.sweep.failed"] == "impossible-s0"
    child = client.get_run(ok["mlflow_run_id"])
    assert child.info.status == "FINISHED" and child.data.tags[PARENT_TAG] == parent.info.run_id
    assert (
        child.data.params["trainer.seed"] == "0" and child.data.tags["ragen.run_id"] == run.info()["run_id"]
    )
    assert run.info()["mlflow_run_id"] == ok["mlflow_run_id"]

    # the report regenerates from MLflow alone
    again = ragen(
        ["sweep", "report", parent.info.run_id, "--out", str(tmp_path / "rep")], state, tmp_path / "prefect"
    )
    assert again.returncode == 0, again.stdout[-3000:]
    regenerated = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert regenerated["members"] == report["members"] and (tmp_path / "rep" / "overview.png").exists()
