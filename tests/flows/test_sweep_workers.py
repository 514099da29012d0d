"""Sweep members on Prefect's scheduler: dispatched as runs of the ragen-train deployment onto a
process work pool, run by two process workers at once, each holding a slot of a global concurrency
limit; before any worker is up the sweep says what its members wait for.

Real parts: a Prefect server and an MLflow server on loopback (two members write at once, which a
SQLite store does not take), the deployments of prefect.yaml, two ``prefect worker start`` processes.
About 3 minutes on 2 cores."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

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
SWEEP_TIMEOUT_S = 600


def sweep_file(tmp_path: Path) -> Path:
    """Two members, two iterations each, in-process backend (a member is one process)."""
    data = {
        "name": "on-workers",
        "base": str(ROOT / "configs" / "bandit-tiny.yaml"),
        "overrides": [
            "trainer.iterations=2",
            "trainer.eval_every=2",
            *TINY_RUN,
            "trainer.backend=local",
            f"trainer.run_root={tmp_path / 'runs'}",
        ],
        "members": [
            {"name": "a", "overrides": []},
            {"name": "b", "overrides": ["learner.optim.actor_lr=2e-4"]},
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


def test_members_run_at_once_on_two_process_workers(tmp_path: Path) -> None:
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
    prefect, mlflow_cmd = tool("prefect"), mlflow_server_cmd(tmp_path, mlflow_port)
    prefect_cmd = [prefect, "server", "start", "--host", HOST, "--port", str(prefect_port), "--no-ui"]
    logs = {name: tmp_path / f"{name}.log" for name in ("mlflow", "prefect", "sweep", "worker-1", "worker-2")}
    with (
        group(mlflow_cmd, logs["mlflow"], env=env, cwd=tmp_path) as mlflow_proc,
        group(prefect_cmd, logs["prefect"], env=env, cwd=tmp_path) as prefect_proc,
    ):
        wait_healthy(f"{mlflow_url}/health", mlflow_proc, logs["mlflow"], "mlflow server")
        wait_healthy(f"{api}/health", prefect_proc, logs["prefect"], "prefect server")
        run_cli([prefect, "work-pool", "create", POOL, "--type", "process"], env)
        run_cli([prefect, "--no-prompt", "deploy", "--all"], env)
        run_cli([prefect, "gcl", "create", LIMIT, "--limit", "2"], env)

        sweep_cmd = [sys.executable, "-m", "flows.cli", "sweep", "run", str(sweep_file(tmp_path))]
        sweep_cmd += ["--deployment", DEPLOYMENT, "--concurrency-limit", LIMIT]
        with group(sweep_cmd, logs["sweep"], env=env, cwd=ROOT) as sweep:
            # no worker yet: the sweep says so, and how to start one
            wait_for_line(logs["sweep"], f"no worker of work pool '{POOL}' is online", sweep, 120)
            assert f"prefect worker start --pool {POOL}" in logs["sweep"].read_text()
            worker = [prefect, "worker", "start", "--pool", POOL, "--type", "process"]
            with (
                group(worker, logs["worker-1"], env=env, cwd=tmp_path),
                group(worker, logs["worker-2"], env=env, cwd=tmp_path),
            ):
                try:
                    code = sweep.wait(timeout=SWEEP_TIMEOUT_S)
                except Exception:
                    pytest.fail(f"the sweep did not end in {SWEEP_TIMEOUT_S} s\n{tail(logs['sweep'])}")
        assert code == 0, "\n".join(tail(logs[n]) for n in ("sweep", "worker-1", "worker-2"))

        state = json.loads(next((tmp_path / "state" / "sweeps").glob("on-workers-*/state.json")).read_text())
        members = state["members"]
        assert sorted(members) == ["a-s0", "b-s0"] and all(
            m["status"] == "finished" for m in members.values()
        )
        runs = [http(f"{api}/flow_runs/{m['flow_run_id']}") for m in members.values()]
        assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
        assert all(r["name"].startswith("train/") for r in runs)  # named after their runs

        def span(r: dict) -> tuple[dt.datetime, dt.datetime]:
            return dt.datetime.fromisoformat(r["start_time"]), dt.datetime.fromisoformat(r["end_time"])

        (a0, a1), (b0, b1) = span(runs[0]), span(runs[1])
        assert a0 < b1 and b0 < a1, f"the two members did not run at the same time: {runs[0]} {runs[1]}"
        slots = http(f"{api}/v2/concurrency_limits/{LIMIT}")
        assert slots["active_slots"] == 0  # both slots given back
