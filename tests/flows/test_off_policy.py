"""One-step off-policy training through the flow (``trainer.off_policy_steps: 1``): which policy plays
each iteration, a kill and resume, stage reruns, and on Ray the next rollouts played during the update."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from tests.flows.test_train import assert_bitwise_equal, mlflow_steps, only_run, ragen, train, weights
from tests.prefect_server import prefect_api

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow

OFF_POLICY = ("trainer.off_policy_steps=1",)


@pytest.fixture(scope="module")
def off_policy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted tiny one-step off-policy run (in-process backend, 3 iterations)."""
    state = tmp_path_factory.mktemp("off-policy")
    out = train(state, extra=OFF_POLICY)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return state, only_run(state)


def played_by(run_root: Path, k: int) -> int:
    """The iteration whose policy played iteration ``k``'s rollouts, from its stage record's digest."""
    from ragen_core.run import stage_record
    from ragen_core.run.run_dir import RunDir

    run = RunDir(run_root)
    found = [
        j
        for j in range(k)
        if stage_record.load(run.stage_record("rollout", k), {"policy": run.policy_after(j)})
    ]
    assert len(found) == 1, found
    return found[0]


def test_each_iteration_is_played_by_the_policy_before_the_last_update(
    off_policy_run: tuple[Path, Path],
) -> None:
    """Iterations 1 and 2 by the starting policy, 3 by the policy after 1; the staleness is logged and
    MLflow has every step."""
    state, run = off_policy_run
    assert [played_by(run, k) for k in (1, 2, 3)] == [0, 0, 1]
    metrics = [json.loads((run / f"iter_{k:04d}" / "metrics.json").read_text()) for k in (1, 2, 3)]
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert mlflow_steps(state, run) == [0, 1, 2, 3]


def test_every_stage_of_an_off_policy_run_reruns_identical(
    off_policy_run: tuple[Path, Path], tmp_path: Path
) -> None:
    from ragen_core.run.rerun import rerun_stage
    from ragen_core.run.run_dir import RunDir

    run = RunDir(off_policy_run[1])
    for k in (1, 2, 3):
        for stage in ("rollout", "learn"):
            result = rerun_stage(run, k, stage, tmp_path / f"{k}-{stage}", backend="local")
            assert result.identical, (k, stage, result.detail)


def test_a_killed_off_policy_run_resumes_to_the_same_weights(
    off_policy_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """Killed in iteration 2's update, when iteration 3's rollouts are already stored (played ahead):
    the resume reuses them (the same file, untouched), trains iteration 2 again, and ends with the
    uninterrupted run's weights and MLflow steps. (A kill while the rollouts ahead are played is a kill
    in a rollout stage, as on-policy: tests/flows/test_train.py.)"""
    crashed = train(tmp_path, crash="learn:2", extra=OFF_POLICY)
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    run = only_run(tmp_path)
    assert (run / "iter_0001" / "DONE").exists() and not (run / "iter_0002" / "DONE").exists()
    ahead = run / "iter_0003" / "rollouts.parquet"
    assert played_by(run, 3) == 1
    stored = ahead.stat()
    resumed = ragen(["train", "--resume", run.name], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (ahead.stat().st_ino, ahead.stat().st_mtime_ns) == (stored.st_ino, stored.st_mtime_ns)
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]
    assert_bitwise_equal(weights(run, 3), weights(off_policy_run[1], 3))


def test_on_ray_the_next_rollouts_are_played_while_the_learner_updates(tmp_path: Path) -> None:
    """On the Ray backend the rollout actor plays iteration k + 1 during iteration k's learn stage: the
    two task runs overlap in Prefect's records. What they stored reruns identical on the same backend."""
    from ragen_core.run.rerun import rerun_stage
    from ragen_core.run.run_dir import RunDir

    out = train(tmp_path, extra=(*OFF_POLICY, "trainer.backend=ray"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = RunDir(only_run(tmp_path))
    assert [played_by(run.root, k) for k in (1, 2, 3)] == [0, 0, 1]
    run_id = json.loads((run.root / "run.json").read_text())["run_id"]
    flows = prefect_api("/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"train/{run_id}"]}}})
    tasks = prefect_api("/task_runs/filter", {"flow_runs": {"id": {"any_": [flows[0]["id"]]}}})

    def span(t: dict) -> tuple[dt.datetime, dt.datetime]:
        return dt.datetime.fromisoformat(t["start_time"]), dt.datetime.fromisoformat(t["end_time"])

    learns = sorted((span(t) for t in tasks if t["name"].startswith("learn")), key=lambda s: s[0])
    ahead = {t["name"]: span(t) for t in tasks if t["name"].startswith("rollout-ahead-")}
    assert sorted(ahead) == ["rollout-ahead-2", "rollout-ahead-3"] and len(learns) == 3, [
        t["name"] for t in tasks
    ]
    for k in (1, 2):  # iteration k's update and the rollouts of k + 1 ran at the same time
        (a0, a1), (l0, l1) = ahead[f"rollout-ahead-{k + 1}"], learns[k - 1]
        assert a0 < l1 and l0 < a1, (k, ahead, learns)
    result = rerun_stage(run, 3, "rollout", tmp_path / "rerun")
    assert result.identical, result.detail
