"""What a user watching a run sees: the iteration line, durations, the ETA, rollout progress lines."""

from __future__ import annotations

import logging

import pytest

from ragen_core.progress import IterationClock, duration, iteration_line


def test_duration() -> None:
    assert [duration(s) for s in (0, 9.4, 59.6, 75, 3599, 3725)] == [
        "0s",
        "9s",
        "1m00s",
        "1m15s",
        "59m59s",
        "1h02m",
    ]


def test_iteration_line_shows_success_score_validity_validation_time_and_eta() -> None:
    metrics = {
        "train/success": 0.625,
        "train/Bandit/score": 0.5,
        "train/Other/score": 0.2,
        "train/Bandit/action_is_valid": 1.0,
        "train/Other/action_is_valid": 0.9,
        "val-env/success": 0.875,
        "val-env/Bandit/score": 9.0,
    }  # validation scores are not training scores
    line = iteration_line(3, 10, metrics, 41.2, 287.0)
    assert (
        line
        == "iteration 3/10 | train success 0.62 score +0.35 valid answers 0.95 | val success 0.88 | 41s | ETA 4m47s"
    )
    # the last iteration has no ETA; an iteration without validation has no val part
    assert iteration_line(10, 10, {"train/success": 1.0}, 5, 0) == "iteration 10/10 | train success 1.00 | 5s"


def test_eta_is_the_mean_iteration_time_times_the_iterations_left(monkeypatch: pytest.MonkeyPatch) -> None:
    clock_values = iter([0.0, 10.0, 30.0, 100.0, 105.0])
    monkeypatch.setattr("ragen_core.progress.time.perf_counter", lambda: next(clock_values))
    clock = IterationClock(total=6)
    assert clock.eta(0) is None
    assert clock.lap() == 10.0 and clock.lap() == 20.0
    assert clock.eta(2) == 4 * 15.0
    clock.restart()  # e.g. after the warm start: the wait before it is no iteration's time
    assert clock.lap() == 5.0


def test_long_rollouts_report_progress_and_short_ones_stay_quiet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
    from ragen_core.protocol import ProtocolConfig
    from ragen_core.rollout import runner
    from ragen_core.rollout.engine import SamplingParams
    from ragen_core.rollout.hf_engine import HFEngine
    from tests.tiny_policy import smallest_policy

    model, tok = smallest_policy()

    def play() -> None:
        groups = EnvGroups(
            EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[2], group_size=2), ProtocolConfig(max_turn=3)
        )
        runner.run_rollouts(
            groups, HFEngine(model, tok), tok, SamplingParams(max_new_tokens=4), seed=0, seed_round=7
        )

    with caplog.at_level(logging.INFO, logger="ragen.progress"):
        play()
        assert not caplog.records  # a rollout of a second prints nothing
        monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.0)
        play()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and lines[0].startswith("train rollouts: turn 1/3, ")
    assert "/4 episodes done" in lines[0] and "s left" in lines[0]
