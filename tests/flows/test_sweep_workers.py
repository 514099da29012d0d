"""The team setup of docs/deployments.md on a real database: PostgreSQL (Debian's package, a private
cluster), a Prefect server and an MLflow server on it (local artifact root), the deployments of
prefect.yaml and two process workers; a three-member sweep dispatched as runs of the ragen-train
deployment, two at a time under a global concurrency limit. Before any worker is up the sweep says
what its members wait for; then its own process is killed, and the sweep run again attaches to the
members in flight (no second dispatch) while holding the sweep's lock (a third run is refused). One
worker is killed mid-member: the sweep finds the member lost, crashes its flow run and dispatches it
again, and it resumes; every member's metrics are in MLflow exactly once and every run folder is
complete. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.train import SLOT_LEASE_S
from ragen_core.integrity import verify_tree
from ragen_core.run.run_dir import RunDir
from ragen_core.run.run_lock import RunLock
from tests.postgres import postgres_server
from tests.test_e2e import (
    HOST,
    ROOT,
    free_port,
    group,
    http,
    mlflow_server_cmd,
    run_cli,
    servers_env,
    tail,
    tool,
    wait_healthy,
)
from tests.tiny_run import TINY_RUN

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow

POOL = "ragen-process"  # prefect.yaml's
DEPLOYMENT = "ragen-train/ragen-train"
LIMIT = "ragen-test-slots"
SWEEP_TIMEOUT_S = 720
ITERATIONS = 3


def sweep_file(tmp_path: Path) -> Path:
    """Three members, three iterations each, in-process backend (a member is one process)."""
    data = {
        "name": "on-workers",
        "base": str(ROOT / "configs" / "bandit-tiny.yaml"),
        "overrides": [
            f"trainer.iterations={ITERATIONS}",
            f"trainer.eval_every={ITERATIONS}",
            *TINY_RUN,
            "sft=null",  # no warm start: what is tested here is dispatch, loss and resume, not learning
            "trainer.backend=local",
            f"trainer.run_root={tmp_path / 'runs'}",
        ],
        "members": [
            {"name": "a", "overrides": []},
            {"name": "b", "overrides": ["learner.optim.actor_lr=2e-4"]},
            {"name": "c", "overrides": ["learner.optim.actor_lr=5e-4"]},
        ],
        "seeds": [0],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for_line(log: Path, text: str, proc: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:  # type: ignore[attr-defined]
            pytest.fail(f"the sweep exited before saying {text!r}\n{tail(log)}")
        time.sleep(1)
    pytest.fail(f"the sweep did not say {text!r} within {timeout_s:.0f} s\n{tail(log)}")


def logged_at(log: Path, text: str) -> list[dt.datetime]:
    """When each of the log's lines holding ``text`` was logged (Prefect's ``HH:MM:SS.fff |`` prefix)."""
    return [
        dt.datetime.strptime(line.split(" | ", 1)[0], "%H:%M:%S.%f")
        for line in log.read_text(errors="replace").splitlines()
        if text in line and " | " in line
    ]


def steps_logged(mlflow_url: str, run_id: str, key: str) -> list[int]:
    """Every step MLflow holds for ``key``, repeats included (a step logged twice shows twice)."""
    q = urllib.parse.urlencode({"run_id": run_id, "metric_key": key})
    got = http(f"{mlflow_url}/api/2.0/mlflow/metrics/get-history?{q}")
    return sorted(int(m["step"]) for m in got.get("metrics", []))


def kill_a_worker_mid_member(runs: Path, workers: list[Any], timeout_s: float) -> str:
    """Once a member has completed an iteration while still training, SIGKILL its training process
    and the worker that started it (the machine dying, as far as the member can tell); its run's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for root in sorted(runs.glob("*/")):
            pid = RunLock(root).holder().get("pid")
            if not isinstance(pid, int) or RunDir(root).last_complete() < 1:
                continue
            try:  # the holder is alive, having completed 1 of its 3 iterations
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                pgid = os.getpgid(pid)
            except (OSError, ValueError):
                continue  # it has just ended
            os.killpg(pgid, signal.SIGKILL)
            for w in workers:
                if w.pid in (parent, pgid):
                    os.killpg(w.pid, signal.SIGKILL)
            return root.name
        time.sleep(0.5)
    pytest.fail(f"no member completed an iteration within {timeout_s:.0f} s")


