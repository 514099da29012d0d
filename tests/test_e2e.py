"""End to end with real servers: a Prefect deployment trains a tiny run, MLflow shows it.

What runs, all on 127.0.0.1 and in a temporary folder:

1. ``mlflow server`` (SQLite store, proxied artifact folder, one worker) and ``prefect server start``
   (its own ``PREFECT_HOME``), each on a free port, as process groups; both must answer their
   health check within a bounded time.
2. ``prefect work-pool create ragen-process --type process`` and ``prefect --no-prompt deploy --all``
   from the repo root (``prefect.yaml``), then ``prefect deployment run 'ragen-train/ragen-train'``
   with the tiny quick overrides.
3. ``prefect worker start --pool ragen-process --run-once`` started from the temporary folder, not
   the repo root (the deployment's pull step must move the flow run into the checkout), with
   ``MLFLOW_TRACKING_URI`` pointing at the test server; the flow run must end COMPLETED.
4. MLflow's REST API: the run (linked to the Prefect flow run by a tag), its metric histories
   (``iteration`` and ``val-env/success`` at steps 0, 1, 2) and its artifacts (config.yaml, rollouts
   Parquet per iteration, plots).
5. MLflow's UI page of the run in headless Chromium (``--dump-dom``: the React app must have
   rendered the run name and a metric name), and a screenshot into the temporary folder.

Chromium is Debian's ``/usr/bin/chromium``; when missing, the test installs it with apt-get (as root,
as in CI) or fails saying how to install it. Every server and the worker are torn down (their
whole process groups) whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ragen_core.run.logged_models import run_alias
from tests.tiny_run import TINY_RUN

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
POOL = "ragen-process"
DEPLOYMENT = "ragen-train/ragen-train"
RUN_NAME = "e2e"
QUICK = ["trainer.iterations=2", "trainer.eval_every=1", *TINY_RUN, "trainer.backend=local"]
SERVER_START_TIMEOUT_S = 150  # healthy after 7-25 s on 2 idle cores; CI shares them
FLOW_RUN_TIMEOUT_S = 480  # about 75 s alone on 2 cores
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--window-size=1400,1600",
]
# The caller's settings for these tools (another test's PREFECT_HOME, a tracking URI, a Ray cluster
# address...) would point the servers, the clients or the flow run elsewhere: none is inherited.
INHERITED_DROP_PREFIXES = ("PREFECT_", "MLFLOW_", "RAGEN_", "RAY_ADDRESS")


# ------------------------------------------------------------------------------------ helpers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    """A console script of this virtual environment (prefect, mlflow)."""
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name!r} is not installed next to {sys.executable} nor on PATH; run `make setup`")
    return found


def tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<{path} unreadable>"
    return f"--- {path.name} (last {n} chars) ---\n{text[-n:]}"


def kill_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM the process group of ``proc`` (started with start_new_session), SIGKILL after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the whole group is gone
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie still counts as a member of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=10)


@contextmanager
def group(cmd: list[str], log: Path, **kwargs: Any) -> Iterator[subprocess.Popen[Any]]:
    """Start ``cmd`` as its own process group, output to ``log``; always torn down on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **kwargs,
        )
    try:
        yield proc
    finally:
        kill_group(proc)


def servers_env(tmp_path: Path, prefect_api: str) -> dict[str, str]:
    """The environment of the servers, the CLI commands and the workers of a test with its own Prefect
    server: nothing inherited from the caller's tools, every home and store in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_DROP_PREFIXES)}
    env.update(
        {
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_API_URL": prefect_api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "prefect-results"),
            "PREFECT_CLI_COLORS": "false",
            "PREFECT_CLI_WRAP_LINES": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "COLUMNS": "200",
            "NO_COLOR": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def mlflow_server_cmd(tmp_path: Path, port: int) -> list[str]:
    """``mlflow server`` on loopback: SQLite store and proxied artifacts in ``tmp_path``, one worker."""
    return [
        tool("mlflow"),
        "server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--artifacts-destination",
        str(tmp_path / "mlartifacts"),
    ]


def run_cli(cmd: list[str], env: dict[str, str], timeout: float = 180, cwd: Path = ROOT) -> str:
    """Run a short command to completion (its own process group, killed on timeout); its output."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s=2)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out[-4000:]}")
    finally:
        kill_group(proc, grace_s=2)
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-4000:]}"
    return out


