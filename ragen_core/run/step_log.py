"""What MLflow gets of each step of a run, and where that logging runs while the loop goes on.

:class:`StepLogger` logs one step from what the run directory holds (files written before the
step's DONE mark): the rollouts Parquet and the filter's decisions as artifacts, the transcripts
page, a sample of episodes as traces (these four as soon as the filter has judged the rollouts),
the validation file, then the metrics with the step's marker (idempotent per step). It needs only
the run folder and a :class:`~ragen_core.tracking.tracker.Tracker`, so it runs in any process.

Where it runs is ``tracking.background`` (``ragen_core.run.log_process.open_step_log``):

- ``process`` (default): the run's logging process (``ragen_core.run.log_process``). MLflow's SQL store
  and trace writer are pure Python; in a thread of the training process they take the interpreter
  lock from the rollout loop for about 0.1 s of CPU per iteration (benchmarks/README.md, "Pipeline
  overhead"), in a process of their own they use the other core;
- ``thread``: a thread of the training process (:class:`~ragen_core.tracking.background.BackgroundLog`);
- ``off``: in the loop, before the next iteration starts.

Every mode runs the calls in submission order; a store failure takes the tracker offline (training
goes on, a resume logs what is missing), any other error is raised by the next ``submit`` and by
``flush``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ragen_core.filter_record import groups_of
from ragen_core.run.run_dir import RunDir
from ragen_core.tracking.background import BackgroundLog
from ragen_core.tracking.tracker import Tracker
from ragen_core.tracking.transcripts import to_html, transcript_rows
from ragen_core.trajectory import read_table

#: The calls a step log accepts (methods of :class:`StepLogger`), by name: they cross a process boundary.
CALLS = ("log_rollouts", "log_step", "set_tags", "log_artifact")


class StepLogger:
    """Logs the steps of the run in ``run`` through ``tracker`` (which holds the MLflow run)."""

    def __init__(self, tracker: Tracker, run: RunDir, run_id: str, iterations: int) -> None:
        self.tracker, self.run, self.run_id, self.iterations = tracker, run, run_id, iterations
        self._rollouts_logged: set[int] = set()  # by this process; the store's marker is the metrics'

    def log_rollouts(self, k: int) -> None:
        """Log iteration ``k``'s rollouts once the filter has judged them: the Parquet and the filter's
        decisions as artifacts, the transcripts page, a sample of episodes as traces. Sent while the
        learner trains on them, so that the end of the iteration leaves only its metrics to log; once
        per process (a resume that finds the step unmarked logs it again, uploads overwrite and
        traces already stored are skipped)."""
        tracker, run = self.tracker, self.run
        if k in tracker.logged_steps or k in self._rollouts_logged:
            return
        self._rollouts_logged.add(k)
        if not tracker.cfg.log_artifacts or k <= 0 or not run.rollouts(k).exists():
            return
        tracker.log_artifact(run.rollouts(k), f"rollouts/iter_{k:04d}")
        groups = None
        if run.filter_file(k).exists():  # the filter's decisions, beside the rollouts they judge
            tracker.log_artifact(run.filter_file(k), f"rollouts/iter_{k:04d}")
            groups = groups_of(run.read_json(run.filter_file(k)), read_table(run.rollouts(k)))
        rows = transcript_rows(run.rollouts(k), tracker.cfg.transcripts_per_iteration, groups)
        if rows:
            tracker.log_text(to_html(rows, f"{self.run_id}, iteration {k}"), f"transcripts/iter_{k:04d}.html")
        # The table once, at the end: appending to an MLflow table re-uploads it whole each time.
        tracker.log_transcripts(rows, k, append_table=k == self.iterations)
        tracker.log_episode_traces(run.rollouts(k), k, groups)  # a sample, as MLflow traces

    def log_step(self, k: int, metrics: Mapping[str, float]) -> None:
        """Log one step: its rollouts (unless :meth:`log_rollouts` did), the validation file, then its
        metrics with the step's marker (idempotent per step): a tracking server lost in between leaves
        the step unmarked, so a resume logs it whole."""
        tracker, run = self.tracker, self.run
        if k in tracker.logged_steps:
            return
        self.log_rollouts(k)
        if tracker.cfg.log_artifacts and run.eval_file(k).exists():
            tracker.log_artifact(run.eval_file(k), "eval")
            if k == self.iterations:  # every validation episode of the final step as a trace
                tracker.log_episode_traces(run.eval_file(k), k, None)
        tracker.log_iteration(k, dict(metrics), timestamp_ms=self._step_time_ms(k))

    def _step_time_ms(self, k: int) -> int | None:
        """Step ``k``'s time: when its metrics file was written (never rewritten: history is appended),
        so every try of the step sends the same points (see ``Tracker.log_iteration``)."""
        path = self.run.metrics_file(k) if k > 0 else self.run.eval_metrics_file(0)
        try:
            return int(path.stat().st_mtime * 1000)
        except OSError:
            return None

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tracker.set_tags(tags)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.tracker.log_artifact(path, artifact_path)


class StepLog(Protocol):
    """Runs :class:`StepLogger` calls (by name, see ``CALLS``) in order, off the loop's path."""

    def submit(self, call: str, *args: Any) -> None:
        """Queue ``StepLogger.<call>(*args)``; raises the error of an earlier call, if one failed."""

    def flush(self) -> None:
        """Wait for every queued call (the training process's tracker is then current); raises the
        first error."""

    def close(self) -> None:
        """Wait for the queue (errors are left to ``flush``) and stop what runs it."""


class LocalStepLog:
    """The calls in this process: in a thread (``thread=True``) or at once, in the caller's thread."""

    def __init__(self, logger: StepLogger, thread: bool) -> None:
        self.logger = logger
        self._queue = BackgroundLog(enabled=thread)

    def submit(self, call: str, *args: Any) -> None:
        if call not in CALLS:
            raise ValueError(f"unknown step-log call {call!r}; one of {', '.join(CALLS)}")
        self._queue.submit(getattr(self.logger, call), *args)

    def flush(self) -> None:
        self._queue.flush()

    def close(self) -> None:
        self._queue.close()
