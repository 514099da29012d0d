"""What a rerun runs with: the run's config as the iteration ran (the learner count it recorded)."""

from __future__ import annotations

from pathlib import Path

from ragen_core.config import load_config
from ragen_core.run import stage_record
from ragen_core.run.rerun import rerun_config
from ragen_core.run.run_dir import create_run


def test_a_rerun_uses_the_learner_count_each_iteration_ran_with(tmp_path: Path, local_state: Path) -> None:
    """Iteration 1 learned on 2 learners, then the run resumed with 1 (trainer.learners=1 in its
    config): a rerun of iteration 1 takes 2, of iteration 2 takes 1; an iteration without a record of
    its count (an older version's) takes the config's."""
    run = create_run(load_config(overrides=["trainer.learners=1", f"trainer.run_root={tmp_path}"]), "elastic")
    for k, learners in ((1, 2), (2, 1)):
        record = run.stage_record("learn", k)
        stage_record.save(record, {}, [], {}, {"learners": learners})
    assert rerun_config(run, 1).trainer.learners == 2
    assert rerun_config(run, 2).trainer.learners == 1
    assert rerun_config(run, 3).trainer.learners == 1
    assert rerun_config(run, 1).learner == run.config().learner  # nothing else changes
