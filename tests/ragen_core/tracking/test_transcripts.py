"""The readable transcripts of an iteration: which episodes are sampled, and an HTML page that keeps
every message verbatim (escaped, line breaks kept) with the filter's decision."""

from __future__ import annotations

import html
import statistics
from pathlib import Path

import pytest

from ragen_core.filter_record import group_decisions
from ragen_core.tracking.transcripts import to_html, transcript_rows
from ragen_core.trajectory import read_table, write_trajectories
from tests.ragen_core.test_trajectory import make_traj


def test_one_episode_per_group_kept_and_dropped_in_turn_and_every_message_verbatim(tmp_path: Path) -> None:
    trajs = [make_traj(i) for i in range(6)]  # groups 0, 1, 2 of two members each
    trajs[2].messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "Turn 1:\n  <grid> & more"},
        {"role": "assistant", "content": "<think>go</think><answer>Up</answer>"},
    ]
    path = write_trajectories(trajs, tmp_path / "rollouts.parquet")
    table = read_table(path)
    groups = group_decisions(table, [2, 3])  # the filter kept group 1
    rows = transcript_rows(path, n=3, groups=groups)
    assert [(r["group_id"], r["filter"]) for r in rows] == [(1, "kept"), (0, "dropped"), (2, "dropped")]
    # the default page of 4 showed only kept groups when the filter kept 4 or more: both sides now
    two_kept = group_decisions(table, [0, 1, 2, 3])
    assert [(r["group_id"], r["filter"]) for r in transcript_rows(path, 2, two_kept)] == [
        (0, "kept"),
        (2, "dropped"),
    ]
    assert transcript_rows(path, n=2)[0]["filter"] == ""  # no filter file: no decision shown
    page = to_html(rows, "run x, iteration 3")
    assert "kept by the filter" in page and "dropped by the filter" in page
    std = statistics.stdev([t.score for t in trajs[:2]])  # group 0's, dropped
    assert rows[1]["group_score_std"] == groups[0].score_std == pytest.approx(std)
    assert f"dropped by the filter</span> (group score std {std:.3f})" in page
    for m in rows[0]["messages"]:
        assert html.escape(m["content"]) in page  # verbatim, escaped: no markup of the model's runs
    assert "<grid>" not in page and "&lt;answer&gt;Up&lt;/answer&gt;" in page
