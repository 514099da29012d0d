"""MLflow tracking for ragen-flow: one MLflow run per training run, batched, resumable, fail-fast.

This package and the run modules that log through it are the only ones that import ``mlflow``
(docs/architecture.md, "Layers"), and they import it lazily, so that reading a ``TrackingConfig``
(``ragen_core.config.tracking``) costs nothing.

Where the runs go (``resolve_tracking_uri``): ``TrackingConfig.tracking_uri``, else the
environment variable ``MLFLOW_TRACKING_URI``, else a local store in the project's state folder:
``sqlite:///<state_dir>/mlflow.db`` with artifacts in ``<state_dir>/mlartifacts/<experiment>``
(never MLflow's own default, which drops ``mlflow.db`` in the working directory; a copied or moved
state folder's store is pointed at its own ``mlartifacts`` when opened: ``ragen_core.tracking.store``). Browse it with
``mlflow ui --backend-store-uri sqlite:///<state_dir>/mlflow.db``. A remote server
(``http(s)://``) is probed once (``GET /health``) within ``connect_timeout_s``; an unreachable
one fails at once with the address and the fix, instead of MLflow's retry loop (7 retries with
exponential backoff, minutes).

What a run holds:

* params -- the flattened config (``flatten_params``), sent 100 per ``log_batch`` (MLflow's
  limit), values cut at 6,000 characters (the full config is an artifact). On resume, keys already
  present are skipped; a key whose value changed is *not* re-logged (MLflow forbids changing a
  param) and is listed in the tag ``ragen.resume.changed_params``; ``ragen.resume.<key>`` keeps its values.
* metrics -- ``log_iteration(step, metrics)``: one ``log_batch`` per iteration (chunks of 1,000
  if larger) with every finite metric at ``step``; the last chunk also sets the run tag
  ``ragen.logged_steps`` (the steps logged so far, as ranges: ``0-12,14``), so a step is marked only
  once all its metrics are in. A marked step is not logged again (returns False), so a resumed run
  never double-logs. The iteration is the step axis, never a metric (runs logged before 2026-12-02
  marked steps with a metric ``iteration``, still read on resume). Non-finite values (NaN, inf,
  None) are skipped and counted in ``tracking/skipped_nonfinite`` (MLflow itself would store NaN
  and clamp inf to 1.8e308, which spoils the plots). Characters MLflow refuses in names are
  replaced (``metric_key``: ``pass@16`` -> ``pass_at_16``).
* artifacts -- files and folders (``log_artifact(s)``), text (``log_text``: the transcripts page of
  each iteration), one table ``transcripts.json`` appended with ``log_table`` for the UI's table
  view (one table path only, because ``log_table`` lists every table in a tag whose length is
  limited), and paper-style plots (``log_plots``: PNG under ``plots/``, the overview on top).
* traces -- episodes as MLflow traces (``log_episode_traces``, ``ragen_core.tracking.episode_traces``): a
  sample of each iteration's train rollouts and every validation episode of the final step, one chat
  span per turn, the score, success and filter decision as feedback; sent to this store's trace API
  directly (no global tracer), and skipped on a resume when the store already has them.

One process logs a run at a time (SQLite locks under concurrent writers): while the loop runs, the run's
logging process holds it (``ragen_core.run.log_process``; ``Tracker.state`` / ``take_over`` hand it over).
"""

from __future__ import annotations

import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ragen_core.config.tracking import TrackingConfig, flatten_params, resolve_tracking_uri, sqlite_file
from ragen_core.tracking.keys import format_steps, metric_key, parse_steps, resumed_value_tags
from ragen_core.tracking.library_logs import route_library_logs
from ragen_core.tracking.links import run_page, ui_base
from ragen_core.tracking.offline import (
    HTTP_DEFAULTS,
    TrackingError,
    cut_text,
    deleted_run_message,
    failure_reason,
    probe_http,
)
from ragen_core.tracking.store import experiment_artifacts, open_sqlite_client

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.tracking import MlflowClient

    from ragen_core.filter_record import GroupDecision

