"""Text that reaches a terminal or a page, made inert: model output (or a shared Parquet file) may hold
control sequences that a terminal obeys (clear the screen, set the window title, an OSC 8 hyperlink
whose text hides its target, a carriage return that overwrites the line) and bidirectional overrides
that reorder what is read. :func:`printable` shows each such character escaped (``\\x1b``, ``\\r``,
``\\u202e``) and keeps line breaks and tabs; every view of model text (``ragen show``, the log lines,
the HTML transcripts, the CLI's error line) goes through it, so the rule lives here once."""

from __future__ import annotations

import logging
import re

#: C0 controls but tab and newline, DEL, C1 controls (``\x9b`` is a one-byte CSI), and the Unicode
#: bidirectional embeddings, overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\r": "\\r", "\x0b": "\\v", "\x0c": "\\f", "\x00": "\\0"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str) -> str:
    """``text`` with every control character (but ``\\n`` and ``\\t``) shown as an escape."""
    return _UNSAFE.sub(_escaped, text)


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines carry no control sequences (a log line may quote model text)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


class PrintableFilter(logging.Filter):
    """The same on a logger whose handlers are not ours (Prefect's): the record's message is made
    printable before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = printable(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True
