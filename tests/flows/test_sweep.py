"""The sweep flow: resume logic, bounded concurrency, and one real tiny sweep end to end.

The sweep file, its expansion and the report on their own: tests/ragen_core/sweep/test_sweep_spec.py and
test_sweep_report.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.sweep import SweepRequest, run_sweep
from flows.train import TrainRequest
from ragen_core.config.tracking import TrackingConfig
from ragen_core.run.logged_models import run_alias
from ragen_core.run.run_dir import RunDir
from ragen_core.sweep.state import SweepState
from ragen_core.sweep.tags import ERROR_TAG, MEMBER_TAG, SEED_TAG, SWEEP_TAG
from ragen_core.tracking.tracker import PARENT_TAG, Tracker
from tests.prefect_server import prefect_api, shared_server_env
from tests.process_env import child_env
from tests.ragen_core.sweep.test_sweep_spec import BANDIT, IMPOSSIBLE, write_sweep

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_state")]


ROOT = Path(__file__).resolve().parents[2]


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
    env = child_env(
        RAGEN_STATE_DIR=str(state),
        PREFECT_HOME=str(prefect_home),
        PYTHONUNBUFFERED="1",
        **shared_server_env(),
    )
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
    # ... and on the sweep's flow run in Prefect, as a markdown artifact
    (flow_run,) = prefect_api(
        "/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"sweep/{folder.name}"]}}}
    )
    arts = prefect_api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    (artifact,) = [a for a in arts if a["key"] == f"report-{folder.name}"]
    assert artifact["type"] == "markdown" and "## Failed members" in artifact["data"]
    run = RunDir(next((tmp_path / "runs").iterdir()))
    assert run.done_file(1).exists()
    # the sweep's flow run and its member's training flow run carry the sweep as tags
    assert {"ragen", "sweep:tiny-real"} <= set(flow_run["tags"]), flow_run["tags"]
    (member_run,) = prefect_api(
        "/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"train/{run.info()['run_id']}"]}}}
    )
    assert {"sweep:tiny-real", "sweep-member:ok-s0", "env:Bandit"} <= set(member_run["tags"]), member_run

    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    parent = client.get_run(report["parent_run_id"])
    assert parent.info.status == "FAILED" and parent.data.tags["ragen.sweep.failed"] == "impossible-s0"
    child = client.get_run(ok["mlflow_run_id"])
    assert child.info.status == "FINISHED" and child.data.tags[PARENT_TAG] == parent.info.run_id
    # named by its member key (the parent says which sweep), the ragen run id kept as a tag
    assert child.info.run_name == "ok-s0" and child.data.tags["ragen.run_id"] == run.info()["run_id"]
    # the parent: the report's summary as its description, each group's final and peak as metrics
    assert parent.data.tags["mlflow.note.content"].startswith("**Sweep `tiny-real`**")
    assert "final/ok/val-env/Bandit/success" in parent.data.metrics
    # the member's lines are told apart (members train one after another in the sweep's process)
    text = " ".join(out.stdout.split())  # the console wraps long lines
    assert "sweep tiny-real: member 1/1, ok-s0" in text and "[ok-s0 1/1] " in text, out.stdout[-6000:]
    assert (
        child.data.params["trainer.seed"] == "0" and child.data.tags["ragen.run_id"] == run.info()["run_id"]
    )
    assert run.info()["mlflow_run_id"] == ok["mlflow_run_id"]
    # the member's policies are versions of its sweep group's registered model; its run id has a dot
    # (<sweep>.<member>), which MLflow refuses in LoggedModel names and aliases
    assert run.info()["registered_model"] == "tiny-real.ok"
    final = client.get_model_version_by_alias("tiny-real.ok", run_alias(run.info()["run_id"], "final"))
    assert final.run_id == ok["mlflow_run_id"]

    # the report regenerates from MLflow alone, and --log publishes it onto the parent run again
    again = ragen(
        ["sweep", "report", parent.info.run_id, "--out", str(tmp_path / "rep"), "--log"],
        state,
        tmp_path / "prefect",
    )
    assert again.returncode == 0, again.stdout[-3000:]
    regenerated = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert regenerated["members"] == report["members"] and (tmp_path / "rep" / "overview.png").exists()
    assert "data:image/png;base64," in (tmp_path / "rep" / "report.html").read_text()
    republished = client.get_run(parent.info.run_id)
    assert republished.info.status == "FAILED"  # as the sweep left it
    assert republished.data.tags["mlflow.note.content"].startswith("**Sweep `tiny-real`**")


def test_dispatch_to_workers_names_a_missing_deployment_or_limit_before_any_work(tmp_path: Path) -> None:
    """``--deployment``: a deployment or a concurrency limit the Prefect server does not have, or no
    server at all, is one line naming it and the fix; no member run is created."""
    path = write_sweep(tmp_path / "w.yaml", name="w", overrides=[f"trainer.run_root={tmp_path / 'runs'}"])
    state, home = tmp_path / "state", tmp_path / "home"
    out = ragen(["sweep", "run", str(path), "--deployment", "nope/nope"], state, home, timeout=300)
    assert out.returncode == 1 and "deployment 'nope/nope' not found" in out.stdout, out.stdout[-3000:]
    assert "prefect --no-prompt deploy --all" in out.stdout and "Traceback" not in out.stdout
    out = ragen(["sweep", "run", str(path), "--concurrency-limit", "gpu"], state, home, timeout=300)
    assert out.returncode == 1 and "--concurrency-limit works with --deployment" in out.stdout, out.stdout[
        -3000:
    ]
    assert not (tmp_path / "runs").exists()
