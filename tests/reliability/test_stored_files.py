"""Stored trajectory files that do not belong where they are, and reruns of what was never stored: named
at once, in one line, instead of wrong rows shown or a DIFFERENT verdict that blames reproducibility."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ragen_core.config import DEFAULT_CONFIG, load_config
from ragen_core.integrity import record
from ragen_core.run import stage_record
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.trajectory import write_trajectories
from tests.flows.test_cli import make
from tests.reliability.cli import clear_error, run_cli

FAST_S = 10.0


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    """A run of two complete iterations (rollouts with their stage records) and evaluations at steps 0
    and 2, made by hand: the checks under test come before any model is loaded."""
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))
    r = create_run(load_config(DEFAULT_CONFIG, ["trainer.iterations=2", "sft=null"]), "swapped")
    for k in (1, 2):
        t = make("Bandit", k, True, 1.0, 1, 4, [0.0])
        t.iteration = k
        write_trajectories([t], r.rollouts(k))
        stage_record.save(r.stage_record("rollout", k), {}, [r.rollouts(k)], {})
        r.done_file(k).write_text("")
    for step in (0, 2):
        t = make("Bandit", step, True, 1.0, 1, 4, [0.0])
        t.iteration, t.split = step, "val"
        write_trajectories([t], r.eval_file(step))
        stage_record.save(r.stage_record("evaluate", step), {}, [r.eval_file(step)], {})
    return r


def _swap_rollouts(r: RunDir) -> None:
    a, b = r.rollouts(1), r.rollouts(2)
    tmp = a.with_name("swap.tmp")
    shutil.move(a, tmp)
    shutil.move(b, a)
    shutil.move(tmp, b)
    record(a)  # SHA256SUMS rewritten: the digests of the folders no longer tell
    record(b)


def test_show_refuses_another_iterations_rows(run: RunDir, tmp_path: Path, cli_start_seconds: float) -> None:
    _swap_rollouts(run)
    out = run_cli(["show", f"{run.root.name}/iter_0002"], tmp_path)
    clear_error(out, "iter_0002/rollouts.parquet holds iteration 1's rows", "stored digest", "file digest")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds


def test_rerun_names_swapped_rollouts_instead_of_different(
    run: RunDir, tmp_path: Path, cli_start_seconds: float
) -> None:
    _swap_rollouts(run)
    out = run_cli(["rerun", run.root.name, "--iteration", "2", "--stage", "learn"], tmp_path)
    clear_error(out, "iter_0002/rollouts.parquet holds iteration 1's rows", "stored digest")
    assert "DIFFERENT" not in out.stdout
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds


def test_show_of_an_intact_iteration_still_works(run: RunDir, tmp_path: Path) -> None:
    out = run_cli(["show", f"{run.root.name}/iter_0002"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_rerun_of_a_step_without_evaluation_refuses_at_once(
    run: RunDir, tmp_path: Path, cli_start_seconds: float
) -> None:
    out = run_cli(["rerun", run.root.name, "--iteration", "1", "--stage", "evaluate"], tmp_path)
    clear_error(out, "step 1", "no stored evaluation", "steps with one: 0, 2")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    assert not (run.root / "reruns").exists()
