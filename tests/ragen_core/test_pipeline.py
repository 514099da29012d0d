"""Pipeline stages and Prefect task caching at tiny scale (in-process session, real files)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ragen_core.config import load_config
from ragen_core.pipeline import PreflightError, RunDir, Session, create_run, init_policy_stage, preflight

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64", "model.corpus_seeds=2",
        "agent.max_turn=1", "train.tags=[Bandit]", "train.n_groups=[2]", "train.group_size=2",
        "val.tags=[Bandit]", "val.n_groups=[4]", "rollout.max_new_tokens=8", "rollout.filter_ratio=1",
        "learner.optim.mini_batch_size=4", "trainer.iterations=1", "trainer.backend=local",
        "learner.optim.actor_lr=1e-3"]


def test_preflight_names_what_to_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGEN_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))
    cfg = load_config("configs/paper/sokoban-starpo-s.yaml", [f"trainer.run_root={tmp_path}"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    text = str(err.value)
    assert "make vllm" in text and "rollout.engine=hf" in text and "learner.num_gpus=0" in text
    # vLLM's CPU attention has no kernel for head size 8 (32 / 4 heads)
    with pytest.raises(PreflightError, match=r"head size 8 .*model.num_heads"):
        preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}", "rollout.engine=vllm"]))
    monkeypatch.delenv("RAGEN_VLLM_PYTHON")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = load_config(overrides=[*TINY, f"trainer.run_root={blocker / 'runs'}"])
    with pytest.raises(PreflightError, match="not a writable folder"):
        preflight(bad)
    with pytest.raises(PreflightError, match="GiB free"):
        preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"]), min_free_gb=1e9)
    preflight(load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"]))


def test_iteration_reuses_only_intact_stage_outputs_of_its_own_run(tmp_path: Path) -> None:
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import iteration_flow
    from tasks.stages import drop_session, register_session

    cfg = load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}"])
    run = create_run(cfg, "reuse")
    init_policy_stage(cfg, run)
    session = Session(cfg, run, backend="local")
    register_session(run, session)
    learner = session.learner.learner
    try:
        with prefect_test_harness():
            iteration_flow(str(run.root), 1)
            assert learner.global_step == 1 and RunDir(run.root).last_complete() == 1
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
    """Issue 18, defect 1: the second run of a config got the first run's cached results and never
    wrote its own files. Each run now writes its own rollouts, checkpoints and records."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import iteration_flow
    from tasks.stages import drop_session, register_session

    cfg = load_config(overrides=[*TINY, f"trainer.run_root={tmp_path}", "sft=null"])
    runs = []
    with prefect_test_harness():
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
    first, second = runs
    assert first.root != second.root
    for run in runs:
        assert run.rollouts(1).is_file() and (run.checkpoint(1) / "manifest.json").is_file()
        assert run.last_complete() == 1
    a, b = (pq.read_table(r.rollouts(1)) for r in runs)  # same config and seed: the same play ...
    assert a.drop(["run_id"]).equals(b.drop(["run_id"]))
    assert set(a.column("run_id").to_pylist()) != set(b.column("run_id").to_pylist())  # ... in its own run


def test_file_digest_follows_content_and_skips_rehashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ragen_core import pipeline

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "a.bin").write_bytes(b"x" * 100)
    (d / "big.bin").write_bytes(b"y" * 300)
    monkeypatch.setattr(pipeline, "DIGEST_BY_STAT_BYTES", 200)  # big.bin is identified by stat
    first = pipeline.file_digest(d)
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or real(self))
    assert pipeline.file_digest(d) == first and reads == []  # memoised: nothing read again
    (d / "a.bin").write_bytes(b"z" * 100)  # same size, new content
    assert pipeline.file_digest(d) != first and reads == ["a.bin"]
    second = pipeline.file_digest(d)
    st = (d / "big.bin").stat()
    (d / "big.bin").write_bytes(b"w" * 300)  # a large file rewritten: new mtime, new digest
    os.utime(d / "big.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert pipeline.file_digest(d) != second
    assert "big.bin" not in reads  # never read: identified by (size, mtime)
