"""Echo-Trap monitor (RAGEN Finding 3 / Fig. 6) on synthetic metric series."""

from __future__ import annotations

import json
import math
import random

import pytest
from pydantic import ValidationError

from ragen_core.monitor import EchoTrapMonitor, MonitorConfig, Signal, detect

STD, GRAD, ENT = "rollout/in_group_std", "actor/grad_norm", "actor/entropy"


def healthy(n: int = 200, seed: int = 0) -> dict[str, list[tuple[int, float]]]:
    """A run that learns: noisy std around 0.3 decaying slowly, noisy grad norm (heavy-ish tail),
    entropy decaying steadily from 1.5 to about 0.6."""
    rng = random.Random(seed)
    std = [(t, max(0.0, 0.3 * (1 - 0.3 * t / n) + rng.gauss(0, 0.04))) for t in range(n)]
    grad = [(t, 1.0 * math.exp(rng.gauss(0, 0.35))) for t in range(n)]
    ent = [(t, 1.5 * math.exp(-0.9 * t / n) + rng.gauss(0, 0.05)) for t in range(n)]
    return {STD: std, GRAD: grad, ENT: ent}


def feed(mon: EchoTrapMonitor, hist: dict[str, list[tuple[int, float]]]) -> list[Signal]:
    steps = sorted({s for pts in hist.values() for s, _ in pts})
    by_key = {k: dict(pts) for k, pts in hist.items()}
    out: list[Signal] = []
    for s in steps:
        out += mon.update(s, {k: d[s] for k, d in by_key.items() if s in d})
    return out


def test_no_false_alarm_on_healthy_noisy_series():
    for seed in range(5):
        assert detect(healthy(seed=seed)) == [], seed


def test_reward_std_collapse_at_onset_step():
    # FrozenLake-PPO shape: std ~0.4 then collapses sharply at step 40 (success would follow at 90)
    rng = random.Random(1)
    std = [(t, 0.4 + rng.gauss(0, 0.03)) for t in range(40)] + [(t, 0.01) for t in range(40, 100)]
    mon = EchoTrapMonitor(MonitorConfig(patience=2))
    fired = []
    for s, v in std:
        got = mon.update(s, {STD: v})
        if got:
            fired.append((s, got))
    assert len(fired) == 1
    when, sigs = fired[0]
    assert when == 41  # confirmed after `patience` iterations ...
    (sig,) = sigs
    assert sig.name == "reward_std_collapse" and sig.step == 40  # ... reported at the onset
    assert sig.value == pytest.approx(0.01) and sig.reference > 0.4
    assert "step 40" in sig.message
    assert mon.first_collapse_step == 40


def test_std_check_waits_for_warmup_and_ignores_all_zero_std():
    # a task nobody solves at first: std 0 throughout -> no reference, no signal
    assert detect({STD: [(t, 0.0) for t in range(50)]}) == []
    # a drop inside the warm-up is not judged
    cfg = MonitorConfig(std_warmup=5)
    assert detect({STD: [(0, 0.5), (1, 0.01), (2, 0.01), (3, 0.4), (4, 0.4), (5, 0.4)]}, cfg) == []


def test_grad_norm_spike_detected_and_nonfinite_grad_counts():
    rng = random.Random(2)
    grad = [(t, 1.0 + rng.uniform(-0.2, 0.2)) for t in range(30)]
    grad[20] = (20, 12.0)  # Fig. 6: a spike marks the irreversible collapse
    sigs = detect({GRAD: grad})
    assert [(s.name, s.step) for s in sigs] == [("grad_norm_spike", 20)]
    assert sigs[0].value == 12.0 and 0.8 < sigs[0].reference < 1.2
    # NaN gradient norm -> a spike too (the learner skipped the step)
    grad2 = [(t, 1.0) for t in range(10)] + [(10, math.nan), (11, 1.0)]
    sigs2 = detect({GRAD: grad2})
    assert [(s.name, s.step) for s in sigs2] == [("grad_norm_spike", 10)]
    assert "not finite" in sigs2[0].message
    # the check needs grad_min_history values first
    assert detect({GRAD: [(0, 1.0), (1, 50.0)]}) == []


