"""The comparison report of a sweep: per member and per group (mean ± std over seeds), from MLflow alone.

``build_report`` reads the parent run's child runs (tag ``mlflow.parentRunId``), their tags
(``ragen_core.sweep.tags``), status, start/end times and metric histories. No run directory is read,
so ``ragen sweep report PARENT_RUN_ID`` works on any machine that sees the tracking store.
``Report.write`` turns it into ``report.md``, ``report.json`` and the curves, drawn by
``ragen_core.tracking.plotting`` like a single run's.

No MLflow import here (docs/architecture.md, "Layers"): the store is reached through ``ragen_core.tracking.tracker``.
"""

from __future__ import annotations

import fnmatch
import functools
import html
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from ragen_core.config.tracking import TrackingConfig
from ragen_core.monitor import MonitorConfig, detect
from ragen_core.state_folder import state_dir
from ragen_core.sweep.spec import DEFAULT_COMPARE, slug
from ragen_core.sweep.tags import (
    COMPARE_TAG,
    DESCRIPTION_TAG,
    ERROR_TAG,
    GROUP_TAG,
    INDEX_TAG,
    MEMBER_TAG,
    OVERRIDES_TAG,
    SEED_TAG,
    SWEEP_TAG,
)
from ragen_core.tracking.keys import DESCRIPTION_TAG as NOTE_TAG
from ragen_core.tracking.keys import metric_key, parse_steps
from ragen_core.tracking.links import artifact_url, ui_base
from ragen_core.tracking.plotting import render_group_curves
from ragen_core.tracking.tracker import ITERATION_KEY, LOGGED_STEPS_TAG, PARENT_TAG, Tracker

#: training statistics drawn for every group besides the compared metrics (the paper's figures)
CURVE_KEYS = ["rollout/in_group_std", "actor/entropy", "actor/grad_norm", "response_length/mean"]
TOKENS_KEY = "perf/total_num_tokens"


class MetricSummary(BaseModel):
    """One metric of one member: its last value and its best one, with their iterations."""

    final: float
    final_step: int
    peak: float
    peak_step: int


class MemberResult(BaseModel):
    """One member (child run) as the report shows it."""

    key: str
    group: str
    seed: int | None
    status: str  # MLflow status: FINISHED, FAILED, KILLED, RUNNING, SCHEDULED
    error: str | None = None
    mlflow_run_id: str
    run_id: str | None = None  # ragen run id
    overrides: list[str] = Field(default_factory=list)
    iterations: int | None = None
    metrics: dict[str, MetricSummary] = Field(default_factory=dict)
    collapse_step: int | None = None
    signals: list[str] = Field(default_factory=list)  # "name@step"
    wall_s: float | None = None
    tokens: float | None = None


class Stat(BaseModel):
    """Mean ± std of one number over a group's seeds."""

    mean: float
    std: float  # sample std (n-1) over seeds; 0 for one seed
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        xs = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not xs:
            return None
        return cls(mean=statistics.fmean(xs), std=statistics.stdev(xs) if len(xs) > 1 else 0.0, n=len(xs))

    def text(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}" if self.n > 1 else f"{self.mean:.{digits}f}"


class GroupResult(BaseModel):
    """One group (a member without its seed): its numbers over the finished seeds."""

    name: str
    members: list[str]
    seeds: list[int | None]
    n_finished: int
    n_failed: int
    final: dict[str, Stat | None] = Field(default_factory=dict)
    peak: dict[str, Stat | None] = Field(default_factory=dict)
    peak_step: dict[str, Stat | None] = Field(default_factory=dict)
    collapsed: int = 0  # finished members with an Echo-Trap signal
    collapse_step: Stat | None = None  # over the collapsed ones
    wall_s: Stat | None = None
    tokens: Stat | None = None
    # metric -> [(step, mean, std, n)] over the group's finished members
    curves: dict[str, list[tuple[int, float, float, int]]] = Field(default_factory=dict)


