"""Which policy plays each iteration's rollouts, on-policy and one-step off-policy, across a rollback
(``stages.behaviour_policy``, ``stages.rollout_ahead``): pure functions of the config and the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragen_core.config import ConfigError, load_config
from ragen_core.run.run_dir import RunDir, atomic_write_text
from ragen_core.run.stages import behaviour_policy, rollout_ahead


def run_with_rollback(tmp_path: Path, after: int, to: int) -> RunDir:
    run = RunDir(tmp_path)
    atomic_write_text(run.rollback_file(after), json.dumps({"after": after, "to": to, "signals": ["x"]}))
    return run


def test_one_step_off_policy_plays_with_the_state_before_the_last_update(tmp_path: Path) -> None:
    run = run_with_rollback(tmp_path, after=3, to=1)  # iteration 4 starts from 1's state
    on = load_config(None, ["trainer.iterations=6"])
    off = load_config(None, ["trainer.iterations=6", "trainer.off_policy_steps=1"])
    assert [run.start_of(k) for k in range(1, 7)] == [0, 1, 2, 1, 4, 5]
    assert [behaviour_policy(on, run, k) for k in range(1, 7)] == [0, 1, 2, 1, 4, 5]
    # k = 1: nothing older; 4: the rollback restarts the pipeline from its target; 5: 4 started from 1
    assert [behaviour_policy(off, run, k) for k in range(1, 7)] == [0, 0, 1, 1, 1, 4]
    assert [rollout_ahead(off, k) for k in (1, 5, 6)] == [2, 6, None]
    assert rollout_ahead(on, 1) is None


def test_more_than_one_step_off_policy_is_refused_with_the_key() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.off_policy_steps"):
        load_config(None, ["trainer.off_policy_steps=2"])
