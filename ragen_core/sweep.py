"""Sweeps: a grid of training runs (the paper's ablations), their state, and the comparison report.

A sweep file (YAML, ``sweeps/``) names a base run config and what varies::

    name: filter-ratio                       # names the MLflow parent run and the state folder
    base: configs/frozenlake-tiny.yaml       # a run config (relative to the working directory,
                                             # else to the sweep file)
    overrides: [trainer.iterations=10]       # applied to every member
    grid:                                    # cartesian product (one member per combination)
      rollout.filter_ratio: [0.25, 0.5, 1.0]
    members:                                 # and/or named variants (crossed with the grid)
      - {name: ppo, overrides: [learner.algorithm.adv_estimator=gae]}
      - {name: grpo, overrides: [learner.algorithm.adv_estimator=grpo]}
    seeds: [0, 1, 2]                         # every variant once per seed
    seed_keys: [trainer.seed]                # the config keys a seed sets
    concurrency: 1                           # members trained at once
    compare: [val-env/success, val-env/*/success]   # metrics of the report (globs allowed)

``expand`` turns it into ``Member``\\ s (members x grid x seeds, in that order). Each member's
overrides are: the sweep's ``overrides``, then the member's, then the grid point's, then the seed
keys (later ones win). A member's *group* (``Member.name``) is everything but the seed, so the
report averages a group over its seeds. Keys (``<name>-s<seed>``) depend only on the sweep file,
so a re-run finds its members again.

The report (``build_report``) is built from MLflow alone: the parent run's child runs (tag
``mlflow.parentRunId``), their tags (``ragen.sweep_member``, ``ragen.sweep_group``, ``ragen.seed``,
``ragen.sweep_error``), status, start/end times and metric histories. No run directory is read,
so ``ragen sweep report PARENT_RUN_ID`` works on any machine that sees the tracking store.

No MLflow import here (docs/architecture.md, "Layers"): the store is reached through ``ragen_core.tracking``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ragen_core.tracking import ITERATION_KEY, PARENT_TAG

if TYPE_CHECKING:  # pragma: no cover
    from ragen_core.config import RagenConfig
    from ragen_core.monitor import MonitorConfig
    from ragen_core.tracking import Tracker

# MLflow tags of a sweep's runs.
SWEEP_TAG = "ragen.sweep"  # parent and children: the sweep's name
SWEEP_HASH_TAG = "ragen.sweep_hash"  # parent and children: the definition's digest
MEMBER_TAG = "ragen.sweep_member"  # child: the member key
GROUP_TAG = "ragen.sweep_group"  # child: the member's group (name without the seed)
SEED_TAG = "ragen.seed"  # child: the seed
INDEX_TAG = "ragen.sweep_index"  # child: position in the expansion (report order)
OVERRIDES_TAG = "ragen.sweep_overrides"  # child: the member's overrides (JSON list)
ERROR_TAG = "ragen.sweep_error"  # child: why the member failed
ROLE_TAG = "ragen.sweep_role"  # "parent" or "member"

DEFAULT_COMPARE = ["val-env/success", "val-env/*/success"]
CURVE_KEYS = ["rollout/in_group_std", "actor/entropy", "actor/grad_norm", "response_length/mean"]
TOKENS_KEY = "perf/total_num_tokens"

_SLUG_BAD = re.compile(r"[^A-Za-z0-9._=,+-]+")


class SweepError(ValueError):
    """A sweep file that cannot run as a whole (the message names the field and the fix)."""


def slug(text: str) -> str:
    """A name safe in run directories and MLflow run names."""
    return _SLUG_BAD.sub("_", str(text)).strip("_") or "_"


def _value_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


# ------------------------------------------------------------------------------------ definition
class MemberSpec(BaseModel):
    """A named variant: its overrides on top of the sweep's."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="variant name (the group name in the report)")
    overrides: list[str] = Field(default_factory=list, description="KEY=VALUE")