MAX_PARAMS_PER_BATCH = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
MAX_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
MAX_PARAM_VALUE_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_LEN = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
ITERATION_KEY = "iteration"  # the step marker metric of runs logged before 2026-12-02 (read on resume)
#: The run tag listing the steps whose metrics are all logged (``0-12,14``).
LOGGED_STEPS_TAG = "ragen.logged_steps"
#: The experiment tag that picks the MLflow UI's view of an experiment (model training or GenAI).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
SKIPPED_KEY = "tracking/skipped_nonfinite"
PARENT_TAG = "mlflow.parentRunId"
CHANGED_PARAMS_TAG = "ragen.resume.changed_params"

TABLE_STEP_TAG = "ragen.transcripts_table_step"
TRANSCRIPTS_TABLE = "transcripts.json"

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


_log = logging.getLogger(__name__)


def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    return (items[i : i + n] for i in range(0, len(items), n))


# ---------------------------------------------------------------------------- tracker
@dataclass(frozen=True)
class TrackerState:
    """A Tracker's view of its run (``Tracker.state``), as handed between processes (picklable)."""

    run_id: str
    experiment_id: str | None
    logged_steps: list[int]
    table_step: int | None
    resumed: bool
    offline: str | None


class Tracker:
    """One MLflow run, from one process: ``start`` (or resume), ``log_iteration`` per iteration,
    artifacts, tags, ``end``. Also a context manager that ends the run FAILED on an exception.

    After ``start``, a failing store never raises: the first failure sets ``offline`` (one line:
    the store, the call, the reason) and every later call returns at once (see the module doc)."""

    def __init__(self, cfg: TrackingConfig, state_dir: str | os.PathLike[str]) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        for key, value in HTTP_DEFAULTS.items():  # read by MLflow at each request
            os.environ.setdefault(key, value)
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.tracking_uri = resolve_tracking_uri(cfg, state_dir)
        self.run_id: str | None = None
        #: Why this Tracker stopped talking to the store (None: it has not); set by the first
        #: failed call after ``start``, cleared by the next ``start``.
        self.offline: str | None = None
        self._logged_steps: set[int] = set()
        self._table_step: int | None = None
        #: The experiment of the current run (set by ``start``); traces go there.
        self.experiment_id: str | None = None
        self._resumed = False
        self._resumed_tags: dict[str, str] = {}  # a resumed run's tags, as it was reopened
        self._tracing: Any = None  # mlflow TracingClient on tracking_uri, made at the first trace
        scheme = urllib.parse.urlparse(self.tracking_uri).scheme
        if scheme in ("http", "https"):
            probe_http(self.tracking_uri, cfg.connect_timeout_s)
        db = sqlite_file(self.tracking_uri)
        self._scheme = scheme
        from mlflow.tracking import MlflowClient

        self.library_log = route_library_logs(state_dir)  # MLflow's own tracebacks: to a file
        if db is not None:
            self.client: MlflowClient = open_sqlite_client(self.tracking_uri, db)
        else:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)

    # ------------------------------------------------------------------ run lifecycle
    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.run_id is not None:
            self.end(
                "FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED")
            )

    def _store_error(self, what: str, e: Exception) -> TrackingError:
        return TrackingError(f"MLflow ({self.tracking_uri}) failed to {what}: {type(e).__name__}: {e}")

    def _go_offline(self, what: str, e: BaseException) -> None:
        """Record the first failure of the run and warn once; later calls skip the store."""
        if self.offline is not None:
            return
        unreachable, reason = failure_reason(e)
        self.offline = (
            f"MLflow at {self.tracking_uri} {'unreachable' if unreachable else 'failing'} "
            f"since {what} ({reason})"
        )
        _log.warning(
            "%s; going on without MLflow (the run directory keeps everything; resume the run once the "
            "store is back to log what is missing)%s",
            self.offline,
            f"; details in {self.library_log}" if self.library_log else "",
        )

    def go_offline(self, what: str, e: BaseException) -> None:
        """For the modules that log through this tracker's client (models, traces): a failed call
        takes the tracker offline, as a failed call of its own does."""
        self._go_offline(what, e)

    def offline_message(self, run_id: str, run_dir: str | os.PathLike[str]) -> str | None:
        """What the user should do after a run whose tracking went offline (None: it did not)."""
        if self.offline is None:
            return None
        return (
            f"{self.offline}; the run directory {Path(run_dir)} keeps every finished iteration; once the "
            f"store works again, `ragen train --resume {run_id}` logs what is missing"
        )

    def _artifact_location(self) -> str | None:
        if self._scheme in ("http", "https"):
            return None  # the server's --artifacts-destination / --default-artifact-root
        db = sqlite_file(self.tracking_uri)
        # beside the store (a SQLite file moves with its state folder), else in the state folder
        return experiment_artifacts(
            db if db is not None else self.state_dir / "mlflow.db", self.cfg.experiment
        )

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.cfg.experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            # Runs with traces make MLflow's UI open the experiment in its GenAI view (traces and
            # evaluations); this is model training, so it opens on the runs and their charts. A user's
            # own choice in the UI replaces the tag.
            return self.client.create_experiment(
                name,
                artifact_location=self._artifact_location(),
                tags={EXPERIMENT_KIND_TAG: "custom_model_development"},
            )
        except MlflowException:  # created meanwhile by another process (a parallel sweep member)
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def start(
        self,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> str:
        """Create the run (or resume ``run_id``: same id, status back to RUNNING) and log ``params``
        (nested mappings are flattened) and ``tags``. ``parent_run_id`` nests it under a sweep's
        parent run. Returns the run id."""
        if self.run_id is not None:
            raise RuntimeError(f"Tracker already holds run {self.run_id}; call end() first")
        self.offline = None  # a new start tries the store again (and fails fast if it is still down)
        tags = {str(k): str(v) for k, v in (tags or {}).items()}
        try:
            if parent_run_id is not None:
                try:
                    self.client.get_run(parent_run_id)
                except Exception as e:
                    raise TrackingError(
                        f"parent run {parent_run_id} not found in {self.tracking_uri}: {e}"
                    ) from None
                tags[PARENT_TAG] = parent_run_id
            existing: dict[str, str] = {}
            if run_id is not None:
                existing = self._resume(run_id)
            else:
                run_id = self._create(run_name)
        except TrackingError:
            raise
        except Exception as e:
            raise self._store_error(f"start run {run_name!r}", e) from e
        self.run_id = run_id
        changed = self._log_new_params(run_id, params, existing)
        if changed:  # a resume refuses every change but the documented ones: record, do not warn
            tags.update(resumed_value_tags(changed, existing, self._resumed_tags))
            _log.info("resumed run %s with %s", run_id, ", ".join(f"{k}={v}" for k, v in changed.items()))
            tags[CHANGED_PARAMS_TAG] = ",".join(changed)
        try:
            self._log_tags(run_id, tags)
        except Exception as e:
            raise self._store_error(f"set tags on run {run_id}", e) from e
        return run_id

    def _resume(self, run_id: str) -> dict[str, str]:
        """Set run ``run_id`` RUNNING again and read what it logged (steps, table step); its params."""
        try:
            run = self.client.get_run(run_id)
        except Exception as e:
            raise TrackingError(
                f"cannot resume MLflow run {run_id}: not found in {self.tracking_uri} ({e}); "
                "start a new run (no run id) or point tracking_uri at the store that holds it"
            ) from None
        if run.info.lifecycle_stage == "deleted":  # MLflow refuses to reopen it: say how to go on
            raise TrackingError(deleted_run_message(self.tracking_uri, run_id))
        existing = dict(run.data.params)
        self._resumed_tags = dict(run.data.tags)
        self.client.update_run(run_id, status="RUNNING")
        self._logged_steps = parse_steps(run.data.tags.get(LOGGED_STEPS_TAG, "")) | {
            int(m.step) for m in self.client.get_metric_history(run_id, ITERATION_KEY)
        }
        t = run.data.tags.get(TABLE_STEP_TAG)
        self._table_step = int(t) if t is not None else None
        self.experiment_id, self._resumed = run.info.experiment_id, True
        return existing

    def _create(self, run_name: str) -> str:
        """A new run in the experiment (made if missing); its id."""
        exp_id = self._experiment_id()
        run = self.client.create_run(exp_id, run_name=run_name)
        self._logged_steps = set()
        self._table_step = None
        self.experiment_id, self._resumed = exp_id, False
        return str(run.info.run_id)

    def _log_new_params(
        self, run_id: str, params: Mapping[str, Any], existing: Mapping[str, str]
    ) -> dict[str, str]:
        """Log the (flattened) ``params`` the run does not have yet; the keys whose value differs from the
        one it has (MLflow keeps a param's first value), with their new values."""
        from mlflow.entities import Param

        flat = {metric_key(k): cut_text(v, MAX_PARAM_VALUE_LEN) for k, v in flatten_params(params).items()}
        changed = {k: v for k, v in sorted(flat.items()) if k in existing and existing[k] != v}
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        try:
            for chunk in _chunks(new, MAX_PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=chunk, synchronous=True)
        except Exception as e:
            raise self._store_error(f"log params of run {run_id}", e) from e
        return changed

    def run_url(self, run_id: str, local_ui: str | None = None) -> str | None:
        """The run's page in the MLflow UI (model-training view): on the tracking server itself, or for a
        local store on the UI that ``ragen ui`` serves (``local_ui``, default the state folder's: see
        :mod:`ragen_core.tracking.links`). None when the store cannot be read."""
        if self.offline is not None:  # no retry sequence against a store known to be down
            return None
        try:
            experiment = self.client.get_run(run_id).info.experiment_id
        except Exception:  # a link is a courtesy: no store, no link
            return None
        return run_page(ui_base(self.tracking_uri, self.state_dir, local_ui), experiment, run_id)

    def _require_run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("no MLflow run: call Tracker.start() first")
        return self.run_id

    def end(self, status: RunStatus = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED and release it (the Tracker can start another).
        Offline (or failing now): the MLflow run stays RUNNING until a resumed run ends it."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, not {status!r}")
        if self.offline is not None:
            self.run_id = None
            return
        run_id = self._require_run()
        self.run_id = None
        try:
            self.client.set_terminated(run_id, status=status)
        except Exception as e:
            self._go_offline(f"end run {run_id} as {status}", e)

    # ------------------------------------------------------------------ handing the run over
    def state(self) -> TrackerState:
        """What another Tracker needs to go on logging this run exactly as this one would."""
        return TrackerState(
            run_id=self._require_run(),
            experiment_id=self.experiment_id,
            logged_steps=sorted(self._logged_steps),
            table_step=self._table_step,
            resumed=self._resumed,
            offline=self.offline,
        )

    def take_over(self, state: TrackerState) -> None:
        """Go on with the run another Tracker (of this store) has logged so far, from its ``state``,
        without a store call: the logging process takes the run over for the loop, and the training
        process takes it back after the last flush. An offline ``state`` takes this Tracker offline."""
        self.run_id, self.experiment_id = state.run_id, state.experiment_id
        self._logged_steps, self._table_step = set(state.logged_steps), state.table_step
        self._resumed = state.resumed
        if state.offline is not None and self.offline is None:
            self.offline = state.offline  # the other Tracker has warned already

    # ------------------------------------------------------------------ metrics, tags
    def log_iteration(self, step: int, metrics: Mapping[str, Any], timestamp_ms: int | None = None) -> bool:
        """Log one iteration's metrics at ``step`` in one ``log_batch``; False (and nothing logged)
        when this run already has iteration ``step``. ``timestamp_ms`` (default: now): the step's own
        time, the same on every try. MLflow's SQL store commits metrics and the step's marker apart, so
        a lost server can leave the step stored but unmarked; the resume's retry of equal points (key,
        value, step, timestamp) is then dropped by the store, not stored twice."""
        from mlflow.entities import Metric, RunTag

        run_id = self._require_run()
        step = int(step)
        if step in self._logged_steps or self.offline is not None:
            return False
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        values: dict[str, float] = {}
        origin: dict[str, str] = {}
        skipped: list[str] = []
        for name, raw in metrics.items():
            key = metric_key(name)
            if key in origin and origin[key] != name:
                raise ValueError(f"metric names {origin[key]!r} and {name!r} both map to MLflow key {key!r}")
            origin[key] = name
            try:
                v = float(raw) if raw is not None else math.nan
            except (TypeError, ValueError):
                raise TypeError(f"metric {name!r} at step {step} is not a number: {raw!r}") from None
            if math.isfinite(v):
                values[key] = v
            else:
                skipped.append(name)
        if skipped:
            values[SKIPPED_KEY] = float(len(skipped))
        values.pop(ITERATION_KEY, None)  # the step is the iteration
        batch = [Metric(k, v, ts, step) for k, v in values.items()]
        marker = RunTag(LOGGED_STEPS_TAG, format_steps(self._logged_steps | {step}))
        chunks = list(_chunks(batch, MAX_METRICS_PER_BATCH)) or [[]]
        try:
            for i, chunk in enumerate(chunks):  # the marker goes with the last chunk
                tags = [marker] if i == len(chunks) - 1 else []
                self.client.log_batch(run_id, metrics=chunk, tags=tags, synchronous=True)
        except Exception as e:
            # Not marked as logged: the iteration's metrics.json stays the source, re-logged on resume.
            self._go_offline(f"log iteration {step} of run {run_id}", e)
            return False
        if skipped:
            _log.warning("step %d: skipped non-finite metrics %s", step, skipped)
        self._logged_steps.add(step)
        return True

    @property
    def logged_steps(self) -> set[int]:
        """Iterations this run already has (its ``ragen.logged_steps`` tag)."""
        return set(self._logged_steps)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) run tags, 100 per batch; values cut at 8,000 characters."""
        run_id = self._require_run()
        if self.offline is not None:
            return
        try:
            self._log_tags(run_id, tags)
        except Exception as e:
            self._go_offline(f"set tags on run {run_id}", e)

    def _log_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(metric_key(k), cut_text(str(v), MAX_TAG_VALUE_LEN)) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=chunk, synchronous=True)

    def history(self, keys: Iterable[str] | None = None) -> dict[str, list[tuple[int, float]]]:
        """Metric series ``{key: [(step, value), ...]}`` sorted by step (one value per step: the last
        logged). ``keys`` may use the original names (``pass@16``); None: every metric of the run.
        Keys the run does not have are left out."""
        run_id = self._require_run()
        return self.run_history(run_id, keys)

    def run_history(
        self, run_id: str, keys: Iterable[str] | None = None
    ) -> dict[str, list[tuple[int, float]]]:
        """:meth:`history` of any run of this store (e.g. a sweep's members), by its run id."""
        try:
            if keys is None:
                wanted = {k: k for k in self.client.get_run(run_id).data.metrics}
            else:
                wanted = {k: metric_key(k) for k in keys}
            out: dict[str, list[tuple[int, float]]] = {}
            for name, key in wanted.items():
                pts = self.client.get_metric_history(run_id, key)
                if not pts:
                    continue
                by_step: dict[int, tuple[int, float]] = {}
                for m in pts:
                    prev = by_step.get(int(m.step))
                    if prev is None or m.timestamp >= prev[0]:
                        by_step[int(m.step)] = (m.timestamp, float(m.value))
                out[name] = [(s, v) for s, (_, v) in sorted(by_step.items())]
            return out
        except Exception as e:
            raise self._store_error(f"read metric history of run {run_id}", e) from e

    # ------------------------------------------------------------------ artifacts
    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload one file (no-op when ``log_artifacts`` is off)."""
        run_id = self._require_run()
        if not self.cfg.log_artifacts or self.offline is not None:
            return
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"artifact {p} does not exist or is not a file")
        try:
            self.client.log_artifact(run_id, str(p), artifact_path)
        except Exception as e:
            self._go_offline(f"upload {p.name} to run {run_id}", e)

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload a folder's contents under ``artifact_path`` (no-op when ``log_artifacts`` is off)."""
        run_id = self._require_run()
        if not self.cfg.log_artifacts or self.offline is not None:
            return
        p = Path(local_dir)
        if not p.is_dir():
            raise FileNotFoundError(f"artifact folder {p} does not exist")
        try:
            self.client.log_artifacts(run_id, str(p), artifact_path)
        except Exception as e:
            self._go_offline(f"upload {p} to run {run_id}", e)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Upload ``text`` as the artifact ``artifact_file`` (e.g. ``transcripts/iter_0003.html``;
        overwritten on a re-log; no-op when ``log_artifacts`` is off)."""
        run_id = self._require_run()
        if not self.cfg.log_artifacts or self.offline is not None:
            return
        try:
            self.client.log_text(run_id, text, artifact_file)
        except Exception as e:
            self._go_offline(f"upload {artifact_file} to run {run_id}", e)

    def log_transcripts(self, rows: list[dict[str, Any]], step: int, append_table: bool = True) -> None:
        """Append the first ``transcripts_per_iteration`` rows of iteration ``step`` to the run's table
        ``transcripts.json`` (a ``step`` column; nested values as JSON strings) unless that table
        already has this step. The readable page of each iteration is ``log_text``'s job."""
        run_id = self._require_run()
        n = self.cfg.transcripts_per_iteration
        if not self.cfg.log_artifacts or n == 0 or not rows or self.offline is not None:
            return
        rows = [{k: v for k, v in r.items() if k != "messages"} for r in rows[:n]]
        step = int(step)
        if not append_table or (self._table_step is not None and step <= self._table_step):
            return
        from ragen_core.tracking.transcripts import table_columns

        cols = table_columns(rows, step)
        try:
            with warnings.catch_warnings():  # MLflow's log_table trips pandas 3 deprecation warnings
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", FutureWarning)
                self.client.log_table(run_id, data=cols, artifact_file=TRANSCRIPTS_TABLE)
        except Exception as e:
            self._go_offline(f"append transcripts of step {step} to run {run_id}", e)
            return
        self._table_step = step
        self.set_tags({TABLE_STEP_TAG: str(step)})

    def log_episode_traces(
        self, path: str | os.PathLike[str], step: int, groups: Sequence[GroupDecision] | None = None
    ) -> int:
        """Log the episodes of a trajectory file of ``step`` as MLflow traces of this run
        (``ragen_core.tracking.episode_traces``): a train file's sample (``traces_per_tag``, kept and
        dropped groups; ``groups``: the filter's record, as feedback), every episode of a validation
        file; at most ``max_traces_per_step``. Off with ``log_artifacts``. A resumed run skips the
        traces its store already has. Returns the number of traces sent."""
        from ragen_core.tracking.episode_traces import send_traces, traces_of_file

        run_id = self._require_run()
        if not self.cfg.log_artifacts or self.offline is not None or self.experiment_id is None:
            return 0
        traces = traces_of_file(  # a damaged file raises here: not a store failure
            Path(path),
            int(step),
            experiment_id=self.experiment_id,
            mlflow_run_id=run_id,
            per_tag=self.cfg.traces_per_tag,
            cap=self.cfg.max_traces_per_step,
            groups=groups,
        )
        if not traces:
            return 0
        try:
            if self._tracing is None:
                from mlflow.tracing.client import TracingClient

                self._tracing = TracingClient(self.tracking_uri)  # this store, not MLflow's global one
            return len(send_traces(self._tracing, self.experiment_id, traces, skip_existing=self._resumed))
        except Exception as e:
            self._go_offline(f"log episode traces of {Path(path).name} to run {run_id}", e)
            return 0

    def log_plots(
        self,
        out_dir: str | os.PathLike[str],
        markers: Mapping[str, int] | None = None,
        title: str | None = None,
    ) -> list[Path]:
        """Draw the paper-style curves from this run's metric history into ``out_dir`` (see
        ``render_plots``) and upload them under ``plots/``, the overview at the top. Returns the PNG paths."""
        run_id = self._require_run()
        if self.offline is not None:
            return []
        try:
            hist = self.run_history(run_id)
        except TrackingError as e:
            self._go_offline(f"read the metric history of run {run_id}", e.__cause__ or e)
            return []
        from ragen_core.tracking.plotting import render_plots

        paths = render_plots(hist, out_dir, markers=markers, title=title)
        for p in paths:  # the overview is what a reader opens first: at the top of the artifacts
            self.log_artifact(p, None if p.name == "overview.png" else "plots")
        return paths
