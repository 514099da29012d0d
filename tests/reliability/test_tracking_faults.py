"""MLflow faults against real parts: a tracking server that dies or hangs, and a store opened twice.

* A tracking server that dies (SIGKILL) or hangs (SIGSTOP) mid-run costs seconds once: the Tracker
  goes offline, later calls return at once, nothing raises, and training finishes; after a restart,
  ``ragen train --resume`` logs every missing step exactly once.
* Two processes opening one fresh SQLite store at once both work (MLflow itself races on the schema).

The server is a real ``mlflow server`` (SQLite store, proxied artifacts, one worker), one per module,
restarted on the same port and store by the next test that needs it (starting one takes 7-60 s, so
the tests are ordered to need only two starts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragen_core.config.tracking import TrackingConfig
from ragen_core.run.log_process import ProcessStepLog
from ragen_core.run.run_dir import RunDir
from ragen_core.run.step_log import StepLogger
from ragen_core.tracking.background import BackgroundLog
from ragen_core.tracking.tracker import Tracker
from tests.flows.test_train import CONFIG, TINY, only_run, ragen
from tests.test_e2e import INHERITED_DROP_PREFIXES, free_port, kill_group, tool, wait_healthy

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
#: The first failed call may cost this much (HTTP_DEFAULTS: ~3 s refused, ~15 s hanging) ...
FIRST_FAILURE_S = 15.0
#: ... and every later call nothing: a dozen of them together stay far below one retry (~2 s).
LATER_CALLS_S = 0.5


class Server:
    """``mlflow server`` on a fixed port and store: killed, stopped, restarted by the tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "mlflow.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def up(self) -> None:
        """Start it unless it is running; wait until ``/health`` answers."""
        if self.proc is not None and self.proc.poll() is None:
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_DROP_PREFIXES)}
        env["MLFLOW_DISABLE_TELEMETRY"] = "true"
        cmd = [
            tool("mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "mlartifacts"),
        ]
        self.starts += 1
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                env=env,
                start_new_session=True,
            )
        wait_healthy(f"{self.uri}/health", self.proc, self.log, "mlflow server")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group: no graceful shutdown, as in a crash or an OOM kill."""
        assert self.proc is not None
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        s.up()
        yield s
    finally:
        if s.proc is not None:
            with_cont = s.proc.poll() is None
            if with_cont:
                s.signal(signal.SIGCONT)  # a stopped group ignores SIGTERM until continued
            kill_group(s.proc)


def steps(client: MlflowClient, run_id: str, key: str | None = None) -> list[int]:
    """The steps of metric ``key`` (each point, duplicates kept), or with no key the steps the run
    marks as completely logged (its ``ragen.logged_steps`` tag)."""
    if key is None:
        from ragen_core.tracking.keys import parse_steps
        from ragen_core.tracking.tracker import LOGGED_STEPS_TAG

        return sorted(parse_steps(client.get_run(run_id).data.tags.get(LOGGED_STEPS_TAG, "")))
    return sorted(int(m.step) for m in client.get_metric_history(run_id, key))


def later_calls_are_free(tr: Tracker, tmp_path: Path) -> float:
    """Every call after the first failure: no network, no exception; returns the seconds they took."""
    touched: list[str] = []

    class NoNetwork:  # stands in for the MLflow client: any use is recorded (and would fail)
        def __getattr__(self, name: str) -> None:
            touched.append(name)
            raise AssertionError(f"offline Tracker used client.{name}")

    real, tr.client = tr.client, NoNetwork()  # type: ignore[assignment]
    art = tmp_path / "art"
    art.mkdir(exist_ok=True)
    (art / "a.txt").write_text("a")
    t0 = time.monotonic()
    try:
        assert tr.log_iteration(7, {"x": 7.0}) is False
        tr.set_tags({"k": "v"})
        tr.log_artifact(art / "a.txt")
        tr.log_artifacts(art, "folder")
        tr.log_transcripts([{"a": 1}], 7)
        assert tr.log_plots(tmp_path / "plots") == []
        tr.end("FINISHED")
    finally:
        tr.client = real
    assert touched == []
    assert tr.run_id is None  # released: end() did its job locally
    return time.monotonic() - t0


#: the stages an iteration times in its metrics.json (``update`` includes the learner step's parts)
TIMED_STAGES = ("gen", "update", "checkpoint", "testing", "collapse")


def untimed_s(run: RunDir, k: int) -> float:
    """Iteration ``k``'s wall time (previous DONE to its DONE) outside its timed stages."""
    wall = run.done_file(k).stat().st_mtime - run.done_file(k - 1).stat().st_mtime
    metrics = json.loads(run.metrics_file(k).read_text())
    return wall - sum(metrics.get(f"timing_s/{s}", 0.0) for s in TIMED_STAGES)


