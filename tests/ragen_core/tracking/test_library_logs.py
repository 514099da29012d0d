"""The libraries' log file never turns a library's log call into an exception."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from ragen_core.tracking import library_logs


def test_records_for_a_folder_that_is_gone_are_dropped_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler stays with the process's first state folder; when that folder is removed (a test's
    temporary folder, a run root cleaned up), a library's next record is dropped, as on a full disk,
    instead of a FileNotFoundError out of ``logger.info`` inside MLflow."""
    monkeypatch.setattr(library_logs, "_handler", [])
    monkeypatch.delenv("RAGEN_DEBUG", raising=False)
    state = tmp_path / "state"
    path = library_logs.route_library_logs(state)
    assert path == state / "logs" / "libraries.log"
    logger = logging.getLogger("mlflow.test_library_logs")
    try:
        logger.warning("first record")
        assert "first record" in path.read_text()
        handler = library_logs._handler[0]
        handler.close()  # as a process that later loses the folder: the next record reopens the file
        shutil.rmtree(state)
        logger.warning("second record")  # must not raise
        assert not path.exists()
    finally:
        for name in library_logs.LIBRARY_LOGGERS:
            for h in list(logging.getLogger(name).handlers):
                if isinstance(h, library_logs._QuietFileHandler):
                    logging.getLogger(name).removeHandler(h)
