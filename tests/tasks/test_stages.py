"""The stage tasks (``tasks/stages.py``) chained by an iteration flow under Prefect's test harness:
what a stage reuses of its stored outputs, and that a run never reuses another run's."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ragen_core.config import load_config
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.session import Session
from ragen_core.run.stages import init_policy_stage
from tests.ragen_core.run.test_stages import STARTUP_S, TINY

#: Prefect's test server and tiny training iterations: `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


def test_iteration_reuses_only_intact_stage_outputs_of_its_own_run(tmp_path: Path) -> None:
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import iteration_flow
    from tasks.stages import drop_session, register_session

    cfg = load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"])
    run = create_run(cfg, "reuse")
    init_policy_stage(cfg, run)
    session = Session(cfg, run, backend="local")
    judged: list[tuple[int, bool, bool]] = []  # (k, filter decided, checkpoint written) when told
    register_session(
        run,
        session,
        lambda k: judged.append((k, run.filter_file(k).exists(), run.checkpoint(k).exists())),
    )
    learner = session.learner.learner
    try:
        with prefect_test_harness(server_startup_timeout=STARTUP_S):
            iteration_flow(str(run.root), 1)
            assert learner.global_step == 1 and RunDir(run.root).last_complete() == 1
            # The run hears of the judged rollouts once the filter has decided, before the learner
            # steps (its MLflow logging of them overlaps the update).
            assert judged == [(1, True, False)]
            stored = run.rollouts(1).read_bytes()
            saved = (run.checkpoint(1) / "manifest.json").stat().st_mtime_ns
            iteration_flow(str(run.root), 1)  # same inputs, intact outputs: every stage is reused
            assert learner.global_step == 1 and run.rollouts(1).read_bytes() == stored
            assert (run.checkpoint(1) / "manifest.json").stat().st_mtime_ns == saved
            # A truncated output is never trusted: the rollout stage plays again (the same bytes, it is
            # deterministic), and what depends on it is reused only because its input is the same again.
            run.rollouts(1).write_bytes(stored[: len(stored) // 2])
            iteration_flow(str(run.root), 1)
            assert run.rollouts(1).read_bytes() == stored
            assert (run.checkpoint(1) / "manifest.json").stat().st_mtime_ns == saved
            # A deleted checkpoint: the learn stage runs again, from the restored fresh learner.
            import shutil

            shutil.rmtree(run.checkpoint(1))
            iteration_flow(str(run.root), 1)
            assert (run.checkpoint(1) / "manifest.json").stat().st_mtime_ns != saved
            assert learner.global_step == 1 and session.at == 1
    finally:
        drop_session(run)
        session.close()


def test_a_second_run_of_the_same_config_reuses_nothing_of_the_first(tmp_path: Path) -> None:
    """The second run of a config once got the first run's cached results and never wrote its own
    files. Each run now writes its own rollouts, checkpoints and records."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import iteration_flow
    from tasks.stages import drop_session, register_session

    cfg = load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}", "sft=null"])
    runs = []
    with prefect_test_harness(server_startup_timeout=STARTUP_S):
        for _ in range(2):
            run = create_run(cfg, "twice")
            init_policy_stage(cfg, run)
            session = Session(cfg, run, backend="local")
            register_session(run, session)
            try:
                iteration_flow(str(run.root), 1)
            finally:
                drop_session(run)
                session.close()
            runs.append(run)
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:  # Prefect names an iteration after its run
            names = sorted(r.name for r in client.read_flow_runs())
        assert names == sorted(f"{r.root.name}/iteration-1" for r in runs)
    first, second = runs
    assert first.root != second.root
    for run in runs:
        assert run.rollouts(1).is_file() and (run.checkpoint(1) / "manifest.json").is_file()
        assert run.last_complete() == 1
    a, b = (pq.read_table(r.rollouts(1)) for r in runs)  # same config and seed: the same play ...
    assert a.drop(["run_id"]).equals(b.drop(["run_id"]))
    assert set(a.column("run_id").to_pylist()) != set(b.column("run_id").to_pylist())  # ... in its own run
