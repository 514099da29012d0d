"""Logging an iteration while the next one trains: a thread of the training process that runs the
tracker's calls in order (``tracking.background: thread``; ``process`` is ``ragen_core.run.log_process``)."""

from __future__ import annotations

from typing import Any


class BackgroundLog:
    """Runs tracking calls on one worker thread, in submission order, off the training loop's path.

    An iteration's MLflow calls (metrics, the Parquet artifact, transcripts) then overlap the next
    iteration instead of delaying it. A failing store raises nothing here: the ``Tracker`` goes
    offline and training goes on (its ``metrics.json`` files are on disk, so a resumed run re-logs
    what did not reach the store). Any other error (a bug: a metric that is not a number) is
    raised by the next ``submit`` and by every ``flush``, and nothing queued after it runs.
    ``enabled=False`` runs every call at once, in the caller's thread.
    """

    def __init__(self, enabled: bool = True) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragen-tracking") if enabled else None
        )
        self._error: BaseException | None = None

    def _run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._error is None:  # after a failure, later calls would log out of order: skip them
            try:
                fn(*args, **kwargs)
            except BaseException as e:
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``; raises the error of an earlier call, if one failed."""
        if self._pool is None:
            fn(*args, **kwargs)
            return
        self._raise()
        self._pool.submit(self._run, fn, args, kwargs)

    def flush(self) -> None:
        """Wait for every queued call; raises the first error."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()  # one worker, in order: all earlier calls are done
        self._raise()

    def close(self) -> None:
        """Wait for the queue (errors are left to ``flush``) and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
