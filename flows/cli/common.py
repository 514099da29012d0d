"""What every command shares: the error wrapper, the console, the error exit, the services' process
environment, and a metrics table."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console


class RagenGroup(TyperGroup):
    """Runs every command (sub-commands of ``sweep`` too) and turns its exceptions into one line.

    A user error (``ragen_core.errors.is_user_error``: a ``RagenError``, a config or preflight
    error, a missing run or file, an unwritable folder, ...) prints its own message, which names the
    cause, the file or key, and the fix; anything else prints ``internal error: <type>: <message>``.
    ``--debug`` (or ``RAGEN_DEBUG=1``) lets the exception through with its traceback instead.
    """

    def invoke(self, ctx: Any) -> Any:
        main = threading.current_thread() is threading.main_thread()  # signals are the main thread's
        previous = signal.signal(signal.SIGTERM, _terminated) if main else None
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # exits and usage errors (bad option values) are typer's to print
        except KeyboardInterrupt as exc:
            from ragen_core.errors import is_debug

            if is_debug():
                raise
            _exit_interrupted(exc)
        except Exception as exc:
            from ragen_core.errors import describe, is_debug

            if is_debug():
                raise
            fail(describe(exc))
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: the flow unwinds the same way (its run
    unlocked, its MLflow run ended KILLED, its services stopped) instead of dying mid-write."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


def _exit_interrupted(exc: KeyboardInterrupt) -> NoReturn:
    """Say how to go on and exit 130 (SIGINT) or 143 (SIGTERM), the exit hooks run in an order
    that works: the logs are flushed while Prefect's server still runs, then Prefect's exit hook
    stops the server. (The interpreter's own exit flushes logging last, after that hook, and
    Prefect's log handler then waited seconds on a server that was gone.)"""
    import atexit
    import os
    import sys

    try:
        fail(f"{_what_stopped(exc)}; {_on_interrupt()}", 143 if isinstance(exc, Terminated) else 130)
    except typer.Exit as done:
        logging.shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(done.exit_code)


def _what_stopped(exc: KeyboardInterrupt) -> str:
    return "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


#: What the interrupted command says about how to go on (``on_interrupt``); the default suits a
#: command that wrote nothing a rerun would not write again.
_on_interrupt: Callable[[], str] = lambda: "nothing was recorded as done; run the command again"  # noqa: E731


def on_interrupt(hint: Callable[[], str]) -> None:
    """Have a Ctrl-C (or SIGTERM) of the running command end on ``hint()``: how to go on."""
    global _on_interrupt
    _on_interrupt = hint


#: ``-h`` as well as ``--help``, on the app and (click contexts inherit it) on every command.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


def console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` in red on stderr and exit with ``code`` (no traceback)."""
    from rich.console import Console
    from rich.text import Text

    from ragen_core.text_safety import printable

    # an error may quote a file's or the model's text: its control characters are shown, not obeyed
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(printable(message), style="bold red"))
    raise typer.Exit(code)


def package_version() -> str:
    """The installed ragen-flow's version, else (a source tree run without installing) pyproject's."""
    import importlib.metadata as md

    try:
        return md.version("ragen-flow")
    except md.PackageNotFoundError:
        import tomllib

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])


#: Prefect's words for a run stopped by Ctrl-C or SIGTERM ("Crash detected! ..."), logged as an
#: ERROR per task and flow run; the CLI says it once, with how to go on.
_INTERRUPTED = "aborted by an interrupt signal"


class _QuietFailedRuns(logging.Filter):
    """Prefect reports a failed flow or task run as an ERROR with the whole traceback (~80 lines).

    Sits on the ``prefect.flow_runs`` / ``prefect.task_runs`` loggers (a logger filter survives the
    logging config Prefect applies when imported, so Prefect need not be imported to install it):
    such a record still goes to those loggers' own handlers (Prefect's API: the UI keeps the
    traceback) but not on to the console, where the CLI prints the error as one line (and the "Crash detected!" lines of a run stopped by Ctrl-C or
    SIGTERM: the CLI says that once, with how to go on). Everything
    else (WARNING lines, errors without a traceback) passes; ``--debug`` lets everything through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from ragen_core.errors import is_debug

        if record.levelno < logging.ERROR or is_debug():
            return True
        if not record.exc_info and _INTERRUPTED not in record.getMessage():
            return True
        for handler in logging.getLogger(record.name).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        return False


def _quiet_failed_runs() -> None:
    from ragen_core.text_safety import PrintableFilter

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _QuietFailedRuns) for f in log.filters):
            log.addFilter(PrintableFilter())  # the flows' log lines may quote model text
            log.addFilter(_QuietFailedRuns())


def prepare() -> Path:
    """The process environment of the services (before Prefect, MLflow or Ray load) and a state
    folder that is known to be writable: otherwise every command fails later, deep in a library."""
    import os
    import tempfile

    from flows.settings import STATE_DIR, configure_environment
    from ragen_core.progress import PROGRESS_ENV, show_progress_lines
    from ragen_core.state_folder import check_state_dir

    try:
        check_state_dir(STATE_DIR)
    except ValueError as exc:
        fail(str(exc))
    try:
        state = configure_environment()
        os.environ.setdefault(PROGRESS_ENV, "1")  # long rollouts print progress, in Ray actors too
        show_progress_lines()
        with tempfile.TemporaryFile(dir=state):
            pass
    except OSError as exc:
        fail(
            f"state folder {STATE_DIR.resolve()} (RAGEN_STATE_DIR) is not writable: {exc.strerror or exc}; "
            "set RAGEN_STATE_DIR to a writable folder"
        )
    _quiet_failed_runs()
    return state


def print_metrics(title: str, rows: dict[str, dict[str, float]]) -> None:
    """One column per row of ``rows`` (a step, a tag), one line per metric."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    for col in rows:
        table.add_column(col, justify="right")
    keys = sorted({k for r in rows.values() for k in r})
    for k in keys:
        table.add_row(k, *(f"{r[k]:.3f}" if k in r else "" for r in rows.values()))
    console().print(table)