def test_training_outlives_a_dead_server_and_resume_logs_every_step(server: Server, tmp_path: Path) -> None:
    """A tracking outage mid-run: the server dies after iteration 2 and stays down; then it comes back."""
    server.up()
    state = tmp_path / "state"
    iterations = 6
    sets = [
        x
        for o in [*TINY, f"trainer.iterations={iterations}", f"trainer.run_root={state / 'runs'}"]
        for x in ("--set", o)
    ]
    env = {"MLFLOW_TRACKING_URI": server.uri}
    killed: dict[str, float] = {}
    finished = threading.Event()

    def kill_after_iteration_2() -> None:
        while not finished.is_set():
            if list((state / "runs").glob("*/iter_0002/DONE")):
                server.kill()
                killed["at"] = time.monotonic()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_iteration_2, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        out = ragen(["train", str(CONFIG), *sets], state, timeout=300, extra_env=env)
    finally:
        finished.set()
        watcher.join(5)
    done, done_wall = time.monotonic(), time.time()  # the wall clock to compare with file times
    log = out.stdout + out.stderr
    assert "at" in killed, "the run ended before iteration 2 was done?\n" + log[-3000:]
    assert out.returncode == 0, log[-4000:]
    run = only_run(state)
    assert all((run / f"iter_{k:04d}" / "DONE").exists() for k in range(1, iterations + 1))
    # The loop never waits on the dead server: each iteration's wall time outside its timed stages (~0.1 s
    # here) stays what it was with the server up, plus one failed call at most. Measured against the loop's
    # own stage timings, so a loaded machine (slower stages) does not fail it, where a wall-clock bound did.
    rd = RunDir(run)
    up, down = untimed_s(rd, 2), [untimed_s(rd, k) for k in range(3, iterations + 1)]
    assert sum(down) < FIRST_FAILURE_S + len(down) * max(1.0, 5 * up), (up, down)
    # After the last iteration: drain the log queue (one failed call, then every call returns at once) and
    # exit; a Tracker retrying each of its calls against the dead server would take minutes here.
    tail = done_wall - rd.done_file(iterations).stat().st_mtime
    assert tail < 60, (tail, done - killed["at"], done - t0)
    assert f"MLflow at {server.uri} unreachable since" in log, log[-4000:]
    assert f"`ragen train --resume {run.name}` logs what is missing" in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]

    server.up()
    c = server.client()
    mlflow_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    before = steps(c, mlflow_id)
    assert before == sorted(set(before)) and len(before) < iterations + 1, before  # some steps missing
    assert c.get_run(mlflow_id).info.status == "RUNNING"

    t1 = time.monotonic()
    resumed = ragen(["train", "--resume", run.name], state, timeout=300, extra_env=env)
    print(
        f"run {done - t0:.1f} s (kill -> exit {done - killed['at']:.1f} s), resume {time.monotonic() - t1:.1f} s; "
        f"steps in MLflow before the resume: {before}"
    )
    print(next(line for line in log.splitlines() if "unreachable since" in line and "--resume" in line))
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-4000:]
    assert "unreachable since" not in log
    assert steps(c, mlflow_id) == list(range(iterations + 1))  # every step once: none missing, no duplicate
    assert steps(c, mlflow_id, "train/success") == list(range(1, iterations + 1))
    assert c.get_run(mlflow_id).info.status == "FINISHED"


