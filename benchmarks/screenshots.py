"""Screenshots of the MLflow and Prefect pages a researcher opens, on a tiny bandit run: so the next
person can look at what the UIs show without setting anything up.

What it does, all on 127.0.0.1 in a fresh state folder:

1. starts ``mlflow server`` (SQLite store, proxied artifacts) and ``prefect server start`` (with its
   UI, its own ``PREFECT_HOME``), each on a free port, as process groups torn down at the end;
2. trains a tiny bandit-tiny run against them (``ragen train``, 2 iterations, local backend), then
   evaluates it (``ragen evaluate``) and reruns its learn stage (``ragen rerun``);
3. writes a PNG per page with headless Chromium (Debian's ``chromium``) into ``--out`` (default
   ``.state/screenshots/``, which git ignores), and ``index.md`` listing each page's URL.

Usage: ``make screenshots`` or ``.venv/bin/python benchmarks/screenshots.py [--out DIR] [--keep]``
(``--keep``: leave the state folder and the server logs beside the PNGs). About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_core.tracking.keys import MODEL_TRAINING_VIEW  # noqa: E402
from tests.test_e2e import (  # noqa: E402  # after the path: the helpers the browser tests use
    CHROMIUM_FLAGS,
    HOST,
    free_port,
    group,
    kill_group,
    mlflow_server_cmd,
)
from tests.tiny_run import TINY_RUN  # noqa: E402

BIN = Path(sys.executable).parent
#: the tiny run: 2 iterations, validated at steps 0 and 2
RUN_SETTINGS = [
    *TINY_RUN,
    "trainer.iterations=2",
    "trainer.eval_every=2",
    "trainer.backend=local",
    "learner.optim.micro_batch_size=4",
]
#: Chromium's virtual time per page (ms): what the single-page apps need to fetch and draw
PAGE_BUDGET_MS = 20_000


def tool(name: str) -> str:
    found = BIN / name
    if not found.exists():
        sys.exit(f"{name} is not installed next to {sys.executable}; run `make setup`")
    return str(found)


def chromium_binary() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        sys.exit("headless Chromium is needed: apt-get install -y chromium (Debian's package)")
    return found


def wait_healthy(url: str, proc: subprocess.Popen[Any], log: Path, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.5)
    sys.exit(f"{what} not healthy at {url} after {timeout:.0f} s; its log: {log}")


def api(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def cli(args: list[str], env: dict[str, str], log: Path, timeout: float = 600) -> None:
    """One ``ragen`` command, its output appended to ``log``; exits naming the log if it fails."""
    with log.open("a") as out:
        out.write(f"\n$ ragen {' '.join(args)}\n")
        out.flush()
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
        finally:
            kill_group(proc, grace_s=5)
    if code != 0:
        sys.exit(f"`ragen {' '.join(args)}` exited with {code}; its output: {log}")


def screenshot(browser: str, url: str, png: Path, scratch: Path) -> bool:
    """One page as a PNG (a new empty profile each: no state carried between pages)."""
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=scratch))
    cmd = [
        browser,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={PAGE_BUDGET_MS}",
        f"--screenshot={png}",
        url,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_group(proc, grace_s=2)
    return png.exists() and png.stat().st_size > 0


def pages(mlflow: str, prefect_ui: str, prefect_api: str, state: Path) -> dict[str, str]:
    """The pages to capture, by file name: MLflow's views of the run, Prefect's of its flow runs."""
    run = next(p for p in (state / "runs").iterdir() if p.is_dir())
    info = json.loads((run / "run.json").read_text())
    mlflow_run = info["mlflow_run_id"]
    experiment = api(f"{mlflow}/api/2.0/mlflow/runs/get?run_id={mlflow_run}")["run"]["info"]["experiment_id"]
    run_page = f"{mlflow}/#/experiments/{experiment}/runs/{mlflow_run}"

    def flow_run(name_like: str) -> dict[str, Any]:
        found = api(f"{prefect_api}/flow_runs/filter", {"flow_runs": {"name": {"like_": name_like}}})
        if not found:
            sys.exit(f"no Prefect flow run named like {name_like!r}")
        return dict(found[0])

    train = flow_run(f"train/{info['run_id']}")
    summary = api(
        f"{prefect_api}/artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [train["id"]]}, "key": {"like_": "summary-"}}},
    )
    out = {
        "mlflow-experiment-runs": f"{mlflow}/#/experiments/{experiment}?compareRunsMode=TABLE",
        "mlflow-run-overview": run_page,
        "mlflow-run-model-metrics": f"{run_page}/model-metrics",
        "mlflow-run-traces": f"{run_page}/traces",
        "mlflow-run-artifacts": f"{run_page}/artifacts",
        "mlflow-registered-models": f"{mlflow}/#/models",
        "prefect-flow-runs": f"{prefect_ui}/runs",
        "prefect-train-flow-run": f"{prefect_ui}/runs/flow-run/{train['id']}",
        "prefect-evaluate-flow-run": f"{prefect_ui}/runs/flow-run/{flow_run('evaluate/%')['id']}",
        "prefect-rerun-flow-run": f"{prefect_ui}/runs/flow-run/{flow_run('rerun/%')['id']}",
    }
    if summary:
        out["prefect-train-summary-artifact"] = f"{prefect_ui}/artifacts/artifact/{summary[0]['id']}"
    # the sweep: its parent run (description with the curves), the HTML report, its Prefect report
    parents = api(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment], "filter": "tags.`ragen.sweep_role` = 'parent'"},
    ).get("runs", [])
    if parents:
        parent = parents[0]["info"]["run_id"]
        parent_page = f"{mlflow}/#/experiments/{experiment}/runs/{parent}"
        out["mlflow-sweep-parent"] = f"{parent_page}?{MODEL_TRAINING_VIEW}"
        out["mlflow-sweep-report-html"] = f"{parent_page}/artifacts/report/report.html"
        sweep_run = flow_run("sweep/%")
        report = api(
            f"{prefect_api}/artifacts/filter",
            {"artifacts": {"flow_run_id": {"any_": [sweep_run["id"]]}, "key": {"like_": "report-"}}},
        )
        if report:
            out["prefect-sweep-report-artifact"] = f"{prefect_ui}/artifacts/artifact/{report[0]['id']}"
    return out


#: A two-member sweep of the tiny run (one seed each), for the sweep pages
SWEEP: dict[str, Any] = {
    "name": "screens",
    "description": "Screenshots: StarPO-S against no filter on the tiny Bandit (1 seed, 2 iterations).",
    "base": str(ROOT / "configs" / "bandit-tiny.yaml"),
    "overrides": RUN_SETTINGS,
    "members": [{"name": "starpo-s"}, {"name": "no-filter", "overrides": ["rollout.filter.value=1.0"]}],
    "seeds": [0],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".state" / "screenshots")
    parser.add_argument("--keep", action="store_true", help="keep the state folder and server logs in --out")
    args = parser.parse_args()
    browser = chromium_binary()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    work = Path(tempfile.mkdtemp(prefix="ragen-screenshots-"))
    state = work / "state"
    mlflow_port, prefect_port = free_port(), free_port()
    mlflow, prefect_ui = f"http://{HOST}:{mlflow_port}", f"http://{HOST}:{prefect_port}"
    prefect_api = f"{prefect_ui}/api"
    env = {
        **os.environ,
        "RAGEN_STATE_DIR": str(state),
        "MLFLOW_TRACKING_URI": mlflow,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_HOME": str(work / "prefect-home"),
        "PREFECT_UI_API_URL": prefect_api,  # the UI's own calls go to this server, not :4200
        "PREFECT_UI_URL": prefect_ui,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": env_threads(),
    }
    log = work / "cli.log"
    t0 = time.monotonic()
    try:
        with ExitStack() as stack:
            ml = stack.enter_context(
                group(mlflow_server_cmd(work, mlflow_port), work / "mlflow.log", env=env, cwd=work)
            )
            pf = stack.enter_context(
                group(
                    [tool("prefect"), "server", "start", "--host", HOST, "--port", str(prefect_port)],
                    work / "prefect.log",
                    env=env,
                    cwd=work,
                )
            )
            wait_healthy(f"{mlflow}/health", ml, work / "mlflow.log", "mlflow server")
            wait_healthy(f"{prefect_api}/health", pf, work / "prefect.log", "prefect server")
            print(
                f"servers up: MLflow {mlflow}, Prefect {prefect_ui} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            sets = [x for o in [*RUN_SETTINGS, f"trainer.run_root={state / 'runs'}"] for x in ("--set", o)]
            cli(["train", str(ROOT / "configs" / "bandit-tiny.yaml"), *sets], env, log)
            run = next(p for p in (state / "runs").iterdir() if p.is_dir())
            cli(["evaluate", run.name, "--n", "8"], env, log)
            cli(["rerun", run.name, "--iteration", "2", "--stage", "learn"], env, log)
            sweep_file = work / "screens-sweep.yaml"
            sweep_file.write_text(
                yaml.safe_dump(
                    SWEEP | {"overrides": [*SWEEP["overrides"], f"trainer.run_root={work / 'sweep-runs'}"]}
                )
            )
            cli(["sweep", "run", str(sweep_file)], env, log)
            print(
                f"tiny run trained, evaluated, rerun; tiny sweep run ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            index = [
                "# Screenshots",
                "",
                f"Run `{run.name}`; servers were MLflow {mlflow}, Prefect {prefect_ui}.",
                "",
            ]
            for name, url in pages(mlflow, prefect_ui, prefect_api, state).items():
                ok = screenshot(browser, url, out / f"{name}.png", work)
                index.append(f"- `{name}.png`: {url}" + ("" if ok else " (no screenshot: Chromium failed)"))
                print(f"{'wrote' if ok else 'FAILED'} {out / f'{name}.png'}", flush=True)
            (out / "index.md").write_text("\n".join(index) + "\n")
    finally:
        if args.keep:
            kept = out / "work"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(work, kept, ignore=shutil.ignore_patterns("chromium-*"), symlinks=True)
        shutil.rmtree(work, ignore_errors=True)
    shots = sorted(out.glob("*.png"))
    print(f"{len(shots)} screenshots in {out} ({time.monotonic() - t0:.0f} s); index: {out / 'index.md'}")
    return 0 if shots else 1


def env_threads() -> str:
    return os.environ.get("OMP_NUM_THREADS", "1")


if __name__ == "__main__":
    sys.exit(main())