def test_team_setup_on_postgresql_survives_a_dead_worker(tmp_path: Path) -> None:
    prefect_port = mlflow_port = free_port()
    while mlflow_port == prefect_port:
        mlflow_port = free_port()
    api, mlflow_url = f"http://{HOST}:{prefect_port}/api", f"http://{HOST}:{mlflow_port}"
    env = servers_env(tmp_path, api)
    env.update(
        {
            "PREFECT_WORKER_QUERY_SECONDS": "2",  # picks dispatched runs up within 2 s (default 15)
            "MLFLOW_TRACKING_URI": mlflow_url,
            "RAGEN_STATE_DIR": str(tmp_path / "state"),
        }
    )
    logs = {
        n: tmp_path / f"{n}.log"
        for n in ("postgres", "mlflow", "prefect", "sweep-1", "sweep", "worker-1", "worker-2")
    }
    with postgres_server(logs["postgres"], ["prefect", "mlflow"]) as pg:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = pg.url("prefect", driver="asyncpg")
        prefect, mlflow_cmd = tool("prefect"), mlflow_server_cmd(tmp_path, mlflow_port)
        mlflow_cmd[mlflow_cmd.index("--backend-store-uri") + 1] = pg.url("mlflow")
        prefect_cmd = [prefect, "server", "start", "--host", HOST, "--port", str(prefect_port), "--no-ui"]
        with (
            group(mlflow_cmd, logs["mlflow"], env=env, cwd=tmp_path) as mlflow_proc,
            group(prefect_cmd, logs["prefect"], env=env, cwd=tmp_path) as prefect_proc,
        ):
            wait_healthy(f"{mlflow_url}/health", mlflow_proc, logs["mlflow"], "mlflow server")
            wait_healthy(f"{api}/health", prefect_proc, logs["prefect"], "prefect server")
            run_sweep_with_a_dead_worker(tmp_path, env, api, mlflow_url, logs)


