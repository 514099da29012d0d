"""The paper-style curves (RAGEN figures 5, 6 and 11), drawn for one run and for a sweep's groups.

One drawing convention for both: success is drawn raw; training statistics (in-group reward std,
entropy, gradient norm, response length) as an EMA over their faint raw values, as in the paper's
appendix B.3. Everything renders on matplotlib's Agg canvas directly: no pyplot, no global backend.
Callers pass metric histories with MLflow's key names (``ragen_core.tracking.keys.metric_key``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: A metric series: (iteration, value) pairs sorted by iteration.
Series = Sequence[tuple[int, float]]

EMA_WEIGHT = 0.6
#: series shorter than this are drawn raw, with markers (an EMA over 3 points says nothing)
MIN_SMOOTHED = 4

_SUCCESS_RE = re.compile(r"^(val-env|train)/([^/]+)/success$")
#: (file stem, title, metric keys) of a run's training-statistics panels
RUN_PANELS: list[tuple[str, str, list[str]]] = [
    ("in_group_std", "In-group reward std", ["rollout/in_group_std", "rollout/chosen_in_group_std"]),
    ("entropy", "Entropy", ["actor/entropy"]),
    ("grad_norm", "Gradient norm (pre-clip)", ["actor/grad_norm", "critic/grad_norm"]),
    ("response_length", "Response length (tokens)", ["response_length/mean"]),
]


def ema(values: Sequence[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Exponential moving average: ``s_0 = v_0``, ``s_t = weight * s_(t-1) + (1 - weight) * v_t``."""
    out: list[float] = []
    acc: float | None = None
    for v in values:
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return out


def _line(
    ax: Any, pts: Series, color: str, label: str | None, smooth: bool, spread: Sequence[float] | None = None
) -> None:
    """One curve: raw, or an EMA over the faint raw values; ``spread`` shades mean +- std."""
    xs = [s for s, _ in pts]
    ys = [v for _, v in pts]
    if smooth and len(pts) >= MIN_SMOOTHED:
        ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
        ax.plot(xs, ema(ys), color=color, linewidth=1.8, label=label)
    else:
        ax.plot(
            xs,
            ys,
            color=color,
            marker="o" if len(pts) < 30 else None,
            markersize=3,
            linewidth=1.5,
            label=label,
        )
    if spread is not None and any(spread):
        ax.fill_between(
            xs,
            [y - s for y, s in zip(ys, spread, strict=True)],
            [y + s for y, s in zip(ys, spread, strict=True)],
            color=color,
            alpha=0.12,
        )


