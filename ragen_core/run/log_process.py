"""The run's logging process: MLflow logging of each step off the training process (``tracking.background:
process``, the default; ``ragen_core.run.step_log`` has the other modes).

The training process starts it with the run's tracking settings (``python -m ragen_core.run.log_process``,
one socket between them) and sends it :class:`~ragen_core.run.step_log.StepLogger` calls by name. The run
is handed over, not shared: at the first call after a flush, the training process's tracker sends
its :class:`~ragen_core.tracking.tracker.TrackerState` (the steps logged so far, offline or not) and stops
logging; at ``flush`` the logging process sends its state back and the training process's tracker
takes over again (the end of the run: best step, plots, models). So one process logs the run at any
moment, and the steps' marker tag is always whole.

Failures:

- a store failure takes the logging process's tracker offline; the training process learns it at
  the next flush (and warns at the end, as with a thread);
- any other error (a bug) is sent back at once and raised by the next ``submit`` or ``flush``;
  nothing queued after it runs;
- a logging process that died (killed, out of memory) takes the training process's tracker offline,
  naming its exit code: training goes on and a resume logs what is missing;
- Ctrl-C is the training process's to handle (the logging process runs in a session of its own,
  out of the terminal's process group, and ignores SIGINT; the training process's exit flushes it). A training process that dies closes the socket: the logging process
  logs what it had received and exits (under the ``ragen`` commands, whose watchdog stops every
  child of a dead process, it is stopped within a second or two; a step it had not finished is
  re-logged whole by a resume, since its marker goes with its last metrics). While it lives it
  holds a shared lock on ``<run>/LOGGING.lock``, and a resume waits for it
  (:func:`wait_for_earlier_logging`) before reading which steps the store has, so a step is never
  logged by two processes at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ragen_core.config.tracking import BackgroundMode
from ragen_core.errors import RagenError
from ragen_core.priority import lower_priority, nice_increment
from ragen_core.run.step_log import CALLS, LocalStepLog, StepLog, StepLogger
from ragen_core.tracking.tracker import Tracker, TrackerState

#: Held (shared) by a run's logging process for as long as it lives; beside the run's LOCK.
LOCK_NAME = "LOGGING.lock"
#: How much lower than training the logging process runs (``nice`` increment, 0 to 19; default 10):
#: its work is after the fact, and at equal priority it takes a core from the rollout loop on a
#: 2-core machine (``ragen_core.priority``).
NICE_VAR = "RAGEN_LOG_PROCESS_NICE"


class EarlierLoggingError(RagenError, RuntimeError):
    """The logging process of an earlier process of this run is still running."""


def wait_for_earlier_logging(run_root: str | os.PathLike[str], timeout_s: float = 120.0) -> None:
    """Return once no logging process of this run is alive (one whose training process was killed
    logs what it had received, then exits); raises :class:`EarlierLoggingError` after ``timeout_s``."""
    path = Path(run_root) / LOCK_NAME
    if not path.exists():
        return
    fd = os.open(path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EarlierLoggingError(
                        f"{run_root}: the MLflow logging process of an earlier process of this run is still "
                        f"running after {timeout_s:.0f} s (it holds {path}); wait for it or stop it "
                        "(`fuser -k` on that file), then resume"
                    ) from None
                time.sleep(0.1)
    finally:
        os.close(fd)


def _exception_bytes(e: BaseException) -> bytes:
    """``e`` pickled, with the logging process's traceback as a note (an exception that does not pickle
    arrives as a RuntimeError with its text)."""
    where = "in the MLflow logging process:\n" + "".join(traceback.format_exception(e))
    try:
        e.add_note(where)
        return pickle.dumps(e)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}\n{where}"))


class ProcessStepLog:
    """The training process's end: a :class:`~ragen_core.run.step_log.StepLog` whose calls run in the
    logging process (started here)."""

    def __init__(self, logger: StepLogger) -> None:
        self.tracker = logger.tracker
        nice = nice_increment(NICE_VAR)  # a bad value fails before anything starts
        mine, theirs = socket.socketpair()
        lock = os.open(logger.run.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)  # the description, and so the lock, passes to the child
            package_root = str(Path(__file__).resolve().parent.parent)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ragen_core.run.log_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), lock),
                stdin=subprocess.DEVNULL,
                env=env,
                # Out of the terminal's process group: Ctrl-C or a group SIGTERM is the training
                # process's to handle (it flushes and closes this one); delivered here too, it broke
                # the process mid-import with a KeyboardInterrupt traceback.
                start_new_session=True,
            )
            lower_priority(self.process.pid, nice)
        finally:
            os.close(lock)  # the logging process holds it now
            theirs.close()
        self._conn = Connection(mine.detach())
        self._error: BaseException | None = None
        self._attached = False  # True: the logging process holds the run (calls sent since the last flush)
        self._dead = False
        self._ready = False  # the logging process has opened the store and is waiting for calls
        cfg = self.tracker.cfg.model_copy(update={"tracking_uri": self.tracker.tracking_uri})
        self._send(
            (
                "open",
                cfg.model_dump(),
                str(self.tracker.state_dir),
                str(logger.run.root),
                logger.run_id,
                logger.iterations,
            )
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    # the socket ----------------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._dead:
            return
        try:
            self._conn.send(message)
        except OSError:
            self._died()

    def _receive(self) -> tuple[Any, ...] | None:
        try:
            message: tuple[Any, ...] = self._conn.recv()
            return message
        except (EOFError, OSError):
            self._died()
            return None

    def _died(self) -> None:
        """The logging process is gone: what it had not logged stays in the run folder (offline)."""
        self._dead, self._attached = True, False
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.tracker.go_offline(
            "hand the iterations to the MLflow logging process",
            RuntimeError(f"the logging process (pid {self.process.pid}) exited with code {code}"),
        )

    def _take(self, message: tuple[Any, ...]) -> TrackerState | None:
        """Handle one message of the logging process; returns its state when it is one."""
        if message[0] == "ready":
            self._ready = True
            return None
        if message[0] == "error":
            if self._error is None:
                self._error = pickle.loads(message[1])
            return None
        state: TrackerState = message[1]
        return state

    def _poll_errors(self) -> None:
        while not self._dead and self._conn.poll():
            message = self._receive()
            if message is not None:
                self._take(message)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def wait_ready(self) -> float:
        """Wait until the logging process has started (Python, torch and MLflow imported, the store
        opened: seconds of CPU, while the run's warm start runs); returns the seconds waited."""
        t0 = time.perf_counter()
        while not (self._ready or self._dead):
            message = self._receive()
            if message is not None:
                self._take(message)
        return time.perf_counter() - t0

    # the StepLog protocol ------------------------------------------------------------------------
    def submit(self, call: str, *args: Any) -> None:
        if call not in CALLS:
            raise ValueError(f"unknown step-log call {call!r}; one of {', '.join(CALLS)}")
        self._poll_errors()
        self._raise()
        if self._dead:
            return
        if not self._attached:
            self._send(("attach", self.tracker.state()))
            self._attached = True
        self._send(("call", call, args))

    def flush(self) -> None:
        self._hand_back("flush")
        self._raise()

    def close(self) -> None:
        self._hand_back("close")
        if not self._dead:
            self._send(("exit",))
            self.process.wait()
        self._conn.close()

    def _hand_back(self, why: str) -> None:
        """Wait until the logging process has run every call, and take the run back from it."""
        if not self._attached or self._dead:
            return
        self._send(("flush",))
        while not self._dead:
            message = self._receive()
            if message is None:
                return
            state = self._take(message)
            if state is not None:
                self.tracker.take_over(state)
                self._attached = False
                return


def open_step_log(mode: BackgroundMode, logger: StepLogger) -> StepLog:
    """The step log of ``tracking.background`` = ``mode`` for ``logger``'s run (the logging process
    starts now, so that it is ready when the first iteration ends)."""
    if mode == "process":
        return ProcessStepLog(logger)
    return LocalStepLog(logger, thread=mode == "thread")


# ------------------------------------------------------------------------------ the logging process
def serve(conn: Connection) -> None:
    """Run the calls the training process sends, in order, until it says exit or goes away."""
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.run.run_dir import RunDir

    _, cfg, state_dir, run_root, run_id, iterations = conn.recv()
    tracker: Tracker | None = None
    state: TrackerState | None = None  # the run as handed over (kept here when there is no tracker)
    unusable: str | None = None
    try:
        tracker = Tracker(TrackingConfig.model_validate(cfg), state_dir)
    except Exception as e:  # the store went away since the run started: the same as going offline
        unusable = (
            f"MLflow at {cfg.get('tracking_uri')} unreachable since the logging process opened it ({e})"
        )
    logger = StepLogger(tracker, RunDir(run_root), run_id, iterations) if tracker is not None else None

    def reply(message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the training process is gone: what it sent is still logged
            conn.send(message)

    reply(("ready",))
    failed = False
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the training process is gone; what it sent is done
            return
        kind = message[0]
        if kind == "attach":
            handed: TrackerState = message[1]
            state = replace(handed, offline=handed.offline or unusable) if tracker is None else None
            if tracker is not None:
                tracker.take_over(handed)
        elif kind == "call" and not failed and logger is not None:
            try:
                getattr(logger, message[1])(*message[2])
            except BaseException as e:  # a bug, not a store failure (the tracker catches those)
                failed = True  # later calls would log out of order
                reply(("error", _exception_bytes(e)))
        elif kind == "flush":
            reply(("state", tracker.state() if tracker is not None else state))  # after an attach
        elif kind == "exit":
            return


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the training process, which closes us
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
