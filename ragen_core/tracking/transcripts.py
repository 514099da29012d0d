"""Sample transcripts of an iteration, for people: rows for MLflow's transcripts table and one HTML page
per iteration (``transcripts/iter_XXXX.html``), where the conversation reads as it happened (line breaks
kept, long lines wrapped) and each episode says whether the filter kept its group and the group's
score statistics.

The sample takes one episode per group, kept and dropped groups in turn (each side in file order), so
a handful of rows shows different initial states (seeds) and both sides of the filter's decision
rather than one group's members or only the groups it kept.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from ragen_core.filter_record import GroupDecision, in_turn
from ragen_core.text_safety import printable
from ragen_core.tracking.rendering import filter_decision, outcome
from ragen_core.trajectory import from_table, read_table


def table_columns(rows: list[dict[str, Any]], step: int) -> dict[str, list[Any]]:
    """``rows`` as the columns of MLflow's transcripts table: a ``step`` column, then every key of the
    rows in first-seen order (nested values as JSON strings, missing ones None)."""
    cols: dict[str, list[Any]] = {"step": [step] * len(rows)}
    for k in dict.fromkeys(k for r in rows for k in r):
        cols[str(k)] = [
            v
            if isinstance(v, str | int | float | bool) or v is None
            else json.dumps(v, default=str, ensure_ascii=False)
            for v in (r.get(k) for r in rows)
        ]
    return cols


def transcript_rows(
    path: Path, n: int, groups: Sequence[GroupDecision] | None = None
) -> list[dict[str, Any]]:
    """Up to ``n`` episodes of a rollouts file, one per group (kept and dropped groups in turn, each
    side in file order), as rows: tag, seed, group, filter decision (``kept``/``dropped``; empty
    without a filter record, ``groups``), the group's score std, success, score, turns, actions, the
    conversation after the system prompt as text, and its messages."""
    table = read_table(path)  # only the rows shown are decoded: this runs every iteration
    by_id = {g.group_id: g for g in groups} if groups is not None else {}
    first: dict[int, int] = {}
    for i, g in enumerate(table.column("group_id").to_pylist()):
        first.setdefault(g, i)
    sides: dict[bool, list[int]] = {True: [], False: []}
    for g, i in first.items():
        sides[by_id[g].kept if g in by_id else True].append(i)
    order = in_turn(sides[True], sides[False])[:n]
    shown = dict(zip(order, from_table(table.take(pa.array(order, type=pa.int64()))), strict=True))
    rows = []
    for i in order:
        t = shown[i]
        group = by_id.get(t.group_id)
        rows.append(
            {
                "env_tag": t.env_tag,
                "seed": t.seed,
                "group_id": t.group_id,
                "filter": filter_decision(group.kept if group is not None else None),
                "group_score_std": group.score_std if group is not None else None,
                "success": t.success,
                "score": t.score,
                "turns": t.turn_count,
                "actions": t.actions,
                "transcript": "\n".join(f"<{m['role']}> {m['content']}" for m in t.messages[1:]),
                "messages": t.messages,
            }
        )
    return rows


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; max-width: 70em; }
.episode { border: 1px solid #ccc; border-radius: 6px; margin: 1em 0; padding: 0.5em 1em; }
.msg { margin: 0.4em 0; padding: 0.4em 0.6em; border-radius: 4px; white-space: pre-wrap; font-family: monospace; }
.system { background: #f4f4f4; } .user { background: #eef4ff; } .assistant { background: #effaef; }
.role { font-weight: bold; font-family: system-ui, sans-serif; }
.ok { color: #17692d; } .fail { color: #a11; } .dropped { color: #777; }
"""


def _safe(text: str) -> str:
    """Model text for the page: control characters shown escaped (a browser drops or mangles them,
    and a page saved and shown with ``cat`` must not drive the terminal), then HTML-escaped."""
    return html.escape(printable(text))


def to_html(rows: list[dict[str, Any]], title: str) -> str:
    """A self-contained HTML page of ``rows`` (:func:`transcript_rows`): every message verbatim."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{_safe(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_safe(title)}</h1>",
    ]
    for r in rows:
        result = f"<span class='{'ok' if r['success'] else 'fail'}'>{outcome(r['success'])}</span>"
        decision = {
            "kept": "kept by the filter",
            "dropped": "<span class='dropped'>dropped by the filter</span>",
        }.get(r["filter"])
        std = r.get("group_score_std")
        parts.append(
            "<div class='episode'><h2>"
            f"{_safe(str(r['env_tag']))}, seed {r['seed']}, group {r['group_id']}: {result}, "
            f"score {r['score']:+.3f}, {r['turns']} turn(s)"
            f"{f', {decision}' if decision else ''}{f' (group score std {std:.3f})' if std is not None else ''}"
            "</h2>"
        )
        for m in r["messages"]:
            role = _safe(m["role"])
            parts.append(
                f"<div class='msg {role}'><span class='role'>{role}</span>\n{_safe(m['content'])}</div>"
            )
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts)
