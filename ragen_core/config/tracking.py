"""The ``tracking`` section of a run's config (where and what a run logs to MLflow), the URI it
resolves to, and the config as flat MLflow params. Plain pydantic, so the config loads without MLflow
or torch; ``ragen_core.tracking`` does the logging."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BackgroundMode = Literal["process", "thread", "off"]
MetricsLevel = Literal["core", "all"]


class TrackingConfig(BaseModel):
    """Where and what a run logs to MLflow."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else sqlite:///<state_dir>/mlflow.db "
        "with artifacts in <state_dir>/mlartifacts",
    )
    experiment: str = Field(default="ragen-flow", min_length=1, description="MLflow experiment name")
    log_artifacts: bool = Field(
        default=True,
        description="upload artifacts (files, transcripts, plots); False: metrics/params/tags only",
    )
    transcripts_per_iteration: int = Field(
        default=4, ge=0, description="sample transcripts kept per iteration"
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0.0, description="how long to wait for a remote tracking server before failing"
    )
    traces_per_tag: int = Field(
        default=4,
        ge=0,
        description="train episodes logged as MLflow traces per env tag and iteration (the run's Traces "
        "tab: one chat span per turn, score/success/filter decision as feedback): half from groups the "
        "filter kept, half from groups it dropped, two members of each group side by side; 0: none",
    )
    max_traces_per_step: int = Field(
        default=64,
        ge=0,
        description="at most this many episode traces per step and file; the final evaluation traces every "
        "validation episode up to it; 0: no traces at all",
    )
    system_metrics: bool = Field(
        default=True,
        description="log the machine's CPU, memory, disk, network (and GPU) use as system/* metrics every "
        "10 s while the run trains (MLflow's System metrics tab)",
    )
    background: BackgroundMode = Field(
        default="process",
        description="where each iteration is logged while the next one trains: process (a logging process "
        "of its own, off the training loop's interpreter lock), thread (a thread of the training "
        "process) or off (in the loop, before the next iteration). In order and flushed before the run "
        "ends; a failing store takes the tracker offline and training goes on, any other error stops "
        "the run at the next iteration. true / false (older configs) read as process / off",
    )

    metrics: MetricsLevel = Field(
        default="core",
        description="which of an iteration's metrics go to MLflow: core (about 15: validation success per "
        "tag, train success, score, the filter's kept share, in-group reward std, entropy, KL, gradient "
        "norm, response length, iteration time; ragen_core.tracking.keys.CORE_METRICS) or all (every "
        "metric, about 130). The run folder's metrics.json keeps every metric either way",
    )

    @field_validator("metrics", mode="before")
    @classmethod
    def _known_level(cls, v: Any) -> Any:
        if v not in ("core", "all"):
            raise ValueError(
                "no such level: use core (the key curves, the default) or all (every metric of an "
                "iteration), e.g. --set tracking.metrics=all"
            )
        return v

    @field_validator("tracking_uri")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        problem = uri_scheme_problem(v) if v else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("background", mode="before")
    @classmethod
    def _background_bool(cls, v: Any) -> Any:
        # Before 2026-12-02 the key was a bool (true: a thread); true now means the default.
        return {True: "process", False: "off"}.get(v, v) if isinstance(v, bool) else v


#: The URI schemes of MLflow's tracking stores (``postgresql+psycopg2``: a database with its driver);
#: no scheme is a local folder (a file store).
TRACKING_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")


def uri_scheme_problem(uri: str) -> str | None:
    """Why MLflow has no tracking store for ``uri``'s scheme (one line, with the fix), else None: an
    unknown scheme otherwise fails only after the model has loaded, deep in MLflow's store registry."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    if not scheme or scheme.split("+", 1)[0] in TRACKING_SCHEMES:
        return None
    return (
        f"tracking URI {uri!r}: MLflow has no tracking store for the scheme {scheme!r}; use one of "
        f"{', '.join(s + '://' for s in TRACKING_SCHEMES)} (or leave tracking.tracking_uri and "
        "MLFLOW_TRACKING_URI unset for the local store in the state folder)"
    )


def resolve_tracking_uri(cfg: TrackingConfig, state_dir: str | os.PathLike[str]) -> str:
    """The config's URI, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<abs state_dir>/mlflow.db``."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path(state_dir).resolve() / 'mlflow.db').as_posix()}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH[?options]`` tracking URI; None for another scheme or
    an in-memory store."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(db) if db and db != ":memory:" else None


def _param_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, Path):
        return v.as_posix()
    try:
        return json.dumps(v, sort_keys=True, default=str)
    except (TypeError, ValueError):  # pragma: no cover - default=str makes this rare
        return str(v)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings -> dotted keys (``learner.algorithm.clip_high``); leaves as strings (strings
    as they are, everything else as JSON: ``true``, ``null``, ``[1, 2]``)."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten_params(v, key))
        else:
            out[key] = _param_value(v)
    return out