class Report(BaseModel):
    """The whole comparison (``report.json``); ``write`` also renders ``report.md`` and the curves."""

    sweep: str
    description: str = ""
    parent_run_id: str
    tracking_uri: str
    generated: float = Field(default_factory=time.time)
    compare: list[str]
    members: list[MemberResult]
    groups: list[GroupResult]

    @property
    def failed(self) -> list[MemberResult]:
        return [m for m in self.members if m.status == "FAILED"]

    # ---------------------------------------------------------------- output
    def to_markdown(
        self,
        plots: Sequence[str] = (),
        image_url: Callable[[str], str] | None = None,
        run_url: Callable[[str], str | None] | None = None,
    ) -> str:
        """``report.md``; ``image_url``: where each curve is served (default: beside the file);
        ``run_url``: each member's MLflow run page (default: its id, unlinked)."""
        return _markdown(self, plots, image_url, run_url)

    def write(
        self, out_dir: str | os.PathLike[str], run_url: Callable[[str], str | None] | None = None
    ) -> list[Path]:
        """``report.json``, ``report.md``, the PNG curves and ``report.html`` (the same page with the
        curves inside it: MLflow's artifact view renders HTML, while it shows markdown as text) into
        ``out_dir``; returns the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pngs = render_curves(self, out)
        (out / "report.json").write_text(self.model_dump_json(indent=1))
        markdown = self.to_markdown([p.name for p in pngs], run_url=run_url)
        (out / "report.md").write_text(markdown)
        (out / "report.html").write_text(self.to_html(markdown, out))
        return [out / "report.md", out / "report.html", out / "report.json", *pngs]

    def to_html(self, markdown: str, folder: Path) -> str:
        """``markdown`` (the report's ``report.md``) as one self-contained HTML page, each curve it
        shows (a PNG in ``folder``) inlined as a data URI."""
        import base64

        from markdown_it import MarkdownIt

        def inline(m: re.Match[str]) -> str:
            png = folder / m[2]
            return f"![{m[1]}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})"

        markdown = re.sub(r"!\[([^\]]*)\]\(([^)/:]+\.png)\)", inline, markdown)
        body = MarkdownIt("commonmark").enable("table").render(markdown)
        return (
            f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep {html.escape(self.sweep)}</title>"
            f"<style>{_HTML_STYLE}</style></head><body>{body}</body></html>\n"
        )

    def summary_markdown(
        self, image_url: Callable[[str], str] | None = None, plots: Sequence[str] = ()
    ) -> str:
        """The parent run's description: what the sweep compared, its groups' table, and (``image_url``:
        where each curve ``plots`` is served) the curves."""
        lines = [f"**Sweep `{self.sweep}`**: {len(self.groups)} group(s), {len(self.members)} member(s)"]
        n_ok = sum(m.status == "FINISHED" for m in self.members)
        lines[0] += f" ({n_ok} finished, {len(self.failed)} failed)."
        if self.description:
            lines += ["", self.description.strip()]
        lines += ["", *_group_table(self), ""]
        if image_url is not None:
            lines += [f"![{p}]({image_url(p)})" for p in plots if p.startswith("curve_")]
        lines += ["", "The whole report (members, failures, every curve): the artifact `report/report.html`."]
        return "\n".join(lines)

    def summary_metrics(self) -> dict[str, float]:
        """The parent run's metrics: each group's mean final and peak of each compared metric over its
        finished seeds, ``final/<group>/<metric>`` and ``peak/<group>/<metric>`` (what MLflow's charts
        and runs table compare sweeps by)."""
        out: dict[str, float] = {}
        for g in self.groups:
            group = re.sub(r"[^\w.\- /]", "_", g.name)
            for k in self.compare:
                for kind, stats in (("final", g.final), ("peak", g.peak)):
                    stat = stats.get(k)
                    if stat is not None:
                        out[f"{kind}/{group}/{metric_key(k)}"] = stat.mean
        return out


_HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1200px;margin:1em auto;padding:0 1em}"
    "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em}"
    "img{max-width:100%}code{background:#f4f4f4}"
)


def publish_report(report: Report, tracker: Tracker, out: str | os.PathLike[str], log_artifacts: bool) -> str:
    """Write the report into ``out`` and put it where a researcher looks: the files under the parent
    run's artifacts (``report/``: ``report.html`` renders with its curves in MLflow's artifact view),
    the parent run's description (the groups' table and the compared curves) and metrics (each group's
    final and peak, :meth:`Report.summary_metrics`, at the step of the number of finished members, so a
    resumed sweep's later report adds a point). Returns the report as markdown whose images are served
    by MLflow's UI (for Prefect's artifact page, which cannot show local files)."""
    run_url = functools.cache(tracker.run_url)  # a store read per member, for the two pages that link them
    paths = report.write(out, run_url=run_url)
    plots = [p.name for p in paths if p.suffix == ".png"]
    image_url = None
    if log_artifacts:
        tracker.log_artifacts(out, "report")

        base = ui_base(tracker.tracking_uri, tracker.state_dir)

        def image_url(name: str) -> str:
            return artifact_url(base, report.parent_run_id, f"report/{name}")

    tracker.set_tags({NOTE_TAG: report.summary_markdown(image_url, plots)})
    metrics = report.summary_metrics()
    if metrics:
        tracker.log_iteration(sum(m.status == "FINISHED" for m in report.members), metrics)
    return report.to_markdown(plots, image_url, run_url)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _stat(s: Stat | None, digits: int = 3) -> str:
    return "-" if s is None else s.text(digits)


def _short(key: str) -> str:
    return key.removeprefix("val-env/")


def _group_table(r: Report) -> list[str]:
    """The groups' markdown table: each compared metric's final, peak and peak iteration, collapses,
    wall time and tokens (mean ± std over the finished seeds)."""
    head = ["group", "seeds ok/all"]
    for k in r.compare:
        head += [f"{_short(k)} final", f"{_short(k)} peak", "peak iter"]
    head += ["collapsed", "collapse iter", "wall s", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in r.groups:
        row = [g.name, f"{g.n_finished}/{len(g.members)}"]
        for k in r.compare:
            row += [_stat(g.final.get(k)), _stat(g.peak.get(k)), _stat(g.peak_step.get(k), 1)]
        row += [
            f"{g.collapsed}/{g.n_finished}",
            _stat(g.collapse_step, 1),
            _stat(g.wall_s, 0),
            _stat(g.tokens, 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _markdown(
    r: Report,
    plots: Sequence[str],
    image_url: Callable[[str], str] | None = None,
    run_url: Callable[[str], str | None] | None = None,
) -> str:
    """``report.md``: groups, members, failures, and the curves (``plots``: PNG names beside it)."""
    lines = [f"# Sweep `{r.sweep}`", ""]
    if r.description:
        lines += [r.description.strip(), ""]
    n_ok = sum(m.status == "FINISHED" for m in r.members)
    lines += [
        f"MLflow parent run `{r.parent_run_id}` ({r.tracking_uri}); {len(r.members)} member(s): "
        f"{n_ok} finished, {len(r.failed)} failed, {len(r.members) - n_ok - len(r.failed)} other. "
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.generated))}.",
        "",
    ]
    lines += [
        "Success: validation success rate (`val-env/...`), final = last evaluation, peak = best "
        "evaluation and its iteration. Collapse: first Echo-Trap signal (`ragen_core.monitor.detect` "
        "on the run's history). Groups: mean ± sample std over the finished seeds.",
        "",
    ]
    keys = r.compare
    lines += ["## Groups (mean ± std over seeds)", "", *_group_table(r), ""]
    # members
    lines += ["## Members", ""]
    head = ["member", "status", "seed", "iters"]
    for k in keys:
        head += [f"{_short(k)} final", f"{_short(k)} peak (iter)"]
    head += ["collapse iter (signals)", "wall s", "tokens", "MLflow run"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in r.members:
        row = [m.key, m.status, str(m.seed), str(m.iterations) if m.iterations is not None else "-"]
        for k in keys:
            s = m.metrics.get(k)
            row += [_fmt(s.final) if s else "-", f"{s.peak:.3f} ({s.peak_step})" if s else "-"]
        sig = f"{m.collapse_step} ({', '.join(m.signals)})" if m.collapse_step is not None else "-"
        link = run_url(m.mlflow_run_id) if run_url is not None else None
        run = f"[`{m.mlflow_run_id}`]({link})" if link else f"`{m.mlflow_run_id}`"
        row += [sig, _fmt(m.wall_s, 0), _fmt(m.tokens, 0), run]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if r.failed:
        lines += ["## Failed members", "", "| member | error |", "|---|---|"]
        for m in r.failed:
            err = (m.error or "(no error recorded)").replace("\n", " ").replace("|", "\\|")
            lines.append(f"| {m.key} | {err[:600]} |")
        lines.append("")
    if plots:
        lines += ["## Curves (mean over seeds per group; shaded: ± std)", ""]
        lines += [f"![{p}]({image_url(p) if image_url else p})" for p in plots]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- building from MLflow
def _parse_param(raw: str) -> Any:
    if raw == "None":
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def monitor_from_params(params: Mapping[str, str], fallback: MonitorConfig | None) -> MonitorConfig:
    """``fallback`` when given, else the child's own monitor thresholds (its ``monitor.*`` params),
    else the defaults: each member is judged by the thresholds it trained with."""
    if fallback is not None:
        return fallback
    values = {
        k.removeprefix("monitor."): _parse_param(v) for k, v in params.items() if k.startswith("monitor.")
    }
    try:
        return MonitorConfig.model_validate(values)
    except ValidationError:
        return MonitorConfig()


def summarize_series(points: Sequence[tuple[int, float]]) -> MetricSummary | None:
    """Final (last step) and peak (max; the first step that reaches it) of one series."""
    if not points:
        return None
    pts = sorted(points)
    peak_step, peak = pts[0]
    for s, v in pts:
        if v > peak:
            peak_step, peak = s, v
    return MetricSummary(final=pts[-1][1], final_step=pts[-1][0], peak=peak, peak_step=peak_step)


def resolve_compare(patterns: Sequence[str], available: Iterable[str]) -> list[str]:
    """Metric keys matching ``patterns`` (exact names first, in pattern order; globs sorted)."""
    avail = set(available)
    out: list[str] = []
    for pat in patterns:
        p = metric_key(pat) if not any(c in pat for c in "*?[") else pat
        hits = [p] if p in avail else sorted(k for k in avail if fnmatch.fnmatchcase(k, p))
        out += [k for k in hits if k not in out]
    return out


def _tracker_for(source: str | Tracker) -> Tracker:
    if isinstance(source, str):
        return Tracker(TrackingConfig(tracking_uri=source), state_dir())
    return source


def child_runs(tracker: Tracker, parent_run_id: str) -> list[Any]:
    """The parent's child runs (MLflow ``Run`` objects), oldest first."""
    client = tracker.client
    parent = client.get_run(parent_run_id)
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            break
    return sorted(runs, key=lambda r: r.info.start_time or 0)