def test_entropy_collapse_and_blowup():
    base = [(t, 1.5) for t in range(10)]
    collapse = base + [(t, 0.05) for t in range(10, 20)]
    sigs = detect({ENT: collapse})
    assert [(s.name, s.step) for s in sigs] == [("entropy_collapse", 10)]
    assert sigs[0].reference == pytest.approx(1.5)
    # GRPO Bandit/Sokoban: entropy rises to ~6-7.5
    blowup = base + [(t, 1.5 + 0.5 * (t - 9)) for t in range(10, 30)]
    sigs = detect({ENT: blowup})
    assert [s.name for s in sigs] == ["entropy_blowup"]
    assert sigs[0].step == 13  # first value above 2 x 1.5 = 3.0 is 3.5 at step 13
    # a single dip does not fire with patience 2 ...
    dip = [*base, (10, 0.05), *[(t, 1.4) for t in range(11, 20)]]
    assert detect({ENT: dip}) == []
    # ... and does with patience 1
    assert [s.step for s in detect({ENT: dip}, MonitorConfig(patience=1))] == [10]


def test_signal_rearms_after_condition_clears():
    ent = [(t, 1.0) for t in range(5)] + [(5, 0.01), (6, 0.01), (7, 1.0), (8, 0.01), (9, 0.01), (10, 0.01)]
    sigs = detect({ENT: ent})
    assert [(s.name, s.step) for s in sigs] == [("entropy_collapse", 5), ("entropy_collapse", 8)]


def collapsing_run() -> dict[str, list[tuple[int, float]]]:
    """Healthy for 60 iterations, then std collapses at 60, grad spikes at 80, entropy blows up at 90."""
    h = healthy(120, seed=3)
    h[STD] = [(s, v if s < 60 else 0.002) for s, v in h[STD]]
    h[GRAD] = [(s, v if s != 80 else 40.0) for s, v in h[GRAD]]
    h[ENT] = [(s, v if s < 90 else 6.5) for s, v in h[ENT]]
    return h


def test_detect_equals_incremental_updates_and_state_round_trip():
    hist = collapsing_run()
    offline = detect(hist)
    names = [(s.name, s.step) for s in offline]
    assert ("reward_std_collapse", 60) in names and ("grad_norm_spike", 80) in names
    assert ("entropy_blowup", 90) in names

    mon = EchoTrapMonitor()
    assert feed(mon, hist) == offline == mon.signals
    assert mon.first_collapse_step == 60

    # stop half-way, save, restore into a new monitor (via JSON), continue: same signals
    first = {k: [(s, v) for s, v in pts if s < 70] for k, pts in hist.items()}
    rest = {k: [(s, v) for s, v in pts if s >= 70] for k, pts in hist.items()}
    a = EchoTrapMonitor()
    feed(a, first)
    state = json.loads(json.dumps(a.state_dict()))
    b = EchoTrapMonitor()
    b.load_state_dict(state)
    assert b.signals == a.signals
    feed(b, rest)
    assert b.signals == offline
    # replaying an already-seen iteration is ignored
    assert b.update(75, {STD: 0.0, GRAD: 1e9}) == []


def test_actions_stop_and_rollback():
    hist = collapsing_run()
    none = EchoTrapMonitor()
    feed(none, hist)
    assert not none.should_stop and not none.should_rollback

    stop = EchoTrapMonitor(MonitorConfig(action="stop"))
    feed(stop, hist)
    assert stop.should_stop and not stop.should_rollback

    only_grad = EchoTrapMonitor(MonitorConfig(action="stop", act_on=["grad_norm_spike"]))
    feed(only_grad, {k: [(s, v) for s, v in pts if s < 70] for k, pts in hist.items()})
    assert only_grad.signals and not only_grad.should_stop  # std collapsed but it does not count

    rb = EchoTrapMonitor(MonitorConfig(action="rollback", max_rollbacks=1))
    feed(rb, hist)
    assert rb.should_rollback and not rb.should_stop
    target = rb.rollback_step([0, 20, 40, 60, 80, 100])
    assert target == 40  # the latest checkpoint strictly before the onset (60)
    rb.reset_to(target)
    assert rb.signals == [] and rb.rollbacks == 1
    assert not rb.should_rollback and not rb.should_stop
    # the same collapse again: rollbacks are used up -> stop
    feed(rb, {k: [(s, v) for s, v in pts if s > 40] for k, pts in hist.items()})
    assert rb.should_stop and not rb.should_rollback
    assert rb.state_dict()["rollbacks"] == 1