def http(url: str, data: dict[str, Any] | None = None, timeout: float = 30) -> Any:
    """GET (or POST ``data`` as JSON) on loopback; the decoded JSON (or text) body."""
    body = json.dumps(data).encode() if data is not None else None
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def wait_healthy(url: str, proc: subprocess.Popen[Any], log: Path, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < SERVER_START_TIMEOUT_S:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before it was healthy\n{tail(log)}")
        try:
            http(url, timeout=5)
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.5)
    pytest.fail(f"{what} not healthy at {url} after {SERVER_START_TIMEOUT_S} s\n{tail(log)}")


def find_chromium() -> str:
    """Debian's chromium; installed with apt-get when missing (as root, as in CI), never skipped."""
    for candidate in (shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and Path(candidate).exists():
            return candidate
    hint = "install it: apt-get update && apt-get install -y chromium (Debian's package; .ci/run does this)"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail(
            f"headless Chromium is needed for the MLflow UI check and /usr/bin/chromium is missing; {hint}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-2000:]}\n{hint}")
    if not Path("/usr/bin/chromium").exists():
        pytest.fail(f"apt-get installed chromium but /usr/bin/chromium is missing; {hint}")
    return "/usr/bin/chromium"


def chromium(binary: str, profile: Path, url: str, *args: str, budget_ms: int, timeout: float = 120) -> str:
    """One headless Chromium call on a new empty profile; stdout (e.g. the DOM with --dump-dom)."""
    profile.mkdir(parents=True)
    cmd = [
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *args,
        url,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s=2)
        pytest.fail(f"chromium timed out after {timeout:.0f} s on {url}")
    finally:
        kill_group(proc, grace_s=2)
    assert proc.returncode == 0, f"chromium exited with {proc.returncode} on {url}\n{err[-3000:]}"
    return out


def history(mlflow_url: str, run_id: str, key: str) -> dict[int, float]:
    q = urllib.parse.urlencode({"run_id": run_id, "metric_key": key})
    got = http(f"{mlflow_url}/api/2.0/mlflow/metrics/get-history?{q}")
    return {int(m["step"]): float(m["value"]) for m in got.get("metrics", [])}


def artifacts(mlflow_url: str, run_id: str, path: str = "") -> dict[str, dict[str, Any]]:
    q = urllib.parse.urlencode({"run_id": run_id, **({"path": path} if path else {})})
    got = http(f"{mlflow_url}/api/2.0/mlflow/artifacts/list?{q}")
    return {f["path"]: f for f in got.get("files", [])}


# ------------------------------------------------------------------------------------ the test
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_deployment_trains_and_mlflow_shows_the_run(tmp_path: Path) -> None:
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    browser = find_chromium()  # first: a missing browser fails (or installs) before minutes of training
    prefect_port = mlflow_port = free_port()
    while mlflow_port == prefect_port:
        mlflow_port = free_port()
    prefect_api = f"http://{HOST}:{prefect_port}/api"
    mlflow_url = f"http://{HOST}:{mlflow_port}"
    state, runs = tmp_path / "state", tmp_path / "runs"

    env = servers_env(tmp_path, prefect_api)
    prefect = tool("prefect")
    mlflow_cmd = mlflow_server_cmd(tmp_path, mlflow_port)
    prefect_cmd = [prefect, "server", "start", "--host", HOST, "--port", str(prefect_port)]
    logs = {name: tmp_path / f"{name}.log" for name in ("mlflow", "prefect", "worker")}

    with (
        group(mlflow_cmd, logs["mlflow"], env=env, cwd=tmp_path) as mlflow_proc,
        group(prefect_cmd, logs["prefect"], env=env, cwd=tmp_path) as prefect_proc,
    ):
        try:
            # ---- 1. servers (started together; the slower one sets the pace)
            timings["mlflow healthy"] = wait_healthy(
                f"{mlflow_url}/health", mlflow_proc, logs["mlflow"], "mlflow server"
            )
            timings["prefect healthy"] = wait_healthy(
                f"{prefect_api}/health", prefect_proc, logs["prefect"], "prefect server"
            )

            # ---- 2. work pool, deployments from prefect.yaml, one flow run of ragen-train
            t0 = time.monotonic()
            run_cli([prefect, "work-pool", "create", POOL, "--type", "process"], env)
            out = run_cli([prefect, "--no-prompt", "deploy", "--all"], env)
            for name in (
                "ragen-train/ragen-train",
                "ragen-evaluate/ragen-evaluate",
                "ragen-rerun/ragen-rerun",
            ):
                assert f"Deployment '{name}' successfully created" in out, out[-4000:]
            deployment = http(f"{prefect_api}/deployments/name/{DEPLOYMENT}")
            assert deployment["work_pool_name"] == POOL
            assert deployment["parameters"]["request"]["config"] == "configs/bandit-tiny.yaml"
            assert deployment["pull_steps"] == [
                {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
            ], deployment["pull_steps"]
            schedules = deployment["schedules"]
            assert [(s["schedule"].get("cron"), s["active"]) for s in schedules] == [("0 2 * * *", False)]
            timings["deploy"] = time.monotonic() - t0

            request = {
                "config": "configs/bandit-tiny.yaml",
                "run_name": RUN_NAME,
                "overrides": [*QUICK, f"trainer.run_root={runs}"],
            }
            out = run_cli(
                [prefect, "deployment", "run", DEPLOYMENT, "--params", json.dumps({"request": request})], env
            )
            found = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
            assert found, f"no flow run id in the output of `prefect deployment run`:\n{out}"
            flow_run_id = found.group(1)

            # ---- 3. a process worker, started outside the repo, runs it to completion
            worker_env = {**env, "MLFLOW_TRACKING_URI": mlflow_url, "RAGEN_STATE_DIR": str(state)}
            t0 = time.monotonic()
            with group(
                [prefect, "worker", "start", "--pool", POOL, "--run-once"],
                logs["worker"],
                env=worker_env,
                cwd=tmp_path,
            ) as worker:
                try:
                    worker.wait(timeout=FLOW_RUN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pytest.fail(
                        f"the worker did not finish the flow run in {FLOW_RUN_TIMEOUT_S} s\n"
                        f"{tail(logs['worker'])}"
                    )
            timings["flow run"] = time.monotonic() - t0
            flow_run = http(f"{prefect_api}/flow_runs/{flow_run_id}")
            assert flow_run["state_type"] == "COMPLETED", (
                f"flow run {flow_run_id}: {flow_run['state_type']} {flow_run['state'].get('message')}\n"
                f"{tail(logs['worker'], 8000)}"
            )
            assert worker.returncode == 0, tail(logs["worker"])
            assert list(runs.iterdir()), f"no run directory in {runs}"

            # ---- 4. MLflow's REST API: the run, its metrics and artifacts
            exp = http(f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=ragen-flow")
            exp_id = exp["experiment"]["experiment_id"]
            found_runs = http(
                f"{mlflow_url}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp_id], "max_results": 10}
            ).get("runs", [])
            assert len(found_runs) == 1, found_runs
            run = found_runs[0]
            run_id, run_name = run["info"]["run_id"], run["info"]["run_name"]
            tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
            assert run["info"]["status"] == "FINISHED"
            assert run_name.startswith(f"{RUN_NAME}-") and tags["ragen.run_id"] == run_name
            assert tags["prefect.flow_run_id"] == flow_run_id
            assert flow_run["name"] == f"train/{run_name}"  # Prefect names the flow run after the run
            assert tags["ragen.last_iteration"] == "2"
            assert Path(tags["ragen.run_dir"]).parent == runs.resolve()

            assert tags["ragen.logged_steps"] == "0-2" and history(mlflow_url, run_id, "iteration") == {}
            success = history(mlflow_url, run_id, "val-env/success")
            assert set(success) == {0, 1, 2}, success
            assert all(0.0 <= v <= 1.0 for v in success.values()), success
            assert set(history(mlflow_url, run_id, "train/success")) == {1, 2}

            root = artifacts(mlflow_url, run_id)
            assert {"config.yaml", "rollouts", "plots", "eval", "overview.png"} <= set(root), sorted(root)
            for k in (1, 2):
                parquet = artifacts(mlflow_url, run_id, f"rollouts/iter_{k:04d}")
                assert f"rollouts/iter_{k:04d}/rollouts.parquet" in parquet, parquet
                assert parquet[f"rollouts/iter_{k:04d}/rollouts.parquet"]["file_size"] > 0
            plots = artifacts(mlflow_url, run_id, "plots")
            assert "plots/success.png" in plots, sorted(plots)
            assert all(p.endswith(".png") and f["file_size"] > 1000 for p, f in plots.items()), plots
            q = urllib.parse.urlencode({"path": "config.yaml", "run_uuid": run_id})
            config_text = http(f"{mlflow_url}/get-artifact?{q}")
            assert "iterations: 2" in str(config_text), str(config_text)[:2000]

            # the kept policies: versions of the config's registered model, under the run's aliases
            q = urllib.parse.urlencode({"name": "bandit-tiny", "alias": run_alias(run_name, "best")})
            best = http(f"{mlflow_url}/api/2.0/mlflow/registered-models/alias?{q}")["model_version"]
            assert best["source"].startswith("models:/m-") and best["run_id"] == run_id, best

            # episodes as traces, through MLflow's REST API (its Python client): iteration 2's train sample
            from mlflow import MlflowClient

            found_traces = MlflowClient(tracking_uri=mlflow_url).search_traces(
                locations=[exp_id],
                run_id=run_id,
                filter_string="metadata.`ragen.iteration` = '2' AND metadata.`ragen.split` = 'train'",
            )
            assert found_traces, "no episode traces of iteration 2"
            episode = found_traces[0]
            turns = [sp for sp in episode.data.spans if sp.parent_id is not None]
            assert turns and turns[0].name == "turn 1", [sp.name for sp in episode.data.spans]
            assert {a.name for a in episode.info.assessments} >= {"score", "success", "filter_kept"}

            # ---- 4b. Prefect's REST API: the flow run's artifacts (link to the MLflow run, progress)
            arts = http(
                f"{prefect_api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
            )
            by_key = {a["key"]: a for a in arts}
            link_key = "mlflow-" + re.sub(r"[^a-z0-9-]", "-", run_name.lower())
            assert link_key in by_key and run_id in by_key[link_key]["data"], sorted(by_key)
            assert by_key["progress-" + link_key.removeprefix("mlflow-")]["data"] == 100.0

            # ---- 5. the MLflow UI page of the run in headless Chromium
            t0 = time.monotonic()
            page = f"{mlflow_url}/#/experiments/{exp_id}/runs/{run_id}"
            dom = ""
            for attempt, budget in enumerate((15_000, 30_000, 60_000)):  # slower machines: more time
                dom = chromium(
                    browser, tmp_path / f"chromium-dom-{attempt}", page, "--dump-dom", budget_ms=budget
                )
                if run_name in dom and "val-env/success" in dom:
                    break
            (tmp_path / "run-page.html").write_text(dom)
            assert run_name in dom, f"the MLflow run page did not render the run name; DOM in {tmp_path}"
            assert "val-env/success" in dom, (
                f"the MLflow run page did not render the metrics; DOM in {tmp_path}"
            )
            shot = tmp_path / "mlflow-run.png"
            chromium(browser, tmp_path / "chromium-shot", page, f"--screenshot={shot}", budget_ms=15_000)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            # the run's Traces tab lists the episodes; an episode's page shows its turns as a chat
            dom = chromium(
                browser,
                tmp_path / "chromium-traces",
                f"{mlflow_url}/#/experiments/{exp_id}/traces?selectedEvaluationId={episode.info.trace_id}",
                "--dump-dom",
                budget_ms=30_000,
            )
            (tmp_path / "traces-page.html").write_text(dom)
            assert episode.info.trace_metadata["mlflow.trace.session"] in dom or "episode Bandit" in dom, (
                f"the Traces page did not list the episodes; DOM in {tmp_path}"
            )
            assert "turn 1" in dom, f"the trace view did not show the episode's turns; DOM in {tmp_path}"
            # the registered model's page shows its alias; Prefect's artifact page shows the link
            dom = chromium(
                browser,
                tmp_path / "chromium-model",
                f"{mlflow_url}/#/models/bandit-tiny",
                "--dump-dom",
                budget_ms=30_000,
            )
            (tmp_path / "model-page.html").write_text(dom)
            assert "bandit-tiny" in dom and run_alias(run_name, "best") in dom, (
                f"the registered model page did not render; DOM in {tmp_path}"
            )
            prefect_ui = prefect_api.removesuffix("/api")
            dom = chromium(
                browser,
                tmp_path / "chromium-artifact",
                f"{prefect_ui}/artifacts/artifact/{by_key[link_key]['id']}",
                "--dump-dom",
                budget_ms=30_000,
            )
            (tmp_path / "prefect-artifact.html").write_text(dom)
            assert f"/runs/{run_id}" in dom, (
                f"Prefect's artifact page did not render the MLflow link; DOM in {tmp_path}"
            )
            timings["chromium"] = time.monotonic() - t0
            timings["total"] = time.monotonic() - t_start
            print(f"\nMLflow run page screenshot: {shot}")
            print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
        except BaseException:
            # Whatever failed: the server logs help; the worker's log is in the assertion that needs it.
            print(tail(logs["prefect"], 2000), tail(logs["mlflow"], 2000), sep="\n")
            raise