def build_report(
    source: str | Tracker,
    parent_run_id: str,
    compare: Sequence[str] | None = None,
    monitor: MonitorConfig | None = None,
) -> Report:
    """The comparison report of a sweep, from MLflow alone (see the module docstring).

    ``source``: a tracking URI or a ``Tracker``. ``compare``: metric keys / globs (default: the
    sweep file's ``compare``, kept in the parent's ``COMPARE_TAG``, else ``DEFAULT_COMPARE``).
    ``monitor``: Echo-Trap thresholds (default: each child's own ``monitor.*`` params).
    """
    tracker = _tracker_for(source)
    parent = tracker.client.get_run(parent_run_id)
    ptags = parent.data.tags
    # one child per member key: the latest (a retried member reuses its run; this is a safety net)
    by_key: dict[str, Any] = {}
    for run in child_runs(tracker, parent_run_id):
        by_key[run.data.tags.get(MEMBER_TAG, run.info.run_name or run.info.run_id)] = run
    histories: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for key, run in by_key.items():
        histories[key] = tracker.run_history(run.info.run_id) if run.data.metrics else {}
    keys = _compare_keys(compare, ptags.get(COMPARE_TAG), {k for h in histories.values() for k in h})

    members = [_member_result(key, run, histories[key], keys, monitor) for key, run in by_key.items()]

    def order(m: MemberResult) -> tuple[float, str]:
        idx = by_key[m.key].data.tags.get(INDEX_TAG)
        return (float(idx) if idx is not None else math.inf, m.key)

    members.sort(key=order)
    groups = [
        _group_result(gname, [m for m in members if m.group == gname], histories, keys)
        for gname in dict.fromkeys(m.group for m in members)
    ]
    return Report(
        sweep=ptags.get(SWEEP_TAG, parent.info.run_name or ""),
        description=ptags.get(DESCRIPTION_TAG, ""),
        parent_run_id=parent_run_id,
        tracking_uri=tracker.tracking_uri,
        compare=keys,
        members=members,
        groups=groups,
    )


