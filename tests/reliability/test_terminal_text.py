"""Model text (or a shared Parquet file's) never drives the terminal: ``ragen show``, the log lines and
the HTML transcripts show control sequences escaped, and keep line breaks and tabs."""

from __future__ import annotations

import logging
from pathlib import Path

from ragen_core.progress import progress_log, show_progress_lines
from ragen_core.text_safety import printable
from ragen_core.tracking.transcripts import to_html, transcript_rows
from ragen_core.trajectory import write_trajectories
from tests.flows.test_cli import make
from tests.reliability.cli import run_cli

#: Clear-screen, a window title, an OSC 8 hyperlink whose text hides its target, NUL, a carriage
#: return that would overwrite the line, and a bidirectional override.
HOSTILE = "go\x1b[2J \x1b]0;title\x07 \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ nul\x00 cr\rover \u202eevil"
RAW = ("\x1b", "\x00", "\x07", "\r", "\u202e")


def _hostile_file(path: Path) -> Path:
    t = make("SimpleSokoban", 0, True, 1.0, 1, 4, [0.0])
    t.messages[-1]["content"] = "line one\n\tindented " + HOSTILE
    t.actions = [["Up\x1b[31m"]]
    t.info["end_reason"] = "done\x1b]0;x\x07"
    return write_trajectories([t], path)


def test_printable_escapes_controls_keeps_layout() -> None:
    shown = printable("a\nb\tc" + HOSTILE)
    assert shown.startswith("a\nb\tc")
    assert not any(c in shown for c in RAW), repr(shown)
    assert "\\x1b[2J" in shown and "\\x1b]0;title\\x07" in shown and "\\0" in shown and "\\r" in shown
    assert "\\x1b]8;;http://x\\x1b\\link" in shown and "\\u202e" in shown


def test_show_prints_no_control_sequences(tmp_path: Path) -> None:
    path = _hostile_file(tmp_path / "rollouts.parquet")
    out = run_cli(["show", str(path)], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not any(c in out.stdout + out.stderr for c in RAW), repr(out.stdout[-2000:])
    assert "\\x1b[2J" in out.stdout and "\\x1b]8;;http://x" in out.stdout
    assert "line one\n" in out.stdout and "Up\\x1b[31m" in out.stdout


def test_html_transcripts_escape_controls(tmp_path: Path) -> None:
    path = _hostile_file(tmp_path / "rollouts.parquet")
    page = to_html(transcript_rows(path, 4), "run \x1b[2J, iteration 1")
    assert not any(c in page for c in RAW), repr(page)
    assert "\\x1b]0;title\\x07" in page and "line one\n\tindented" in page


def test_log_lines_escape_controls(capfd) -> None:  # type: ignore[no-untyped-def]
    show_progress_lines()
    progress_log.info("episode said %s", HOSTILE)
    err = capfd.readouterr().err
    assert "episode said" in err and "\\x1b[2J" in err
    assert not any(c in err for c in RAW), repr(err)


def test_prefect_flow_log_lines_escape_controls(caplog) -> None:  # type: ignore[no-untyped-def]
    from flows.cli.common import _quiet_failed_runs

    _quiet_failed_runs()
    with caplog.at_level(logging.INFO, logger="prefect.flow_runs"):
        logging.getLogger("prefect.flow_runs").info("reply %s", HOSTILE)
    assert not any(c in caplog.text for c in RAW), repr(caplog.text)