def test_disabled_and_config_validation():
    mon = EchoTrapMonitor(MonitorConfig(enabled=False))
    assert feed(mon, collapsing_run()) == [] and mon.first_collapse_step is None
    with pytest.raises(ValidationError):
        MonitorConfig(std_collapse_ratio=1.5)
    with pytest.raises(ValidationError):
        MonitorConfig(action="explode")
    with pytest.raises(ValidationError):
        MonitorConfig(unknown=1)
    # a disabled check
    assert detect(collapsing_run(), MonitorConfig(grad_spike_factor=None, entropy_blowup_ratio=None)) == [
        s for s in detect(collapsing_run()) if s.name not in ("grad_norm_spike", "entropy_blowup")
    ]
    with pytest.raises(ValueError, match="version"):
        EchoTrapMonitor().load_state_dict({"version": 99})


VAL = "val-env/success"


def test_reward_variance_collapse_is_ragen2_s_window_rule():
    # baseline: mean of the first 3 std values (1.0); then 2 values in a row below 0.5 x 1.0
    cfg = MonitorConfig(var_baseline_steps=3, var_window=2, var_collapse_ratio=0.5, std_collapse_ratio=None)
    std = [(1, 1.2), (2, 0.8), (3, 1.0), (4, 0.4), (5, 0.6), (6, 0.4), (7, 0.3), (8, 0.2)]
    mon = EchoTrapMonitor(cfg)
    fired = {s: mon.update(s, {STD: v}) for s, v in std}
    assert [s for s, sigs in fired.items() if sigs] == [7]  # 5 broke the first streak
    (sig,) = fired[7]
    assert (sig.name, sig.step, sig.value, sig.reference) == ("reward_variance_collapse", 6, 0.4, 1.0)
    assert detect({STD: std}, cfg.model_copy(update={"var_collapse_ratio": None})) == []


def test_low_validation_success_counts_validations_not_iterations():
    cfg = MonitorConfig(low_success_checks=2, val_drop_ratio=None)
    hist = {VAL: [(0, 0.5), (2, 0.005), (4, 0.0), (6, 0.0)], STD: [(k, 0.3) for k in range(1, 7)]}
    sigs = detect(hist, cfg)
    assert [(s.name, s.step, s.reference) for s in sigs] == [("low_val_success", 2, 0.01)]
    assert detect({VAL: [(0, 0.5), (2, 0.005), (4, 0.02), (6, 0.0)]}, cfg) == []


def test_val_success_drop_against_the_best_validation_so_far():
    cfg = MonitorConfig()  # 0.8 x the best validation before it (the warm start's first), 2 in a row
    fall = [(0, 0.7), (2, 0.6), (4, 0.5), (6, 0.4)]  # 0.6 > 0.56; 0.5 and 0.4 below
    mon = EchoTrapMonitor(cfg)
    fired = {s: mon.update(s, {VAL: v}) for s, v in fall}
    assert [s for s, sigs in fired.items() if sigs] == [6]
    (sig,) = fired[6]
    assert (sig.name, sig.step, sig.value, sig.reference) == ("val_success_drop", 4, 0.5, 0.7)
    # a run that learns, with one noisy dip below 0.8 x its best: no alarm
    assert detect({VAL: [(0, 0.7), (2, 0.8), (4, 0.55), (6, 0.85)]}, cfg) == []
    # a run that learns and then falls from its peak, though it stays above 0.8 x its warm start
    (peak,) = detect({VAL: [(0, 0.5), (2, 0.9), (4, 0.45), (6, 0.45)]}, cfg)
    assert (peak.step, peak.value, peak.reference) == (4, 0.45, 0.9)
    # the reference is the best before the validation: a new best is never below it
    assert detect({VAL: [(0, 0.5), (2, 0.9), (4, 0.95), (6, 1.0)]}, cfg) == []
    # it counts for the action like any signal, and a rollback replays the warm start's reference
    rb = EchoTrapMonitor(MonitorConfig(action="rollback"))
    for s, v in fall:
        rb.update(s, {VAL: v})
    assert rb.should_rollback and rb.rollback_step(range(0, 6)) == 3
    rb.reset_to(3)
    assert rb.signals == [] and [s for s, v in fall[2:] if rb.update(s, {VAL: v})] == [6]
