"""The fault matrix's second round (benchmarks/faults.py): signals to the whole process group at several
stages, a full disk under the MLflow store, hostile configs and files, and two commands at once.

* a **signal** case sends SIGINT (Ctrl-C) or SIGTERM (``timeout``) to the run's process group, Prefect's
  ephemeral server included; it passes when the command exits 130 / 143 within 10 s with one line naming
  ``ragen train --resume``, leaves no process, and the resume ends with nothing lost (as a kill case);
* a **disk full** case fills the disk under the MLflow store (a 64 MiB tmpfs; root only) after iteration
  1: the run finishes, says so in at most two lines without a traceback, and after space is freed the
  resume logs every step once;
* a **hostile input** case is judged as faults.py's bad inputs: a clear error before any work.

``exit_times`` collects the seconds from each signal to the command's exit (the figure reported).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults import CONFIG, cli_error, intact, resume, the_run, tiny_sets
from tests.flows.test_train import ragen
from tests.reliability import procs

Case = Callable[[Path, Path], tuple[bool, str]]
#: seconds from a signal to the command's exit, per signal case (printed after the matrix)
exit_times: dict[str, float] = {}
EXIT_WITHIN_S = 10.0


def _wait_for(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def signal_at(sig: signal.Signals, stage: str) -> Case:
    """``sig`` to the process group once ``stage`` is reached: ``start`` (the run folder exists: warm
    start), ``iteration 1`` (rollouts of iteration 2), ``iteration 2`` (iteration 3 and its validation)."""

    def case(state: Path, reference: Path) -> tuple[bool, str]:
        marker = procs.new_marker()
        args = ["train", str(CONFIG), *tiny_sets(state)]
        proc, out, err = procs.launch(args, state, marker)
        popen: subprocess.Popen[bytes] = proc  # type: ignore[assignment]
        try:
            if stage == "start":
                ready = lambda: bool(list((state / "runs").glob("*/run.json")))  # noqa: E731
            else:
                ready = lambda: f"{stage}/" in err.read_text()  # noqa: E731
            if not _wait_for(popen, ready, 600):
                return False, f"{stage} not reached (rc {popen.poll()}): {err.read_text()[-300:]}"
            sent = time.monotonic()
            os.killpg(popen.pid, sig)
            rc = popen.wait(timeout=120)
            took = time.monotonic() - sent
            exit_times[f"{sig.name} at {stage}"] = took
            text = out.read_text() + err.read_text()
            left = procs.wait_gone(marker, timeout=5)
        finally:
            procs.kill_tree(marker)
        said = [line for line in text.splitlines() if "ragen train --resume" in line]
        want = 130 if sig == signal.SIGINT else 143
        problems = [f"rc {rc}"] if rc != want else []
        problems += [f"exit {took:.1f} s after the signal"] if took > EXIT_WITHIN_S else []
        problems += ["a traceback"] if "Traceback" in text else []
        problems += [f"{len(said)} resume lines"] if len(said) != 1 else []
        problems += [f"{len(left)} processes left"] if left else []
        if problems:
            return False, "; ".join(problems) + " | " + text.strip()[-200:]
        run = the_run(state)
        resumed = resume(state, run)
        if resumed.returncode != 0:
            return False, f"resume rc {resumed.returncode}: {resumed.stderr.strip()[-300:]}"
        ok, detail = intact(state, run, reference)
        return ok, f"rc {rc} {took:.1f} s after the signal; {detail}"

    return case


def disk_full_under_the_store(state: Path, reference: Path) -> tuple[bool, str]:
    """The MLflow store (``MLFLOW_TRACKING_URI=sqlite:///...``) on a 64 MiB tmpfs, filled after iteration
    1; the state and run folders on the ordinary disk."""
    store = state / "store"
    store.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(store)]
    if subprocess.run(mount, capture_output=True).returncode:
        return False, "needs root to mount a tmpfs (not run)"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    fill = store / "fill"
    try:
        done = threading.Event()

        def fill_after_iteration_1() -> None:
            while not done.is_set() and not list((state / "runs").glob("*/iter_0001/DONE")):
                time.sleep(0.05)
            with contextlib.suppress(OSError), open(fill, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))

        threading.Thread(target=fill_after_iteration_1, daemon=True).start()
        first = ragen(["train", str(CONFIG), *tiny_sets(state)], state, extra_env=env)
        done.set()
        text = first.stdout + first.stderr
        said = [line for line in text.splitlines() if "No space left" in line or "disk is full" in line]
        if first.returncode != 0 or "Traceback" in text or not 1 <= len(said) <= 2:
            return False, f"rc {first.returncode}, {len(said)} lines on the full disk | {text.strip()[-300:]}"
        fill.unlink()
        run = the_run(state)
        resumed = resume(state, run, extra_env=env)
        if resumed.returncode != 0:
            return False, f"resume rc {resumed.returncode}: {resumed.stderr.strip()[-300:]}"
        ok, detail = intact(state, run, reference, tracking_uri=env["MLFLOW_TRACKING_URI"])
        return ok, f"rc 0 with {len(said)} lines on the full disk, no traceback; {detail}"
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


def _alias_bomb(state: Path, _: Path) -> list[str]:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    (state / "bomb.yaml").write_text("\n".join([*lines, "trainer: {iterations: 2, run_name: *l9}"]) + "\n")
    return ["train", str(state / "bomb.yaml")]


def _random_mlflow_db(state: Path, _: Path) -> list[str]:
    (state / "mlflow.db").write_bytes(os.urandom(4096))
    return ["train", str(CONFIG), *tiny_sets(state)]


def _broken_run_index(state: Path, _: Path) -> list[str]:
    (state / "runs.json").write_text('{"a-run": ')
    return ["train", str(CONFIG), *tiny_sets(state)]


def _hostile_safetensors(state: Path, _: Path) -> list[str]:
    model = state / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}" * 16)
    return ["evaluate", str(model), "--n", "1"]


def _sweep_file(state: Path) -> Path:
    from tests.ragen_core.sweep.test_sweep_spec import write_sweep

    overrides = [o for o in tiny_sets(state)[1::2]]
    return write_sweep(
        state / "sweep.yaml",
        name="twice",
        base=str(CONFIG),
        overrides=overrides,
        members=[{"name": "a"}, {"name": "b"}],
    )


def second_sweep_run(state: Path, _: Path) -> tuple[bool, str]:
    """``ragen sweep run`` of one file twice at once: the second refuses in one line naming the holder."""
    marker = procs.new_marker()
    sweep = _sweep_file(state)
    first, _out, err = procs.launch(["sweep", "run", str(sweep)], state, marker, log_name="first")
    popen: subprocess.Popen[bytes] = first  # type: ignore[assignment]
    try:
        if not _wait_for(popen, lambda: bool(list((state / "runs").glob("*/run.json"))), 600):
            return False, f"the first sweep did not start a member: {err.read_text()[-300:]}"
        t0 = time.monotonic()
        second = ragen(["sweep", "run", str(sweep)], state)
        took = time.monotonic() - t0
        ok, detail = _clear(second, "in use by process")
        rc = popen.wait(timeout=900)
    finally:
        procs.kill_tree(marker)
    members = sorted(p.name for p in (state / "runs").iterdir() if p.is_dir())
    ok = ok and rc == 0 and len(members) == 2
    return ok, f"second refused in {took:.0f} s; first rc {rc}, {len(members)} member runs; {detail}"


def _clear(out: object, *must_name: str) -> tuple[bool, str]:
    from benchmarks.faults import clear_error

    return clear_error(out, *must_name)  # type: ignore[arg-type]


CASES: dict[str, tuple[str, Case]] = {
    **{
        f"{sig.name} to the process group at {stage}": ("resume", signal_at(sig, stage))
        for sig in (signal.SIGINT, signal.SIGTERM)
        for stage in ("start", "iteration 1", "iteration 2")
    },
    "disk full under the MLflow store after iteration 1": ("resume", disk_full_under_the_store),
    "a second sweep run of a sweep in flight": ("error", second_sweep_run),
    "YAML alias bomb (10 levels)": ("error", cli_error(_alias_bomb, "bomb.yaml")),
    "actor_lr=inf": (
        "error",
        cli_error(lambda s, r: ["train", "--set", "learner.optim.actor_lr=inf"], "learner.optim.actor_lr"),
    ),
    "trainer.iterations=1e9": (
        "error",
        cli_error(lambda s, r: ["train", "--set", "trainer.iterations=1000000000"], "trainer.iterations"),
    ),
    "? in the state folder's path": (
        "error",
        cli_error(lambda s, r: ["train"], "RAGEN_STATE_DIR", env={"RAGEN_STATE_DIR": "/tmp/ragen-q?mode=ro"}),
    ),
    "random bytes as mlflow.db": ("error", cli_error(_random_mlflow_db, "mlflow.db")),
    "broken runs.json": ("error", cli_error(_broken_run_index, "runs.json")),
    "safetensors header of 2^62 bytes": ("error", cli_error(_hostile_safetensors, "model.safetensors")),
    "tracking URI foo://bar": (
        "error",
        cli_error(
            lambda s, r: ["train", "--set", "tracking.tracking_uri=foo://bar"], "tracking.tracking_uri"
        ),
    ),
}


def cleanup(base: Path) -> None:
    """Unmount what a case left mounted under ``base`` (a case that broke mid-way)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        where = line.split()[1]
        if where.startswith(str(base)):
            subprocess.run(["umount", "-l", where], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)