class SweepConfig(BaseModel):
    """A sweep file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="names the MLflow parent run and the state folder")
    description: str = Field(default="", description="what the sweep reproduces (shown in the report)")
    base: str = Field(min_length=1, description="base run config (YAML)")
    overrides: list[str] = Field(default_factory=list, description="KEY=VALUE applied to every member")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="KEY -> values (cartesian product)")
    members: list[MemberSpec] = Field(default_factory=list, description="named variants (crossed with grid)")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="one run per seed")
    seed_keys: list[str] = Field(
        default_factory=lambda: ["trainer.seed"],
        min_length=1,
        description="config keys a seed sets (e.g. also learner.seed, model.seed, sft.seed)",
    )
    concurrency: int = Field(default=1, ge=1, description="members trained at once")
    compare: list[str] = Field(
        default_factory=lambda: list(DEFAULT_COMPARE),
        description="metric keys (globs) compared in the report",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if slug(v) != v:
            raise ValueError(f"name {v!r} may only use letters, digits and . _ = , + - (e.g. {slug(v)!r})")
        return v

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in v.items():
            if "=" in key or not key.strip():
                raise ValueError(f"grid key {key!r} must be a dotted config key (values go in the list)")
            if not values:
                raise ValueError(f"grid.{key} has no values")
        return v

    @field_validator("seeds")
    @classmethod
    def _check_seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"seeds must be distinct, got {v}")
        return v

    @model_validator(mode="after")
    def _check_members(self) -> SweepConfig:
        names = [m.name for m in self.members]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"member names must be distinct; repeated: {dup}")
        return self


@dataclass(frozen=True)
class Member:
    """One training run of a sweep: ``name`` is its group (the variant), ``key`` adds the seed."""

    key: str
    name: str
    seed: int
    overrides: tuple[str, ...]
    index: int = 0
    own_overrides: tuple[str, ...] = field(default=(), compare=False)  # member + grid part only

    @property
    def group(self) -> str:
        return self.name

    def run_name(self, sweep: SweepConfig) -> str:
        """Prefix of the member's run directory / run id (a valid run name: ``=`` and ``,`` of the key
        become ``-``; the run id's hash and random suffix keep it unique)."""
        from ragen_core.run_dir import to_run_name

        return to_run_name(f"{sweep.name}.{self.key}") or "member"


def load_sweep(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and check a sweep file; ``base`` is resolved (working directory first, then the
    sweep file's folder and its parents) and must exist."""
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {p} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SweepError(f"sweep file {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {p} must hold a mapping at the top level")
    try:
        sweep = SweepConfig.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(map(str, e['loc'])) or '(sweep)'}: {str(e['msg']).removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
        raise SweepError(f"invalid sweep file {p}:\n  " + "\n  ".join(lines)) from None
    base = Path(sweep.base)
    if not base.is_file() and not base.is_absolute():
        for folder in [p.parent, *p.parent.resolve().parents]:
            if (folder / sweep.base).is_file():
                base = folder / sweep.base
                break
    if not base.is_file():
        raise SweepError(
            f"sweep file {p}: base config {sweep.base} not found (relative to the working "
            f"directory or to {p.parent})"
        )
    return sweep.model_copy(update={"base": str(base)})


def _grid_labels(keys: Sequence[str]) -> dict[str, str]:
    """Short labels of grid keys: the last dotted part, unless two keys share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (lbl if last.count(lbl) == 1 else k) for k, lbl in zip(keys, last, strict=True)}


def expand(sweep: SweepConfig) -> list[Member]:
    """members x grid x seeds, in that order, with stable keys ``<name>-s<seed>``."""
    variants = [(m.name, list(m.overrides)) for m in sweep.members] or [("", [])]
    keys = list(sweep.grid)
    labels = _grid_labels(keys)
    points = list(itertools.product(*(sweep.grid[k] for k in keys))) if keys else [()]
    out: list[Member] = []
    seen: dict[str, str] = {}
    for vname, vover in variants:
        for point in points:
            grid_over = [f"{k}={_value_text(v)}" for k, v in zip(keys, point, strict=True)]
            grid_name = ",".join(f"{labels[k]}={_value_text(v)}" for k, v in zip(keys, point, strict=True))
            name = slug(",".join(x for x in (vname, grid_name) if x) or "base")
            for seed in sweep.seeds:
                key = f"{name}-s{seed}"
                if key in seen:
                    raise SweepError(
                        f"sweep {sweep.name}: two members expand to the key {key!r}; "
                        "rename a member or change the grid values"
                    )
                seen[key] = name
                seed_over = [f"{k}={seed}" for k in sweep.seed_keys]
                own = (*vover, *grid_over)
                out.append(
                    Member(
                        key=key,
                        name=name,
                        seed=seed,
                        overrides=(*sweep.overrides, *own, *seed_over),
                        index=len(out),
                        own_overrides=own,
                    )
                )
    return out


def validate_members(
    sweep: SweepConfig, members: Iterable[Member]
) -> tuple[dict[str, RagenConfig], dict[str, str]]:
    """Load every member's config before anything runs: (configs of the valid ones, errors of the
    others), both by member key. One impossible member never stops the others."""
    from ragen_core.config import load_config

    configs: dict[str, RagenConfig] = {}
    errors: dict[str, str] = {}
    for m in members:
        try:
            configs[m.key] = load_config(sweep.base, m.overrides)
        except Exception as exc:  # ConfigError, or anything an override can break
            errors[m.key] = str(exc) if str(exc) else type(exc).__name__
    return configs, errors


def sweep_hash(sweep: SweepConfig) -> str:
    """Digest of what the members' results depend on: the base config's text and the definition
    (not ``concurrency``, ``compare`` or ``description``). A changed definition is a new sweep."""
    base_text = Path(sweep.base).read_text() if Path(sweep.base).is_file() else sweep.base
    blob = json.dumps(
        {
            "base": base_text,
            **sweep.model_dump(
                mode="json", include={"name", "overrides", "grid", "members", "seeds", "seed_keys"}
            ),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


# ------------------------------------------------------------------------------------ state
MemberStatus = Literal["pending", "running", "finished", "failed"]


class MemberState(BaseModel):
    """What the sweep knows of one member (``state.json``)."""

    status: MemberStatus = "pending"
    run_id: str | None = None  # ragen run id
    run_dir: str | None = None
    mlflow_run_id: str | None = None
    attempts: int = 0
    error: str | None = None
    last_iteration: int | None = None
    updated: float = Field(default_factory=time.time)


class SweepState(BaseModel):
    """``<state>/sweeps/<name>-<hash>/state.json``: the parent run and each member's run."""

    name: str
    hash: str
    sweep_file: str
    parent_run_id: str | None = None
    members: dict[str, MemberState] = Field(default_factory=dict)

    @staticmethod
    def folder(state_dir: str | os.PathLike[str], sweep: SweepConfig) -> Path:
        return Path(state_dir) / "sweeps" / f"{sweep.name}-{sweep_hash(sweep)}"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SweepState | None:
        p = Path(path)
        return cls.model_validate_json(p.read_text()) if p.is_file() else None

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, p)


