"""A run is its own (no result of another run is reused), locked while it trains, safely
named, and resumed only with changes that keep its stored iterations valid. Through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.test_train import CONFIG, TINY, mlflow_steps, ragen, train

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("prefect_server"),
]  # started before the timed commands


NO_SFT = ("sft=null",)


def runs_in(state: Path) -> list[Path]:
    return sorted(p for p in (state / "runs").iterdir() if p.is_dir()) if (state / "runs").exists() else []


def test_same_config_twice_trains_two_runs(tmp_path: Path) -> None:
    """Defect 1: the second run of a config exited 1 (it got the first run's cached results and never
    wrote its own rollouts); with sft=null it already failed at iteration 1."""
    first = train(tmp_path, extra=NO_SFT)
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(tmp_path, extra=(*NO_SFT, "trainer.run_name=again"))
    assert second.returncode == 0, second.stderr[-3000:]
    runs = runs_in(tmp_path)
    assert len(runs) == 2
    assert [r.name.split("-")[0] for r in runs] == ["again", "bandit"]  # trainer.run_name is honoured
    for run in runs:
        assert all((run / f"iter_{k:04d}" / "DONE").exists() for k in (1, 2, 3))
        assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]
    # Defect 6: Prefect's stored results were cloudpickle files, and a crafted one ran code on resume.
    # Stage tasks now store none, and what flows store is JSON.
    results = [p for p in (tmp_path / "prefect" / "results").rglob("*") if p.is_file()]
    assert results  # the train flows' results
    for p in results:
        json.loads(p.read_bytes())


def test_truncated_pending_rollouts_are_played_again_on_resume(tmp_path: Path) -> None:
    """Defect 1 (second form): a pending iteration whose rollouts.parquet was truncated failed every
    --resume identically. The truncated file is now regenerated (the same bytes: play is seeded)."""
    crashed = train(tmp_path, crash="learn:2", extra=NO_SFT)
    assert crashed.returncode == -9
    (run,) = runs_in(tmp_path)
    rollouts = run / "iter_0002" / "rollouts.parquet"
    original = rollouts.read_bytes()
    rollouts.write_bytes(original[: len(original) // 3])
    resumed = ragen(["train", "--resume", run.name], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rollouts.read_bytes() == original
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]  # defect 14: no stale temp files


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute-run", "a" * 300, "bad name", ".hidden"])
def test_unsafe_run_names_are_refused_before_any_work(name: str, tmp_path: Path) -> None:
    """Defect 4: --name ../../escaped wrote the run outside runs/, /abs/path wrote there; a long name
    gave a misleading disk-space message."""
    t0 = time.perf_counter()
    out = ragen(
        ["train", str(CONFIG), "--name", name, "--set", f"trainer.run_root={tmp_path / 'runs'}"], tmp_path
    )
    assert out.returncode == 1
    assert "is not a valid run name" in out.stderr and "letters, digits" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 3
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escaped").exists()
    assert not Path("/tmp/absolute-run").exists()


def test_run_name_check_in_the_library() -> None:
    from ragen_core.run.run_dir import RunNameError, check_run_name

    assert check_run_name("bandit-tiny_v1.2") == "bandit-tiny_v1.2"
    for bad in ("..", "../x", "x/y", "", "-x", "a" * 65, "é"):
        with pytest.raises(RunNameError):
            check_run_name(bad)


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    """Defect 2: two `ragen train --resume RUN` at once both ran and logged every step twice."""
    from ragen_core.run.run_lock import RunLock, RunLockedError

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from ragen_core.run.run_lock import RunLock; "
            f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunLockedError, match=rf"in use by process {holder.pid} on .*wait for it to finish"
        ):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: the holder cannot clean up; the kernel drops its lock
        holder.wait()
    (tmp_path / ".metrics.json.tmp-99999").write_text("{")
    (tmp_path / "checkpoint.tmp-99999").mkdir()
    with RunLock(tmp_path) as lock:
        assert lock.holder()["pid"] == os.getpid()
        assert (
            not (tmp_path / ".metrics.json.tmp-99999").exists()
            and not (tmp_path / "checkpoint.tmp-99999").exists()
        )


def test_concurrent_resume_through_the_cli_is_refused(tmp_path: Path) -> None:
    from ragen_core.run.run_lock import RunLock

    run = tmp_path / "runs" / "locked-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text((CONFIG).read_text())
    with RunLock(run):
        out = ragen(["train", "--resume", str(run)], tmp_path)
    assert out.returncode == 1
    assert f"in use by process {os.getpid()}" in out.stderr and "Traceback" not in out.stderr
    assert not (run / "iter_0001").exists()


def test_resume_extends_a_finished_run_and_refuses_other_changes(tmp_path: Path) -> None:
    """Defect 10: `--resume RUN --set trainer.iterations=8` ran the old count with rc 0, and a config
    given with --resume was ignored."""
    done = train(tmp_path, extra=NO_SFT)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = runs_in(tmp_path)
    changed = ragen(["train", "--resume", run.name, "--set", "learner.optim.actor_lr=0.5"], tmp_path)
    assert changed.returncode == 1 and "learner.optim.actor_lr: stored" in changed.stderr
    other = ragen(["train", "configs/sokoban-tiny.yaml", "--resume", run.name], tmp_path)
    assert other.returncode == 1 and "cannot resume" in other.stderr and "more)" in other.stderr
    shorter = ragen(["train", "--resume", run.name, "--set", "trainer.iterations=2"], tmp_path)
    assert shorter.returncode == 1 and "already has 3 complete iterations" in shorter.stderr
    same = ragen(
        [
            "train",
            str(CONFIG),
            "--resume",
            run.name,
            *[x for o in [*TINY, *NO_SFT, f"trainer.run_root={tmp_path / 'runs'}"] for x in ("--set", o)],
        ],
        tmp_path,
    )
    assert same.returncode == 0, same.stderr[-3000:]  # its own config: accepted, nothing to do
    extended = ragen(["train", "--resume", run.name, "--set", "trainer.iterations=5"], tmp_path)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert (run / "iter_0005" / "DONE").exists() and not (run / "iter_0006").exists()
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3, 4, 5]
    info = json.loads((run / "run.json").read_text())
    assert info["resumes"][-1]["changes"] == {"trainer.iterations": ["3", "5"]}