def _compare_keys(compare: Sequence[str] | None, tagged: str | None, available: set[str]) -> list[str]:
    """The metric keys to compare: ``compare``, else the sweep file's (``tagged``, the parent's
    ``COMPARE_TAG``), else ``DEFAULT_COMPARE``, resolved against the ``available`` keys."""
    default = False
    if compare is None:
        compare = json.loads(tagged) if tagged else list(DEFAULT_COMPARE)
        default = list(compare) == DEFAULT_COMPARE
    keys = resolve_compare(compare, available)
    if default and len(keys) == 2 and keys[0] == "val-env/success":
        keys = keys[1:]  # one env tag: the aggregate is the same series
    return keys


def _member_result(
    key: str,
    run: Any,
    hist: Mapping[str, list[tuple[int, float]]],
    keys: Sequence[str],
    monitor: MonitorConfig | None,
) -> MemberResult:
    """One member's row: its MLflow child ``run`` and metric history ``hist``."""
    tags = run.data.tags
    seed_raw = tags.get(SEED_TAG)
    status = run.info.status
    sigs = detect(hist, monitor_from_params(run.data.params, monitor)) if hist else []
    start, end = run.info.start_time, run.info.end_time
    # the steps the run marks as logged (older runs: their marker metric)
    iters = parse_steps(tags.get(LOGGED_STEPS_TAG, "")) | {s for s, _ in hist.get(ITERATION_KEY, [])}
    tokens = hist.get(TOKENS_KEY)
    return MemberResult(
        key=key,
        group=tags.get(GROUP_TAG, key),
        seed=int(seed_raw) if seed_raw not in (None, "", "None") else None,
        status=status,
        error=tags.get(ERROR_TAG) or (None if status != "FAILED" else "run failed (see its logs)"),
        mlflow_run_id=run.info.run_id,
        run_id=tags.get("ragen.run_id"),
        overrides=json.loads(tags[OVERRIDES_TAG]) if tags.get(OVERRIDES_TAG) else [],
        iterations=max(iters) if iters else None,
        metrics={k: s for k in keys if (s := summarize_series(hist.get(k, []))) is not None},
        collapse_step=min((s.step for s in sigs), default=None),
        signals=[f"{s.name}@{s.step}" for s in sorted(sigs, key=lambda s: (s.step, s.name))],
        wall_s=(end - start) / 1000.0 if start and end else None,
        tokens=float(sum(v for _, v in tokens)) if tokens else None,
    )


