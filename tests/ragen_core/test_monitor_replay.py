"""The monitor's default thresholds on recorded bandit-tiny and frozenlake-tiny runs
(tests/data/monitor_*.json): the monitored metrics of each iteration's metrics.json and the warm
start's validation (eval/step_0000.json), from `ragen train` with the config and overrides in each
file's "run" (docs/metrics.md, "Calibration on bandit-tiny" and "A fall from the peak")."""

from __future__ import annotations

import json
from pathlib import Path

from ragen_core.monitor import EchoTrapMonitor, MonitorConfig, detect

DATA = Path(__file__).resolve().parents[1] / "data"


def history(name: str) -> dict[str, list[tuple[int, float]]]:
    raw = json.loads((DATA / name).read_text())["history"]
    return {k: [(int(s), float(v)) for s, v in pts] for k, pts in raw.items()}


def fired_online(mon: EchoTrapMonitor, hist: dict[str, list[tuple[int, float]]]) -> list[int]:
    """The iterations at which ``mon`` fires when fed ``hist`` step by step, as ragen_core.run.training does."""
    steps = sorted({s for pts in hist.values() for s, _ in pts})
    by_key = {k: dict(pts) for k, pts in hist.items()}
    return [s for s in steps if mon.update(s, {k: d[s] for k, d in by_key.items() if s in d})]


def test_collapsing_vanilla_grpo_run_is_flagged_when_validation_falls() -> None:
    hist = history("monitor_collapsing_vanilla_grpo_seed1.json")
    val = dict(hist["val-env/success"])
    sigs = detect(hist, MonitorConfig())
    assert [(s.name, s.step) for s in sigs] == [("val_success_drop", 8)]
    (sig,) = sigs
    assert sig.reference == val[0] and sig.value == val[8] < 0.8 * val[0]
    assert min(val.values()) < 0.5 * val[0]  # the run did fall: the flag is not a false alarm
    # online, as ragen_core.run.training feeds it: confirmed at the next validation, and a stop/rollback follows
    mon = EchoTrapMonitor(MonitorConfig(action="rollback"))
    assert fired_online(mon, hist) == [10] and mon.should_rollback and mon.rollback_step(range(0, 10)) == 7


def test_stable_starpo_s_run_is_not_flagged() -> None:
    hist = history("monitor_stable_starpo_s_ppo_seed2.json")
    val = dict(hist["val-env/success"])
    assert min(v for s, v in val.items() if s > 0) >= val[0]  # it never fell below its warm start
    assert detect(hist, MonitorConfig()) == []


def test_a_fall_from_the_peak_is_flagged_though_it_stays_above_the_warm_start_ratio() -> None:
    """frozenlake-tiny seed 2 (before think_holes) climbed from 0.580 to 0.703 and fell to 0.479
    after one bad update (iteration 62, PPO KL 0.03): below its warm start, but above 0.8 x it.
    Measured against the warm start alone the monitor missed it; against the best validation so far
    it fires."""
    hist = history("monitor_frozenlake_fall_from_peak_seed2.json")
    val = dict(hist["val-env/success"])
    sigs = detect(hist, MonitorConfig())
    assert [(s.name, s.step) for s in sigs] == [("val_success_drop", 70)]
    (sig,) = sigs
    assert sig.reference == max(v for s, v in val.items() if s < 70) == val[60]
    assert 0.8 * val[0] < sig.value == val[70] < 0.8 * val[60]
    # online: confirmed by the validation of iteration 80; a rollback goes back before iteration 70
    mon = EchoTrapMonitor(MonitorConfig(action="rollback"))
    assert fired_online(mon, hist) == [80] and mon.rollback_step(range(0, 80)) == 69


def test_a_stable_frozenlake_run_with_a_dip_is_not_flagged() -> None:
    hist = history("monitor_frozenlake_stable_seed3.json")
    val = dict(hist["val-env/success"])
    assert val[60] < val[50]  # it dipped (0.688 -> 0.658) and recovered
    assert detect(hist, MonitorConfig()) == []


def converging_history(success_after_drop: float) -> dict[str, list[tuple[int, float]]]:
    """A history shaped after a configs/bandit-smollm2.yaml run (seed 7) whose early warning fired at
    iteration 11 ("in-group reward std 0 ... fell below 0.1 x its running max") while training and
    validation success were 0.99-1.00: the std climbs while the policy learns, then falls to 0 when
    every member of every group picks the same arm. ``success_after_drop`` is the training success once
    the std has fallen: about 1 for that converged run, low for an Echo-Trap collapse."""
    std = [0.20, 0.30, 0.42, 0.45, 0.40, 0.33, 0.20, 0.10, 0.04, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    rising = [0.05, 0.15, 0.35, 0.55, 0.70, 0.82, 0.90, 0.95]
    success = rising + [success_after_drop] * (len(std) - len(rising))
    steps = range(1, len(std) + 1)
    return {
        "rollout/in_group_std": list(zip(steps, std, strict=True)),
        "train/success": list(zip(steps, success, strict=True)),
        "actor/grad_norm": [(s, 1.0) for s in steps],
    }


def test_a_converged_policy_is_not_flagged_and_the_same_std_fall_with_low_success_is() -> None:
    converged = converging_history(success_after_drop=0.995)
    assert detect(converged, MonitorConfig()) == []
    assert fired_online(EchoTrapMonitor(MonitorConfig()), converged) == []
    collapsed = converging_history(success_after_drop=0.30)
    names = [(s.name, s.step) for s in detect(collapsed, MonitorConfig())]
    assert ("reward_std_collapse", 9) in names
    # without the convergence rule the converged run raised the same early warning (the false alarm)
    assert detect(converged, MonitorConfig(converged_success=None)) == detect(
        collapsed, MonitorConfig(converged_success=None)
    )