def test_hanging_server_costs_one_bounded_failure(server: Server, tmp_path: Path) -> None:
    """A server that accepts connections but never answers (SIGSTOP): bounded by the HTTP timeout."""
    server.up()
    tr = Tracker(TrackingConfig(tracking_uri=server.uri, experiment="faults"), tmp_path)
    run_id = tr.start("hanging-server", {})
    assert tr.log_iteration(0, {"x": 0.0})
    server.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        tr.set_tags({"ragen.last_iteration": "1"})
        first = time.monotonic() - t0
        assert first < FIRST_FAILURE_S + 2.0, first  # + 2 s for scheduling on a loaded machine
        assert tr.offline is not None
        assert tr.offline.startswith(f"MLflow at {server.uri} unreachable since set tags on run {run_id}")
        assert "no answer within 4 s" in tr.offline
        assert later_calls_are_free(tr, tmp_path) < LATER_CALLS_S
    finally:
        server.signal(signal.SIGCONT)


def test_dead_server_costs_one_short_failure_then_nothing(server: Server, tmp_path: Path) -> None:
    server.up()
    tr = Tracker(TrackingConfig(tracking_uri=server.uri, experiment="faults"), tmp_path)
    run_id = tr.start("dead-server", {"a": 1})
    ending = Tracker(TrackingConfig(tracking_uri=server.uri, experiment="faults"), tmp_path)
    ending.start("end-fails", {})
    bg = BackgroundLog()
    bg.submit(tr.log_iteration, 0, {"x": 0.0})
    bg.flush()
    # the same through the run's logging process (the default): its tracker goes offline over there
    in_process = Tracker(TrackingConfig(tracking_uri=server.uri, experiment="faults"), tmp_path)
    process_run = in_process.start("dead-server-process", {})
    (tmp_path / "process-run").mkdir()
    plog = ProcessStepLog(StepLogger(in_process, RunDir(tmp_path / "process-run"), "dead-server-process", 3))
    plog.submit("log_step", 0, {"x": 0.0})
    plog.flush()
    server.kill()  # left down: the next test that needs it restarts it

    t0 = time.monotonic()
    for k in (1, 2, 3):  # the first failure happens in the background thread, as during training
        bg.submit(tr.log_iteration, k, {"x": float(k)})
    bg.flush()  # raises nothing
    bg.close()
    first = time.monotonic() - t0
    assert first < FIRST_FAILURE_S, first
    assert tr.offline is not None
    assert tr.offline.startswith(f"MLflow at {server.uri} unreachable since log iteration 1 of run {run_id}")
    assert "connection refused" in tr.offline and "\n" not in tr.offline
    assert tr.logged_steps == {0}
    assert later_calls_are_free(tr, tmp_path) < LATER_CALLS_S

    for k in (1, 2, 3):
        plog.submit("log_step", k, {"x": float(k)})
    plog.flush()  # raises nothing; the training process's tracker is offline too, with the reason
    assert in_process.offline is not None
    assert in_process.offline.startswith(
        f"MLflow at {server.uri} unreachable since log iteration 1 of run {process_run}"
    )
    assert in_process.logged_steps == {0}
    plog.close()
    assert later_calls_are_free(in_process, tmp_path) < LATER_CALLS_S

    msg = tr.offline_message("my-run", tmp_path / "runs" / "my-run")
    assert msg is not None and msg.startswith(tr.offline)
    assert str(tmp_path / "runs" / "my-run") in msg and "`ragen train --resume my-run`" in msg

    t0 = time.monotonic()
    ending.end("FINISHED")  # the first failure is end() itself: bounded, no raise, run released
    assert time.monotonic() - t0 < FIRST_FAILURE_S
    assert ending.offline is not None and "since end run" in ending.offline and ending.run_id is None


# ---------------------------------------------------------------------------- concurrent first runs
RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ragen_core.tracking.tracker import Tracker
    from ragen_core.config.tracking import TrackingConfig

    state, go = Path(sys.argv[1]), Path(sys.argv[2])
    (state.parent / (state.name + "." + sys.argv[3] + ".ready")).touch()
    while not go.exists():  # start together: the imports above take seconds, unevenly
        time.sleep(0.002)
    tracker = Tracker(TrackingConfig(experiment="race"), state)
    run_id = tracker.start("racer-" + sys.argv[3], {"who": sys.argv[3]})
    assert tracker.log_iteration(0, {"x": 1.0})
    tracker.end()
    print("RUN", run_id)