def _group_result(
    name: str,
    ms: Sequence[MemberResult],
    histories: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    keys: Sequence[str],
) -> GroupResult:
    """A group's row over its members ``ms``: mean ± std over the finished ones."""
    ok = [m for m in ms if m.status == "FINISHED"]
    collapsed = [m for m in ok if m.collapse_step is not None]

    def over_finished(field: str, key: str) -> Stat | None:
        return Stat.of(getattr(m.metrics[key], field) for m in ok if key in m.metrics)

    return GroupResult(
        name=name,
        members=[m.key for m in ms],
        seeds=[m.seed for m in ms],
        n_finished=len(ok),
        n_failed=sum(m.status == "FAILED" for m in ms),
        final={k: over_finished("final", k) for k in keys},
        peak={k: over_finished("peak", k) for k in keys},
        peak_step={k: over_finished("peak_step", k) for k in keys},
        collapsed=len(collapsed),
        collapse_step=Stat.of(m.collapse_step for m in collapsed),
        wall_s=Stat.of(m.wall_s for m in ok),
        tokens=Stat.of(m.tokens for m in ok),
        curves=mean_curves([histories[m.key] for m in ok], [*keys, *CURVE_KEYS]),
    )


def mean_curves(
    histories: Sequence[Mapping[str, Sequence[tuple[int, float]]]], keys: Sequence[str]
) -> dict[str, list[tuple[int, float, float, int]]]:
    """Per key: ``(step, mean, std, n)`` over the histories that have that step (std: sample, 0 for n=1)."""
    out: dict[str, list[tuple[int, float, float, int]]] = {}
    for key in keys:
        per_step: dict[int, list[float]] = {}
        for h in histories:
            for s, v in h.get(key, []):
                per_step.setdefault(int(s), []).append(float(v))
        if per_step:
            out[key] = [
                (s, statistics.fmean(vs), statistics.stdev(vs) if len(vs) > 1 else 0.0, len(vs))
                for s, vs in sorted(per_step.items())
            ]
    return out


# ---------------------------------------------------------------- plots
_TITLES = {
    "rollout/in_group_std": "In-group reward std (training rollouts)",
    "actor/entropy": "Entropy",
    "actor/grad_norm": "Gradient norm (pre-clip)",
    "response_length/mean": "Response length (tokens)",
}


def render_curves(report: Report, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Overlaid group curves like the paper's figures 5-11 (``ragen_core.tracking.plotting``): one PNG per
    compare key (validation success, drawn raw) and per training statistic (an EMA over the faint raw
    mean), the std over seeds shaded, plus ``overview.png``. Only the panels are chosen here: the
    drawing is ``ragen_core.tracking.plotting``'s, shared with a single run's plots."""

    def stem(key: str) -> str:
        return f"curve_{slug(metric_key(key).replace('/', '_'))}"

    panels = [
        (k, f"Validation success: {_short(k)}" if k.endswith("success") else k, stem(k), False)
        for k in report.compare
    ]
    panels += [(k, _TITLES[k], stem(k), True) for k in CURVE_KEYS if k not in report.compare]
    groups = [(f"{g.name} (n={g.n_finished})", g.curves) for g in report.groups]
    return render_group_curves(groups, panels, out_dir, report.sweep)
