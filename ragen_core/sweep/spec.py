"""The sweep file and its expansion into members: what a sweep runs, checked before anything runs.

A sweep file (YAML, ``sweeps/``) names a base run config and what varies::

    name: filter-ratio                       # names the MLflow parent run and the state folder
    base: configs/frozenlake-tiny.yaml       # a run config (relative to the working directory,
                                             # else to the sweep file)
    overrides: [trainer.iterations=10]       # applied to every member
    grid:                                    # cartesian product (one member per combination)
      rollout.filter.value: [0.25, 0.5, 1.0]
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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ragen_core.safe_yaml import AliasBombError, safe_load

if TYPE_CHECKING:  # pragma: no cover
    from ragen_core.config import RagenConfig

#: the report's metrics when the sweep file names none: the aggregate and each env tag's success
DEFAULT_COMPARE = ["val-env/success", "val-env/*/success"]

_SLUG_BAD = re.compile(r"[^A-Za-z0-9._=,+-]+")


class SweepError(ValueError):
    """A sweep file that cannot run as a whole (the message names the field and the fix)."""


def slug(text: str) -> str:
    """A name safe in run directories and MLflow run names."""
    return _SLUG_BAD.sub("_", str(text)).strip("_") or "_"


def _value_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


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
        from ragen_core.run.run_dir import to_run_name

        return to_run_name(f"{sweep.name}.{self.key}") or "member"


def load_sweep(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and check a sweep file; ``base`` is resolved (working directory first, then the
    sweep file's folder and its parents) and must exist."""
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {p} not found")
    try:
        data = safe_load(p.read_text()) or {}
    except AliasBombError as exc:
        raise SweepError(f"sweep file {p}: {exc}") from None
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
    others), both by member key. One impossible member never stops the others. A member that would not
    send a metric the report compares (``tracking.metrics: core``) is one of the others."""
    from ragen_core.config import load_config

    configs: dict[str, RagenConfig] = {}
    errors: dict[str, str] = {}
    for m in members:
        try:
            cfg = load_config(sweep.base, m.overrides)
        except Exception as exc:  # ConfigError, or anything an override can break
            errors[m.key] = str(exc) if str(exc) else type(exc).__name__
            continue
        unsent = unsent_compare_keys(sweep.compare, cfg)
        if unsent:
            errors[m.key] = (
                f"compare: {', '.join(unsent)} not sent to MLflow with tracking.metrics=core, and the report "
                "reads MLflow: add tracking.metrics=all to the sweep's base config (or the member's "
                "overrides), or compare core metrics (ragen_core.tracking.keys.CORE_METRICS)"
            )
        else:
            configs[m.key] = cfg
    return configs, errors


def unsent_compare_keys(compare: Iterable[str], cfg: RagenConfig) -> list[str]:
    """The metric names of ``compare`` (not its globs, which may match core metrics) that a run of
    ``cfg`` does not send to MLflow."""
    from ragen_core.tracking.keys import is_core_metric

    if cfg.tracking.metrics == "all":
        return []
    extra = cfg.monitor.metric_keys()
    return [k for k in compare if not any(c in k for c in "*?[") and not is_core_metric(k, extra)]


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