""")


def test_two_first_runs_on_one_fresh_sqlite_store_both_work(tmp_path: Path) -> None:
    """Without the lock, MLflow's schema creation races: 'table ... already exists', 'duplicate
    column name', alembic revision errors; two processes per store, two fresh stores at once."""
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_DROP_PREFIXES)}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs: list[tuple[Path, subprocess.Popen[str]]] = []
    stores = [tmp_path / f"state{i}" for i in range(2)]
    try:
        for store in stores:
            for who in ("a", "b"):
                procs.append(
                    (
                        store,
                        subprocess.Popen(
                            [sys.executable, "-c", RACER, str(store), str(go), who],
                            cwd=tmp_path,
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True,
                        ),
                    )
                )
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.ready"))) < len(procs):
            assert time.monotonic() < deadline, "racers did not start"
            assert all(p.poll() is None for _, p in procs), [p.communicate()[0][-2000:] for _, p in procs]
            time.sleep(0.05)
        go.touch()
        outputs = [(store, p.communicate(timeout=180)[0], p.returncode) for store, p in procs]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"{store.name}: rc {rc}\n{out[-1500:]}" for store, out, rc in outputs if rc != 0]
    assert not failed, "\n".join(failed)
    for store in stores:
        c = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
        exp = c.get_experiment_by_name("race")
        assert exp is not None
        assert sorted(r.info.run_name for r in c.search_runs([exp.experiment_id])) == ["racer-a", "racer-b"]
        assert (store / "mlflow.db.lock").exists()


# ---------------------------------------------------------------------------- what an outage costs
#: The most an outage may add to a run, against the same run with the server up: one failed call
#: (~3 s refused) and slack for a loaded machine; before, three more retry sequences of calls made after
#: the tracker had gone offline (the run's link, the system metrics' last sample and their monitor's
#: check) added about 7 s here and 40 s with MLflow's default retries.
OUTAGE_EXTRA_S = 15.0


def _run_killing_at(server: Server, state: Path, kill_after: int | None) -> tuple[float, str]:
    """A 6-iteration run; with ``kill_after``, the server is SIGKILLed as that iteration is done. Returns
    the seconds from that iteration's DONE to the command's exit, and the command's output."""
    sets = [
        x for o in [*TINY, "trainer.iterations=6", f"trainer.run_root={state / 'runs'}"] for x in ("--set", o)
    ]
    mark = 2 if kill_after is None else kill_after
    seen: dict[str, float] = {}
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if list((state / "runs").glob(f"*/iter_{mark:04d}/DONE")):
                seen["at"] = time.monotonic()
                if kill_after is not None:
                    server.kill()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = ragen(
            ["train", str(CONFIG), *sets], state, timeout=300, extra_env={"MLFLOW_TRACKING_URI": server.uri}
        )
    finally:
        finished.set()
        watcher.join(5)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "at" in seen, log[-4000:]
    return time.monotonic() - seen["at"], log


def test_an_outage_costs_seconds_and_says_it_once(server: Server, tmp_path: Path) -> None:
    """The server dies after iteration 2 of 6 and stays down: the run takes at most ``OUTAGE_EXTRA_S``
    longer than with the server up, and the terminal holds our two lines (the outage as it happens,
    the resume command at the end), no urllib3 retry warning and no MLflow warning."""
    server.up()
    up_s, _ = _run_killing_at(server, tmp_path / "up", None)
    down_s, log = _run_killing_at(server, tmp_path / "down", 2)
    print(
        f"iteration 2 done -> exit: server up {up_s:.1f} s, server killed {down_s:.1f} s; extra {down_s - up_s:.1f} s"
    )
    assert down_s - up_s < OUTAGE_EXTRA_S, (up_s, down_s, log[-4000:])
    for noise in ("Retrying", "urllib3", "mlflow.system_metrics", "Failed to", "Traceback", "system metrics"):
        assert noise not in log, (noise, log[-4000:])
    said = [line for line in log.splitlines() if "unreachable since" in line]
    assert len(said) == 2 and "--resume" in said[-1], said
    assert str(tmp_path / "down" / "logs" / "libraries.log") in said[0], said
