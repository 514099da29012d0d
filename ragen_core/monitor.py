"""The Echo-Trap monitor: early signals of RAGEN's training collapse (paper: Finding 3 / Fig. 6).

The signals and their thresholds are listed in docs/metrics.md, "Echo-Trap signals".

RAGEN observes that multi-turn RL collapses into an "Echo Trap" (near-identical, repetitive
reasoning; Table 1) and that three training statistics announce it:

* **reward std collapse** -- the in-group reward std (``rollout/in_group_std``, the std of the
  scores of the N rollouts that share an initial state) drops sharply *before* success falls
  (FrozenLake-PPO: std drops at step 40, mean collapses at 90). Signal: the std falls below
  ``std_collapse_ratio`` x its running maximum, after ``std_warmup`` iterations.
* **gradient-norm spike** -- spikes mark the irreversible collapse (steps 170 / 110 / 90 on
  Bandit / Sokoban / FrozenLake). Signal: ``actor/grad_norm`` exceeds ``grad_spike_factor`` x the
  median of the previous ``grad_window`` values (or is not finite).
* **entropy collapse / blow-up** -- entropy decays steadily when learning works; erratic or
  rising entropy comes with collapse (GRPO on Bandit / Sokoban rises to about 6-7.5). Signals:
  ``actor/entropy`` below ``entropy_collapse_ratio`` x its initial value, or above
  ``entropy_blowup_ratio`` x it (the initial value is the mean of the first
  ``entropy_init_window`` values).

RAGEN-2 (``ragen/trainer/agent_trainer.py``) adds two early-stop rules, kept here as signals, and
this project one calibrated on its own runs (docs/metrics.md, "Echo-Trap signals"):

* **reward variance collapse** -- the in-group reward std stays below ``var_collapse_ratio`` x its
  baseline (the mean of its first ``var_baseline_steps`` values) for ``var_window`` iterations.
* **low validation success** -- ``val_key`` below ``low_success_threshold`` for
  ``low_success_checks`` validations in a row.
* **validation success drop** -- ``val_key`` below ``val_drop_ratio`` x the best validation so far
  (the warm start's, step 0's, until a later one beats it) for ``val_drop_checks`` validations in a
  row: a run that falls from its start and one that falls from its peak are both caught.
  Validation runs only every ``trainer.eval_every`` iterations: a signal on it lags by up to that
  many.

A signal fires once when its condition starts (after ``patience`` consecutive iterations for the
std and entropy conditions) and re-arms when the condition clears. ``Signal.step`` is the *onset*:
the first iteration of the run of iterations that met the condition, which is what a sweep report
compares with the step where success collapses.

Use it online (``EchoTrapMonitor.update`` once per iteration, ``state_dict`` saved with the
checkpoint so that a resumed run continues where it stopped) or offline (``detect`` replays
whole metric histories, e.g. read back from MLflow for a sweep report); both give the same
signals. A policy that solves its task deterministically also has zero in-group std: that is
convergence, not the Echo Trap, so the std signals do not count iterations whose training success
(``success_key``) is at least ``converged_success`` (a SmolLM2 bandit run's early warning fired at
iteration 11 while it won 99-100% of its episodes). Pure Python; no MLflow, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

SignalName = Literal[
    "reward_std_collapse",
    "grad_norm_spike",
    "entropy_collapse",
    "entropy_blowup",
    "reward_variance_collapse",
    "low_val_success",
    "val_success_drop",
]
SIGNAL_NAMES: tuple[SignalName, ...] = get_args(SignalName)
_STATE_VERSION = 1


class MonitorConfig(BaseModel):
    """Thresholds of the Echo-Trap monitor and what the trainer does when it fires.

    Set a ratio / factor to ``None`` to switch that check off.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="off: update() records nothing and never fires")
    action: Literal["none", "stop", "rollback"] = Field(
        default="none",
        description="none: only report signals; stop: end the run; rollback: restore the last checkpoint "
        "before the onset (then stop once max_rollbacks are used up)",
    )
    act_on: list[SignalName] = Field(
        default_factory=lambda: list(SIGNAL_NAMES), description="which signals trigger the action"
    )
    max_rollbacks: int = Field(default=2, ge=0, description="rollbacks allowed before falling back to stop")
    patience: int = Field(
        default=2, ge=1, description="consecutive iterations a std / entropy condition must hold to fire"
    )

    std_key: str = Field(default="rollout/in_group_std", description="in-group reward std metric")
    std_warmup: int = Field(default=5, ge=1, description="iterations seen before the std check starts")
    std_collapse_ratio: float | None = Field(
        default=0.1, gt=0.0, lt=1.0, description="fires when std < ratio x its running max"
    )
    success_key: str = Field(default="train/success", description="training success metric (convergence)")
    converged_success: float | None = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description="a reward std that falls while training success is at least this is convergence (every "
        "member of a group wins), not the Echo Trap: the std signals do not count it (None: they always do)",
    )

    grad_key: str = Field(default="actor/grad_norm", description="pre-clip gradient norm metric")
    grad_window: int = Field(default=10, ge=1, description="previous values whose median is the reference")
    grad_min_history: int = Field(default=5, ge=1, description="values needed before the spike check starts")
    grad_spike_factor: float | None = Field(
        default=5.0, gt=1.0, description="fires when grad_norm > factor x median(previous window)"
    )

    entropy_key: str = Field(default="actor/entropy", description="mean token entropy metric")
    entropy_init_window: int = Field(
        default=3, ge=1, description="first values averaged into the initial entropy"
    )
    entropy_collapse_ratio: float | None = Field(
        default=0.1, gt=0.0, lt=1.0, description="fires when entropy < ratio x initial"
    )
    entropy_blowup_ratio: float | None = Field(
        default=2.0, gt=1.0, description="fires when entropy > ratio x initial"
    )

    # RAGEN-2's early stop on reward variance (agent_trainer.py): baseline = mean of the first 10
    # values of the in-group reward std, stop when 10 values in a row are below 0.1 x the baseline.
    # Off by default (var_collapse_ratio=0.1 is RAGEN-2's rule): whenever it would fire,
    # reward_std_collapse (below 0.1 x the running max, which is >= the baseline) has fired already.
    var_baseline_steps: int = Field(
        default=10, ge=1, description="first std_key values averaged into the reward-variance baseline"
    )
    var_window: int = Field(
        default=10, ge=1, description="iterations in a row the std must stay below the ratio x baseline"
    )
    var_collapse_ratio: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description="fires when std < ratio x baseline for var_window iterations",
    )

    val_key: str = Field(default="val-env/success", description="validation success metric")
    # RAGEN-2's early stop on validation success: below 1% at 5 validations in a row.
    low_success_threshold: float | None = Field(
        default=0.01, gt=0.0, le=1.0, description="fires when val_key < threshold for low_success_checks"
    )
    low_success_checks: int = Field(default=5, ge=1, description="validations in a row below the threshold")
    # Calibrated on this project's bandit-tiny and frozenlake-tiny runs (docs/metrics.md, "Echo-Trap signals").
    val_drop_ratio: float | None = Field(
        default=0.8, gt=0.0, lt=1.0, description="fires when val_key < ratio x the best validation so far"
    )
    val_drop_checks: int = Field(default=2, ge=1, description="validations in a row below the ratio")

    # The collapse metrics (ragen_core/run/collapse_probe.py): measured, logged as collapse/*, not a signal.
    # RAGEN-2's compute_freq (config/base.yaml): the cost is measured in docs/metrics.md, "Collapse metrics".
    collapse_every: int = Field(
        default=5,
        ge=0,
        description="compute collapse/* metrics at iteration 1 and every N iterations (0: off)",
    )
    collapse_prompts: int = Field(default=8, ge=2, description="groups (prompts) sampled per computation")
    collapse_responses_per_prompt: int = Field(
        default=4, ge=1, description="responses sampled per group; each is scored under every sampled prompt"
    )

    def metric_keys(self) -> list[str]:
        """The metric keys the monitor reads."""
        return list(
            dict.fromkeys([self.std_key, self.grad_key, self.entropy_key, self.val_key, self.success_key])
        )