# ------------------------------------------------------------------------------------ report
class MetricSummary(BaseModel):
    final: float
    final_step: int
    peak: float
    peak_step: int


class MemberResult(BaseModel):
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
    def to_markdown(self, plots: Sequence[str] = ()) -> str:
        return _markdown(self, plots)

    def write(self, out_dir: str | os.PathLike[str]) -> list[Path]:
        """``report.json``, ``report.md`` and the PNG curves into ``out_dir``; returns the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pngs = render_curves(self, out)
        (out / "report.json").write_text(self.model_dump_json(indent=1))
        (out / "report.md").write_text(self.to_markdown([p.name for p in pngs]))
        return [out / "report.md", out / "report.json", *pngs]


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _stat(s: Stat | None, digits: int = 3) -> str:
    return "-" if s is None else s.text(digits)


def _short(key: str) -> str:
    return key.removeprefix("val-env/")


def _markdown(r: Report, plots: Sequence[str]) -> str:
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
    # groups
    lines += ["## Groups (mean ± std over seeds)", ""]
    head = ["group", "seeds ok/all"]
    for k in keys:
        head += [f"{_short(k)} final", f"{_short(k)} peak", "peak iter"]
    head += ["collapsed", "collapse iter", "wall s", "tokens"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in r.groups:
        row = [g.name, f"{g.n_finished}/{len(g.members)}"]
        for k in keys:
            row += [_stat(g.final.get(k)), _stat(g.peak.get(k)), _stat(g.peak_step.get(k), 1)]
        row += [
            f"{g.collapsed}/{g.n_finished}",
            _stat(g.collapse_step, 1),
            _stat(g.wall_s, 0),
            _stat(g.tokens, 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
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
        row += [sig, _fmt(m.wall_s, 0), _fmt(m.tokens, 0), f"`{m.mlflow_run_id}`"]
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
        lines += [f"![{p}]({p})" for p in plots]
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


def _monitor_from_params(params: Mapping[str, str], fallback: MonitorConfig | None) -> MonitorConfig:
    """The child's own monitor thresholds (its ``monitor.*`` params), else ``fallback`` / defaults."""
    from ragen_core.monitor import MonitorConfig

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
    from ragen_core.tracking import metric_key

    avail = set(available)
    out: list[str] = []
    for pat in patterns:
        p = metric_key(pat) if not any(c in pat for c in "*?[") else pat
        hits = [p] if p in avail else sorted(k for k in avail if fnmatch.fnmatchcase(k, p))
        out += [k for k in hits if k not in out]
    return out