def _finish(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _draw(
    ax: Any,
    series: Mapping[str, Series],
    markers: Mapping[str, int],
    smooth: bool = True,
    label_markers: bool = True,
) -> None:
    for i, (label, pts) in enumerate(sorted(series.items())):
        _line(ax, pts, f"C{i % 10}", label, smooth)
    for j, (name, step) in enumerate(sorted(markers.items(), key=lambda kv: kv[1])):
        ax.axvline(
            step,
            color="k",
            linestyle=("--", ":", "-.")[j % 3],
            linewidth=1,
            label=f"{name} @ {step}" if label_markers else None,
        )
    _finish(ax)


class _Pngs:
    """Figures saved into one folder, in the order written."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.written: list[Path] = []

    def figure(self, figsize: tuple[float, float]) -> Any:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(fig)
        return fig

    def grid(self, n: int) -> tuple[Any, int, int]:
        """A figure for ``n`` panels, at most 3 per row."""
        ncol = min(3, n)
        nrow = math.ceil(n / ncol)
        return self.figure((5 * ncol, 3.6 * nrow)), nrow, ncol

    def save(self, fig: Any, name: str, dpi: int) -> None:
        path = self.out / name
        fig.savefig(path, dpi=dpi)
        self.written.append(path)


def render_plots(
    history: Mapping[str, Series],
    out_dir: str | os.PathLike[str],
    markers: Mapping[str, int] | None = None,
    title: str | None = None,
) -> list[Path]:
    """One run's curves from its metric history, as PNG files in ``out_dir``: ``success.png`` (per env
    tag, validation and training), ``in_group_std.png``, ``entropy.png``, ``grad_norm.png``,
    ``response_length.png`` and ``overview.png`` (all panels). ``markers`` (name -> step) draw
    vertical lines, e.g. Echo-Trap signal onsets. Panels without data are left out."""
    markers = dict(markers or {})
    panels = _run_panels({k: v for k, v in history.items() if v})
    pngs = _Pngs(out_dir)
    success = [p for p in panels if p[0].startswith("success_")]
    if success:
        fig = pngs.figure((6 * len(success), 4))
        for i, (_, label, ser) in enumerate(success):
            ax = fig.add_subplot(1, len(success), i + 1)
            _draw(ax, ser, markers, smooth=False, label_markers=i == 0)
            ax.set_title(label)
            ax.set_ylabel("success rate")
        if title:
            fig.suptitle(title)
        pngs.save(fig, "success.png", dpi=110)
    for stem, label, ser in panels:
        if stem.startswith("success_"):
            continue
        fig = pngs.figure((6, 4))
        ax = fig.add_subplot(1, 1, 1)
        _draw(ax, ser, markers)
        ax.set_title(label if not title else f"{title}: {label}")
        pngs.save(fig, f"{stem}.png", dpi=110)
    if panels:
        fig, nrow, ncol = pngs.grid(len(panels))
        for i, (stem, label, ser) in enumerate(panels):
            ax = fig.add_subplot(nrow, ncol, i + 1)
            _draw(ax, ser, markers, smooth=not stem.startswith("success_"), label_markers=i == 0)
            ax.set_title(label)
        if title:
            fig.suptitle(title)
        pngs.save(fig, "overview.png", dpi=110)
    return pngs.written


def _run_panels(hist: Mapping[str, Series]) -> list[tuple[str, str, dict[str, Series]]]:
    """``(file stem, title, {legend label: points})`` of each panel with data: success per env tag
    (validation, then training; over the tags where a run sent no tag's own), then ``RUN_PANELS``."""
    panels: list[tuple[str, str, dict[str, Series]]] = []
    for split, label in (("val-env", "Validation success"), ("train", "Training success")):
        ser = {
            m.group(2): pts for k, pts in hist.items() if (m := _SUCCESS_RE.match(k)) and m.group(1) == split
        }
        if not ser and f"{split}/success" in hist:  # a run that logs the core metrics: over the tags only
            ser = {"all tags": hist[f"{split}/success"]}
        if ser:
            panels.append((f"success_{split}", label, ser))
    for stem, label, keys in RUN_PANELS:
        ser = {k: hist[k] for k in keys if k in hist}
        if ser:
            panels.append((stem, label, ser))
    return panels


#: one group's curves: (legend label, {key: [(step, mean, std, n), ...]})
GroupCurves = tuple[str, Mapping[str, Sequence[tuple[int, float, float, int]]]]


def render_group_curves(
    groups: Sequence[GroupCurves],
    panels: Sequence[tuple[str, str, str, bool]],
    out_dir: str | os.PathLike[str],
    title: str,
) -> list[Path]:
    """Overlaid mean curves of several groups (e.g. a sweep's configurations over their seeds), the
    std over seeds shaded: one PNG per panel and ``overview.png`` with all of them. ``panels`` are
    ``(metric key, panel title, file stem, smooth)``; panels no group has data for are left out."""
    panels = [p for p in panels if any(p[0] in curves for _, curves in groups)]

    def panel(ax: Any, key: str, smooth: bool) -> None:
        for i, (label, curves) in enumerate(groups):
            pts = curves.get(key)
            if pts:
                _line(
                    ax, [(p[0], p[1]) for p in pts], f"C{i % 10}", label, smooth, spread=[p[2] for p in pts]
                )
        _finish(ax)

    pngs = _Pngs(out_dir)
    for key, label, stem, smooth in panels:
        fig = pngs.figure((6, 4))
        ax = fig.add_subplot(1, 1, 1)
        panel(ax, key, smooth)
        ax.set_title(f"{title}: {label}", fontsize=9)
        pngs.save(fig, f"{stem}.png", dpi=100)
    if panels:
        fig, nrow, ncol = pngs.grid(len(panels))
        for i, (key, label, _, smooth) in enumerate(panels):
            ax = fig.add_subplot(nrow, ncol, i + 1)
            panel(ax, key, smooth)
            ax.set_title(label, fontsize=9)
        fig.suptitle(f"sweep {title}")
        pngs.save(fig, "overview.png", dpi=90)
    return pngs.written