@dataclass(frozen=True)
class Signal:
    """One Echo-Trap signal: ``value`` of the metric at the onset ``step`` against its ``reference``
    (the running max, the window median or the initial value)."""

    name: str
    step: int
    value: float
    reference: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Signal:
        return cls(
            name=str(d["name"]),
            step=int(d["step"]),
            value=float(d["value"]),
            reference=float(d["reference"]),
            message=str(d["message"]),
        )


def signal_metrics(signals: Sequence[Signal]) -> dict[str, float]:
    """The metrics a step logs for the signals that fired at it: ``monitor/<name>`` = 1."""
    return {f"monitor/{s.name}": 1.0 for s in signals}


class _Edge:
    """Edge trigger with patience: fires once when a condition has held ``patience`` times in a row,
    reporting the onset; re-arms when the condition clears."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.streak = 0
        self.onset: tuple[int, float, float] | None = None
        self.fired = False

    def feed(self, cond: bool, step: int, value: float, ref: float) -> tuple[int, float, float] | None:
        if not cond:
            self.streak, self.onset, self.fired = 0, None, False
            return None
        if self.streak == 0:
            self.onset = (step, value, ref)
        self.streak += 1
        if not self.fired and self.streak >= self.patience:
            self.fired = True
            return self.onset
        return None


def _fmt(x: float) -> str:
    return f"{x:.4g}"


class EchoTrapMonitor:
    """Watches one run's metrics, iteration by iteration, for the Echo-Trap signals.

    ``update(step, metrics)`` returns the signals that fired at this iteration (steps that are not
    after the last one seen are ignored, so replaying an iteration is harmless); ``signals`` holds
    all of them; ``should_stop`` / ``should_rollback`` say what the trainer must do per
    ``cfg.action``; ``rollback_step(available)`` picks the checkpoint to restore and
    ``reset_to(step)`` forgets everything after it.
    """

    def __init__(self, cfg: MonitorConfig | None = None) -> None:
        self.cfg = cfg or MonitorConfig()
        self._init_state()
        self.rollbacks = 0

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        c = self.cfg
        self._series: dict[str, list[tuple[int, float]]] = {k: [] for k in c.metric_keys()}
        self._last_step: int | None = None
        self.signals: list[Signal] = []
        # std collapse
        self._std_n = 0
        self._std_max = -math.inf
        self._std_edge = _Edge(c.patience)
        # grad spikes (patience 1: a spike is an event)
        self._grad_window: deque[float] = deque(maxlen=c.grad_window)
        self._grad_edge = _Edge(1)
        # entropy
        self._ent_first: list[float] = []
        self._ent_collapse_edge = _Edge(c.patience)
        self._ent_blowup_edge = _Edge(c.patience)
        # reward variance (RAGEN-2): baseline from the first values, then a window below the ratio
        self._var_first: list[float] = []
        self._var_edge = _Edge(c.var_window)
        # validation success
        self._val_best: float | None = None  # the warm start's, then the best validation since
        self._low_edge = _Edge(c.low_success_checks)
        self._drop_edge = _Edge(c.val_drop_checks)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the monitored series seen so far (replayed on load) and the rollback count."""
        return {
            "version": _STATE_VERSION,
            "series": {k: [[s, v] for s, v in pts] for k, pts in self._series.items()},
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` (the config is this monitor's own; the series are replayed)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"monitor state version {state.get('version')!r} is not {_STATE_VERSION}")
        self._init_state()
        self.rollbacks = int(state.get("rollbacks", 0))
        history = {k: [(int(s), float(v)) for s, v in pts] for k, pts in state.get("series", {}).items()}
        for step, metrics in _by_step(history):
            self.update(step, metrics)

    def reset_to(self, step: int) -> None:
        """Forget every iteration after ``step`` (after restoring the checkpoint of ``step``) and count
        one rollback."""
        history = {k: [(s, v) for s, v in pts if s <= step] for k, pts in self._series.items()}
        rollbacks = self.rollbacks + 1
        self._init_state()
        for s, metrics in _by_step(history):
            self.update(s, metrics)
        self.rollbacks = rollbacks

    # ------------------------------------------------------------------ verdicts
    @property
    def first_collapse_step(self) -> int | None:
        """The earliest onset of any signal (None: no signal), for sweep reports."""
        return min((s.step for s in self.signals), default=None)

    @property
    def triggered(self) -> list[Signal]:
        """The signals that count towards ``cfg.action``."""
        return [s for s in self.signals if s.name in self.cfg.act_on]

    @property
    def should_rollback(self) -> bool:
        c = self.cfg
        return (
            c.enabled and c.action == "rollback" and bool(self.triggered) and self.rollbacks < c.max_rollbacks
        )

    @property
    def should_stop(self) -> bool:
        c = self.cfg
        if not (c.enabled and self.triggered):
            return False
        return c.action == "stop" or (c.action == "rollback" and self.rollbacks >= c.max_rollbacks)

    def rollback_step(self, available: Iterable[int]) -> int | None:
        """The latest of the ``available`` checkpoint steps strictly before the first triggering
        onset (None: nothing triggered, or no checkpoint early enough)."""
        trig = self.triggered
        if not trig:
            return None
        onset = min(s.step for s in trig)
        return max((s for s in available if s < onset), default=None)

    # ------------------------------------------------------------------ update
    def update(self, step: int, metrics: Mapping[str, float]) -> list[Signal]:
        """Feed one iteration's metrics; return the signals that fired now."""
        if not self.cfg.enabled:
            return []
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            return []
        self._last_step = step
        fired: list[Signal] = []
        c = self.cfg
        values: dict[str, float] = {}
        for key in c.metric_keys():
            if key in metrics and metrics[key] is not None:
                values[key] = float(metrics[key])
                self._series[key].append((step, values[key]))
        if c.std_key in values:
            success = values.get(c.success_key)
            converged = (
                c.converged_success is not None and success is not None and success >= c.converged_success
            )
            fired += self._update_std(step, values[c.std_key], converged)
            fired += self._update_variance(step, values[c.std_key], converged)
        if c.grad_key in values:
            fired += self._update_grad(step, values[c.grad_key])
        if c.entropy_key in values:
            fired += self._update_entropy(step, values[c.entropy_key])
        if c.val_key in values:
            fired += self._update_val(step, values[c.val_key])
        self.signals.extend(fired)
        return fired

    def _update_std(self, step: int, v: float, converged: bool = False) -> list[Signal]:
        c = self.cfg
        if not math.isfinite(v):
            return []
        out: list[Signal] = []
        if c.std_collapse_ratio is not None and self._std_n >= c.std_warmup and self._std_max > 0:
            cond = v < c.std_collapse_ratio * self._std_max and not converged
            hit = self._std_edge.feed(cond, step, v, self._std_max)
            if hit:
                s, val, ref = hit
                out.append(
                    Signal(
                        "reward_std_collapse",
                        s,
                        val,
                        ref,
                        f"in-group reward std {_fmt(val)} at step {s} fell below {c.std_collapse_ratio} x its "
                        f"running max {_fmt(ref)} (Echo-Trap early warning, RAGEN Finding 3)",
                    )
                )
        self._std_n += 1
        self._std_max = max(self._std_max, v)
        return out

    def _update_grad(self, step: int, v: float) -> list[Signal]:
        c = self.cfg
        if c.grad_spike_factor is None:
            return []
        out: list[Signal] = []
        ref = statistics.median(self._grad_window) if self._grad_window else math.nan
        if not math.isfinite(v):
            cond = True
        else:
            cond = len(self._grad_window) >= c.grad_min_history and ref > 0 and v > c.grad_spike_factor * ref
        hit = self._grad_edge.feed(cond, step, v, ref)
        if hit:
            s, val, r = hit
            what = (
                "is not finite" if not math.isfinite(val) else f"exceeds {c.grad_spike_factor} x the median"
            )
            out.append(
                Signal(
                    "grad_norm_spike",
                    s,
                    val,
                    r,
                    f"gradient norm {_fmt(val)} at step {s} {what} {_fmt(r)} of the previous "
                    f"{len(self._grad_window)} iterations (irreversible-collapse marker, RAGEN Finding 3)",
                )
            )
        if math.isfinite(v):
            self._grad_window.append(v)
        return out

    def _update_entropy(self, step: int, v: float) -> list[Signal]:
        c = self.cfg
        if not math.isfinite(v):
            return []
        if len(self._ent_first) < c.entropy_init_window:
            self._ent_first.append(v)
            return []
        init = sum(self._ent_first) / len(self._ent_first)
        out: list[Signal] = []
        if c.entropy_collapse_ratio is not None and init > 0:
            hit = self._ent_collapse_edge.feed(v < c.entropy_collapse_ratio * init, step, v, init)
            if hit:
                s, val, ref = hit
                out.append(
                    Signal(
                        "entropy_collapse",
                        s,
                        val,
                        ref,
                        f"entropy {_fmt(val)} at step {s} fell below {c.entropy_collapse_ratio} x its "
                        f"initial value {_fmt(ref)} (the policy stopped exploring)",
                    )
                )
        if c.entropy_blowup_ratio is not None and init > 0:
            hit = self._ent_blowup_edge.feed(v > c.entropy_blowup_ratio * init, step, v, init)
            if hit:
                s, val, ref = hit
                out.append(
                    Signal(
                        "entropy_blowup",
                        s,
                        val,
                        ref,
                        f"entropy {_fmt(val)} at step {s} rose above {c.entropy_blowup_ratio} x its "
                        f"initial value {_fmt(ref)} (erratic entropy comes with collapse, RAGEN Fig. 6)",
                    )
                )
        return out

    def _update_variance(self, step: int, v: float, converged: bool = False) -> list[Signal]:
        c = self.cfg
        if c.var_collapse_ratio is None or not math.isfinite(v):
            return []
        if len(self._var_first) < c.var_baseline_steps:
            self._var_first.append(v)
            return []
        base = sum(self._var_first) / len(self._var_first)
        hit = self._var_edge.feed(v < c.var_collapse_ratio * base and not converged, step, v, base)
        if not hit:
            return []
        s, val, ref = hit
        return [
            Signal(
                "reward_variance_collapse",
                s,
                val,
                ref,
                f"in-group reward std {_fmt(val)} from step {s} stayed below {c.var_collapse_ratio} x its "
                f"baseline {_fmt(ref)} (mean of the first {len(self._var_first)} values) for {c.var_window} "
                "iterations (RAGEN-2's reward-variance early stop)",
            )
        ]

    def _update_val(self, step: int, v: float) -> list[Signal]:
        c = self.cfg
        if not math.isfinite(v):
            return []
        out: list[Signal] = []
        if c.low_success_threshold is not None:
            hit = self._low_edge.feed(v < c.low_success_threshold, step, v, c.low_success_threshold)
            if hit:
                s, val, ref = hit
                out.append(
                    Signal(
                        "low_val_success",
                        s,
                        val,
                        ref,
                        f"validation success {_fmt(val)} from step {s} stayed below {_fmt(ref)} for "
                        f"{c.low_success_checks} validations (RAGEN-2's low-success early stop)",
                    )
                )
        best = self._val_best
        self._val_best = v if best is None else max(best, v)
        if best is None:
            return out  # the warm start's (or the first) validation: the first reference
        if c.val_drop_ratio is not None and best > 0:
            hit = self._drop_edge.feed(v < c.val_drop_ratio * best, step, v, best)
            if hit:
                s, val, ref = hit
                out.append(
                    Signal(
                        "val_success_drop",
                        s,
                        val,
                        ref,
                        f"validation success {_fmt(val)} from step {s} stayed below {c.val_drop_ratio} x the "
                        f"best validation before it, {_fmt(ref)}, for {c.val_drop_checks} validations",
                    )
                )
        return out


def _by_step(history: Mapping[str, Iterable[tuple[int, float]]]) -> list[tuple[int, dict[str, float]]]:
    """Regroup per-key series into per-step metric dicts, in step order."""
    steps: dict[int, dict[str, float]] = {}
    for key, pts in history.items():
        for s, v in pts:
            steps.setdefault(int(s), {})[key] = float(v)
    return sorted(steps.items())


def detect(
    history: Mapping[str, Iterable[tuple[int, float]]], cfg: MonitorConfig | None = None
) -> list[Signal]:
    """Replay whole metric series (``{key: [(step, value), ...]}``, e.g. ``Tracker.history()``)
    through a fresh monitor; returns every signal, as incremental ``update`` calls would."""
    mon = EchoTrapMonitor(cfg)
    for step, metrics in _by_step(history):
        mon.update(step, metrics)
    return list(mon.signals)
