"""The rollout filter's record of one iteration, ``iter_K/filter.json``: which rows it kept and, per
group, what it saw and what it decided.

The learner, a rerun of the learn stage, ``ragen show`` and the logging need only ``kept_rows``; a
researcher asking why a group was dropped needs the group's statistics beside the decision, so the
record holds both (docs/architecture.md, "Run directory")::

    {"kept_rows": [row numbers kept],
     "metrics": {"rollout/...": value},
     "groups": [{"group_id": G, "env_tag": TAG, "size": N, "score_mean": M, "score_std": S,
                 "filter_value": V, "kept": true}, ...]}

Scores are the members' ``score`` (reward + format penalty: what the filter ranks, RAGEN's
"in-group reward"); ``score_std`` is the unbiased std (0 for a group of one, as the filter's logged
statistics count it); ``filter_value`` the group's ``rollout.filter.metric`` (None where the metric
is undefined, e.g. a std of one member). Groups are listed in order of first appearance, the
filter's numbering. Records written before ``groups`` existed are read by recomputing the statistics
from the rollouts (``filter_value`` then None): this module is the one place that knows the format.

Nothing heavy is imported (no torch): the logging process and ``ragen show`` read records too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import pyarrow as pa

T = TypeVar("T")


@dataclass(frozen=True)
class GroupDecision:
    """What the filter saw of one group and whether it kept it."""

    group_id: int
    env_tag: str
    size: int
    score_mean: float
    score_std: float
    filter_value: float | None
    kept: bool


def group_decisions(
    table: pa.Table, kept_rows: Iterable[int], filter_values: Sequence[float] | None = None
) -> list[GroupDecision]:
    """The groups of a rollouts ``table`` (columns ``group_id``, ``env_tag``, ``score``) in order of
    first appearance, each kept when any of its rows is in ``kept_rows`` (the filter keeps whole
    groups); ``filter_values``: the filter metric per group in that order (NaN: undefined)."""
    kept = set(kept_rows)
    scores: dict[int, list[float]] = {}
    tags: dict[int, str] = {}
    kept_groups: set[int] = set()
    columns = (table.column(c).to_pylist() for c in ("group_id", "env_tag", "score"))
    for i, (g, tag, s) in enumerate(zip(*columns, strict=True)):
        scores.setdefault(int(g), []).append(float(s))
        tags.setdefault(int(g), str(tag))
        if i in kept:
            kept_groups.add(int(g))
    if filter_values is not None and len(filter_values) != len(scores):
        raise ValueError(f"{len(filter_values)} filter values for {len(scores)} groups")
    out = []
    for n, (g, v) in enumerate(scores.items()):
        value = float(filter_values[n]) if filter_values is not None else math.nan
        out.append(
            GroupDecision(
                group_id=g,
                env_tag=tags[g],
                size=len(v),
                score_mean=statistics.fmean(v),
                score_std=statistics.stdev(v) if len(v) > 1 else 0.0,
                filter_value=None if math.isnan(value) else value,
                kept=g in kept_groups,
            )
        )
    return out


def to_json(
    kept_rows: Sequence[int], metrics: Mapping[str, float], groups: Sequence[GroupDecision]
) -> dict[str, Any]:
    """The record as written to ``filter.json``."""
    return {"kept_rows": list(kept_rows), "metrics": dict(metrics), "groups": [asdict(g) for g in groups]}


def kept_rows_of(record: Mapping[str, Any]) -> list[int]:
    """The kept row numbers of a record (every version has them)."""
    return [int(i) for i in record["kept_rows"]]


def in_turn(kept: Sequence[T], dropped: Sequence[T]) -> list[T]:
    """``kept[0], dropped[0], kept[1], dropped[1], ...``, the longer one's rest at the end: how the
    samples people read (traces, transcript pages) take both sides of the filter's decision, so a
    sample cut short still shows both."""
    n = min(len(kept), len(dropped))
    return [x for pair in zip(kept[:n], dropped[:n], strict=True) for x in pair] + [*kept[n:], *dropped[n:]]


def groups_of(record: Mapping[str, Any], table: pa.Table) -> list[GroupDecision]:
    """The per-group decisions of a record of the rollouts ``table``; recomputed from the table and
    ``kept_rows`` for a record written before they were stored."""
    stored = record.get("groups")
    if stored is None:
        return group_decisions(table, kept_rows_of(record))
    return [GroupDecision(**g) for g in stored]