def run_sweep_with_a_dead_worker(
    tmp_path: Path, env: dict[str, str], api: str, mlflow_url: str, logs: dict[str, Path]
) -> None:
    prefect = tool("prefect")
    run_cli([prefect, "work-pool", "create", POOL, "--type", "process"], env)
    run_cli([prefect, "--no-prompt", "deploy", "--all"], env)
    run_cli([prefect, "gcl", "create", LIMIT, "--limit", "2"], env)

    sweep_cmd = [sys.executable, "-m", "flows.cli", "sweep", "run", str(sweep_file(tmp_path))]
    sweep_cmd += ["--deployment", DEPLOYMENT, "--concurrency-limit", LIMIT]
    with group(sweep_cmd, logs["sweep-1"], env=env, cwd=ROOT) as first:
        # no worker yet: the sweep says so at once, and how to start one (every member is dispatched by then)
        wait_for_line(logs["sweep-1"], f"no worker of work pool '{POOL}' is online", first, 60)
        assert f"prefect worker start --pool {POOL}" in logs["sweep-1"].read_text()
        # at once: on the first poll after the last dispatch, not 30 s on
        dispatched = logged_at(logs["sweep-1"], "dispatched to")
        told = logged_at(logs["sweep-1"], "no worker")
        assert 0 <= (told[0] - dispatched[-1]).total_seconds() < 15, (dispatched, told)
        os.killpg(first.pid, signal.SIGKILL)  # the sweep's own process dies with its members in flight
        first.wait(timeout=30)
    with group(sweep_cmd, logs["sweep"], env=env, cwd=ROOT) as sweep:
        # run again, it attaches to the three flow runs in flight instead of dispatching them twice
        for key in ("a-s0", "b-s0", "c-s0"):
            wait_for_line(logs["sweep"], f"member {key} is still in flight", sweep, 120)
        # and holds the sweep's lock: a third run refuses in one line, naming the holder
        third = subprocess.run(sweep_cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert third.returncode != 0 and f"in use by process {sweep.pid}" in third.stdout + third.stderr, (
            third
        )
        # --limit 1: one member per worker, as docs/deployments.md runs them
        worker = [prefect, "worker", "start", "--pool", POOL, "--type", "process", "--limit", "1"]
        with (
            group(worker, logs["worker-1"], env=env, cwd=tmp_path) as w1,
            group(worker, logs["worker-2"], env=env, cwd=tmp_path) as w2,
        ):
            lost = kill_a_worker_mid_member(tmp_path / "runs", [w1, w2], SWEEP_TIMEOUT_S / 2)
            try:
                code = sweep.wait(timeout=SWEEP_TIMEOUT_S)
            except Exception:
                pytest.fail(f"the sweep did not end in {SWEEP_TIMEOUT_S} s\n{tail(logs['sweep'])}")
    sweep_log = logs["sweep"].read_text()
    assert code == 0, "\n".join(tail(logs[n]) for n in ("sweep", "worker-1", "worker-2"))
    assert "lost" in sweep_log and "dispatching it again" in sweep_log, tail(logs["sweep"])

    state = json.loads(next((tmp_path / "state" / "sweeps").glob("on-workers-*/state.json")).read_text())
    members = state["members"]
    assert sorted(members) == ["a-s0", "b-s0", "c-s0"]
    assert all(m["status"] == "finished" for m in members.values()), members
    for key, m in members.items():
        run = RunDir(m["run_dir"])
        assert run.last_complete() == ITERATIONS, (key, run.root)
        for i in range(1, ITERATIONS + 1):  # every iteration's files as they were written
            assert verify_tree(run.root / f"iter_{i:04d}"), (key, i)
        # every step logged once, the lost member's resumed steps included
        assert steps_logged(mlflow_url, m["mlflow_run_id"], "train/success") == list(range(1, ITERATIONS + 1))
    [lost_key] = [k for k, m in members.items() if Path(m["run_dir"]).name == lost]
    assert members[lost_key]["attempts"] == 2

    runs = [http(f"{api}/flow_runs/{m['flow_run_id']}") for m in members.values()]
    assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    assert all(r["name"].startswith("train/") for r in runs)  # named after their runs
    crashed = http(f"{api}/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["CRASHED"]}}}})
    assert len(crashed) == 1 and "worker or machine died" in crashed[0]["state"]["message"], crashed

    def span(r: dict[str, Any]) -> tuple[dt.datetime, dt.datetime]:
        end = r["end_time"] or r["state"]["timestamp"]  # a run crashed by the sweep has no end time
        return dt.datetime.fromisoformat(r["start_time"]), dt.datetime.fromisoformat(end)

    every = [
        r for r in http(f"{api}/flow_runs/filter", {}) if r["name"].startswith("train/") and r["start_time"]
    ]
    spans = sorted(span(r) for r in every)
    assert len(every) == 4 and any(a1 > b0 for (_, a1), (b0, _) in itertools.pairwise(spans)), (
        f"no two members ran at the same time: {spans}"
    )
    # every slot given back; the dead member's when its lease runs out (flows.train.SLOT_LEASE_S)
    deadline = time.monotonic() + 2 * SLOT_LEASE_S + 30
    while (slots := http(f"{api}/v2/concurrency_limits/{LIMIT}"))[
        "active_slots"
    ] and time.monotonic() < deadline:
        time.sleep(2)
    assert slots["active_slots"] == 0, slots