def _tracker_for(source: str | Tracker) -> Tracker:
    from ragen_core.tracking import Tracker, TrackingConfig

    if isinstance(source, str):
        from ragen_core.state_folder import state_dir

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
    parent's ``ragen.sweep.compare`` tag, else ``DEFAULT_COMPARE``). ``monitor``: Echo-Trap
    thresholds (default: each child's own ``monitor.*`` params).
    """
    from ragen_core.monitor import detect

    tracker = _tracker_for(source)
    client = tracker.client
    parent = client.get_run(parent_run_id)
    ptags = parent.data.tags
    default = False
    if compare is None:
        raw = ptags.get("ragen.sweep.compare")
        compare = json.loads(raw) if raw else list(DEFAULT_COMPARE)
        default = list(compare) == DEFAULT_COMPARE
    runs = child_runs(tracker, parent_run_id)
    # one child per member key: the latest (a retried member reuses its run; this is a safety net)
    by_key: dict[str, Any] = {}
    for run in runs:
        by_key[run.data.tags.get(MEMBER_TAG, run.info.run_name or run.info.run_id)] = run

    histories: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for key, run in by_key.items():
        histories[key] = tracker.run_history(run.info.run_id) if run.data.metrics else {}
    keys = resolve_compare(compare, {k for h in histories.values() for k in h})
    if default and len(keys) == 2 and keys[0] == "val-env/success":
        keys = keys[1:]  # one env tag: the aggregate is the same series

    members: list[MemberResult] = []
    for key, run in by_key.items():
        tags, hist = run.data.tags, histories[key]
        seed_raw = tags.get(SEED_TAG)
        status = run.info.status
        sigs = detect(hist, _monitor_from_params(run.data.params, monitor)) if hist else []
        start, end = run.info.start_time, run.info.end_time
        iters = hist.get(ITERATION_KEY)
        tokens = hist.get(TOKENS_KEY)
        members.append(
            MemberResult(
                key=key,
                group=tags.get(GROUP_TAG, key),
                seed=int(seed_raw) if seed_raw not in (None, "", "None") else None,
                status=status,
                error=tags.get(ERROR_TAG) or (None if status != "FAILED" else "run failed (see its logs)"),
                mlflow_run_id=run.info.run_id,
                run_id=tags.get("ragen.run_id"),
                overrides=json.loads(tags[OVERRIDES_TAG]) if tags.get(OVERRIDES_TAG) else [],
                iterations=int(max(s for s, _ in iters)) if iters else None,
                metrics={k: s for k in keys if (s := summarize_series(hist.get(k, []))) is not None},
                collapse_step=min((s.step for s in sigs), default=None),
                signals=[f"{s.name}@{s.step}" for s in sorted(sigs, key=lambda s: (s.step, s.name))],
                wall_s=(end - start) / 1000.0 if start and end else None,
                tokens=float(sum(v for _, v in tokens)) if tokens else None,
            )
        )

    def order(m: MemberResult) -> tuple[float, str]:
        idx = by_key[m.key].data.tags.get(INDEX_TAG)
        return (float(idx) if idx is not None else math.inf, m.key)

    members.sort(key=order)
    groups: list[GroupResult] = []
    for gname in dict.fromkeys(m.group for m in members):
        ms = [m for m in members if m.group == gname]
        ok = [m for m in ms if m.status == "FINISHED"]
        collapsed = [m for m in ok if m.collapse_step is not None]
        g = GroupResult(
            name=gname,
            members=[m.key for m in ms],
            seeds=[m.seed for m in ms],
            n_finished=len(ok),
            n_failed=sum(m.status == "FAILED" for m in ms),
            final={k: Stat.of(m.metrics[k].final for m in ok if k in m.metrics) for k in keys},
            peak={k: Stat.of(m.metrics[k].peak for m in ok if k in m.metrics) for k in keys},
            peak_step={k: Stat.of(m.metrics[k].peak_step for m in ok if k in m.metrics) for k in keys},
            collapsed=len(collapsed),
            collapse_step=Stat.of(m.collapse_step for m in collapsed),
            wall_s=Stat.of(m.wall_s for m in ok),
            tokens=Stat.of(m.tokens for m in ok),
            curves=mean_curves([histories[m.key] for m in ok], [*keys, *CURVE_KEYS]),
        )
        groups.append(g)
    return Report(
        sweep=ptags.get(SWEEP_TAG, parent.info.run_name or ""),
        description=ptags.get("ragen.sweep.description", ""),
        parent_run_id=parent_run_id,
        tracking_uri=tracker.tracking_uri,
        compare=keys,
        members=members,
        groups=groups,
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
    """Overlaid group curves like the paper's figures 5-11 (``ragen_core.plotting``): one PNG per
    compare key (validation success, drawn raw) and per training statistic (an EMA over the faint raw
    mean), the std over seeds shaded, plus ``overview.png``."""
    from ragen_core.plotting import render_group_curves
    from ragen_core.tracking import metric_key

    def stem(key: str) -> str:
        return f"curve_{slug(metric_key(key).replace('/', '_'))}"

    panels = [
        (k, f"Validation success: {_short(k)}" if k.endswith("success") else k, stem(k), False)
        for k in report.compare
    ]
    panels += [(k, _TITLES[k], stem(k), True) for k in CURVE_KEYS if k not in report.compare]
    groups = [(f"{g.name} (n={g.n_finished})", g.curves) for g in report.groups]
    return render_group_curves(groups, panels, out_dir, report.sweep)
