"""A training run's iteration loop and its decisions: which run, where to start, what to re-log, when
to stop or roll back, which step is best.

The orchestrator (``flows.train``) supplies the work as callables (an iteration, an evaluation, the
warm start) and composes them; everything decided from the run directory is decided here, so that the
same run folder gives the same decisions under any orchestrator:

- :func:`open_run` checks everything that can be checked (config, overrides, run name, machine,
  tracking server, the run lock) before anything is written, and holds the run's lock;
- :class:`Training` re-logs what a killed run finished but did not log, replays the Echo-Trap monitor
  over the stored iterations (rollbacks included), runs the remaining iterations with the monitor's
  stop and rollback decisions, and ends with the best step, the final models and where to look next.

Metrics reach MLflow only after an iteration's ``metrics.json`` and DONE mark are on disk (from the
run's logging process by default, ``ragen_core.run.step_log``, while the next iteration runs; in order,
and flushed before the run ends), and
logging is idempotent per step, so a killed run resumes with no iteration lost, duplicated or
double-logged. A rollback is an event of its own (``rollbacks/after_K.json``): no stored iteration is
rewritten, so every one stays rerunnable.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ragen_core.config import DEFAULT_CONFIG, RagenConfig, config_hash, dump_config, flatten, load_config
from ragen_core.errors import ray_actor_lost
from ragen_core.integrity import record
from ragen_core.models.provenance import model_provenance
from ragen_core.monitor import EchoTrapMonitor, Signal, signal_metrics
from ragen_core.progress import IterationClock, duration, iteration_line
from ragen_core.run.lineage import SystemMetrics, log_lineage
from ragen_core.run.log_process import open_step_log, wait_for_earlier_logging
from ragen_core.run.logged_models import log_kept_models, registry_name, run_alias
from ragen_core.run.preflight import disk_warning, learnability_check, preflight
from ragen_core.run.resume import resume_config
from ragen_core.run.run_dir import RunDir, create_run, find_run, run_name
from ragen_core.run.run_lock import RunLock
from ragen_core.run.session import Session
from ragen_core.run.stages import check_resumable, eval_due
from ragen_core.run.step_log import StepLog, StepLogger
from ragen_core.state_folder import index_entry
from ragen_core.tracking.keys import DESCRIPTION_TAG, FLOW_RUN_URL_TAG, tracked_metrics
from ragen_core.tracking.tracker import RunStatus, Tracker

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]
#: The work of one iteration (rollout -> filter -> learn -> evaluate when due), returning its metrics.
Iteration = Callable[[int], Mapping[str, float]]


class Observer(Protocol):
    """What the orchestrator shows of the loop in its own UI (Prefect: a progress artifact, events)."""

    def iteration_done(self, k: int, total: int, line: str) -> None: ...

    def signalled(self, k: int, signals: Sequence[Signal], action: str) -> None: ...

    def close(self) -> None:
        """Deliver what is still queued (the loop is over)."""


class _NoObserver:
    def iteration_done(self, k: int, total: int, line: str) -> None:
        pass

    def signalled(self, k: int, signals: Sequence[Signal], action: str) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def open_run(
    state: Path,
    log: Log,
    *,
    config: str | None = None,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    name: str | None = None,
    backend: str | None = None,
) -> Iterator[tuple[RunDir, RagenConfig, Tracker]]:
    """The run to train (a new one, or ``resume``'s), its config and a tracker, locked until exit.

    A resume accepts only what ``ragen_core.run.resume`` allows, and records the accepted changes in
    ``run.json``; an unreachable tracking server fails before a new run folder exists. ``backend``
    overrides ``trainer.backend`` for this process only (it is not a change of the run).
    """
    lock = None
    if resume:
        run = find_run(resume)
        lock = RunLock(run.root).acquire()
        try:
            cfg, changes = resume_config(
                run.root, run.config(), check_resumable(run), config, list(overrides)
            )
        except BaseException:
            lock.release()
            raise
    else:
        source = config or DEFAULT_CONFIG
        cfg = load_config(source, list(overrides))
        preflight(cfg)
        if warning := disk_warning(cfg):
            log.warning("%s", warning)
        new_name, changes = run_name(cfg, name, source), {}
        learnability_check(cfg)
    try:
        tracker = Tracker(cfg.tracking, state)  # an unreachable server fails here, before a run folder exists
        if lock is None:
            run = create_run(cfg, new_name)
            lock = RunLock(run.root).acquire()
            # the registered model its policies are versions of: one per config file (logged_models)
            run.update_info(config_name=Path(source).stem)
        elif changes:
            record(dump_config(cfg, run.config_path))
            run.update_info(
                config_hash=config_hash(cfg),  # what the next resume compares config.yaml with
                config_keys=flatten(cfg),
                resumes=[
                    *run.info().get("resumes", []),
                    {"at": time.time(), "changes": {k: list(v) for k, v in changes.items()}},
                ],
            )
            log.info("resumed with %s", ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items()))
        if backend:
            cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"backend": backend})})
        yield run, cfg, tracker
    finally:
        if lock is not None:
            lock.release()


class Training:
    """One process's part of a run, from tracking start to the closing lines (a context manager: on
    exit the tracking calls are flushed, the session closed and the MLflow run ended, FINISHED only
    after :meth:`finish`)."""

    def __init__(
        self,
        run: RunDir,
        cfg: RagenConfig,
        tracker: Tracker,
        log: Log,
        progress: Log,
        observer: Observer | None = None,
    ) -> None:
        self.run, self.cfg, self.tracker, self.log, self.progress = run, cfg, tracker, log, progress
        self.observer: Observer = observer or _NoObserver()
        #: run.json as the run started in this process (its MLflow run id and uploads of earlier processes)
        self.info: dict[str, Any] = run.info()
        self.run_id: str = self.info["run_id"]
        self.mlflow_run: str | None = None
        #: the Prefect flow run that trains the run, as (name, UI address): linked from the description
        self.flow_run: tuple[str, str] | None = None
        self.session: Session | None = None
        self.monitor = EchoTrapMonitor(cfg.monitor)
        self.step_logger = StepLogger(tracker, run, self.run_id, cfg.trainer.iterations)
        #: An iteration's MLflow calls overlap the next iteration (in order; errors surface at the next
        #: one); started with the tracking, in the logging process by default (``tracking.background``).
        self.background: StepLog | None = None
        self.clock = IterationClock(cfg.trainer.iterations)
        self.status: RunStatus = "FAILED"
        self.system_metrics: SystemMetrics | None = None

    def __enter__(self) -> Training:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.background is not None:
            self.background.close()
        self.observer.close()
        if self.system_metrics is not None:
            self.system_metrics.stop()
        if self.session is not None:
            self.session.close()
        if self.mlflow_run is not None:  # a failed start has no MLflow run to end
            self.tracker.end(self.status)
        offline = self.tracker.offline_message(self.run_id, self.run.root)  # MLflow went away mid-run
        if offline:
            self.log.warning(offline)

    # 1. tracking and the live parts ----------------------------------------------------------------
    def start_tracking(
        self,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        flow_run: tuple[str, str] | None = None,
    ) -> str:
        """Start (or, resuming, reopen) the MLflow run with the config as params and provenance tags.
        ``flow_run``: the Prefect flow run that trains it, as (name, UI address): a tag and a link in the
        run's description, which says what runs until :meth:`finish` adds what it reached."""
        if flow_run is not None:
            self.flow_run = flow_run
        self.log.info("run %s in %s", self.run_id, self.run.root)
        wait_for_earlier_logging(self.run.root)  # a killed process's logging process may still be at work
        self.mlflow_run = self.tracker.start(
            self.run_id,
            flatten(self.cfg),
            tags={
                "ragen.run_id": self.run_id,
                "ragen.config_hash": config_hash(self.cfg),
                "ragen.run_dir": index_entry(self.run.root),  # relative to the state folder, as runs.json
                "mlflow.source.git.commit": git_commit(),
                **(tags or {}),
                **({FLOW_RUN_URL_TAG: flow_run[1]} if flow_run else {}),
                **model_provenance(self.cfg.model.source()),
            },
            run_id=self.info.get("mlflow_run_id"),
            parent_run_id=parent_run_id,
        )
        self.run.update_info(mlflow_run_id=self.mlflow_run)
        description = run_description(
            self.cfg, self.run, self.run_id, self.run.last_complete(), None, self.flow_run
        )
        self.tracker.set_tags({DESCRIPTION_TAG: description})
        self.background = open_step_log(self.cfg.tracking.background, self.step_logger)
        self.system_metrics = SystemMetrics(self.tracker, self.cfg.tracking.system_metrics).start()
        return self.mlflow_run

    def log_config(self) -> None:
        """Upload ``config.yaml`` once per run (a resume does not upload it again); then what the run
        trains and validates on (dataset inputs) and the warm start's loss curve, also once."""
        logged = self.run.info().get("logged_artifacts", [])
        if self.cfg.tracking.log_artifacts and "config.yaml" not in logged:
            self.tracker.log_artifact(self.run.config_path)
            if self.tracker.offline is None:  # uploaded, not skipped by a tracker that lost its server
                self.run.update_info(logged_artifacts=[*logged, "config.yaml"])
        log_lineage(self.tracker, self.cfg, self.run)

    def open_session(self) -> Session:
        """The rollout worker and learner(s), closed on exit."""
        self.session = Session(self.cfg, self.run, backend=self.cfg.trainer.backend)
        return self.session

    # 2. where to start -------------------------------------------------------------------------------
    def catch_up(self, evaluate: Iteration) -> int:
        """Re-log what a killed run finished but did not log (logging skips logged steps), replay the
        monitor over the stored iterations and their rollbacks, and evaluate step 0 when due and not
        stored. Returns the last complete iteration: the loop goes on after it."""
        run, cfg = self.run, self.cfg
        last = run.last_complete()
        if run.eval_metrics_file(0).exists():
            self._step_zero(run.read_json(run.eval_metrics_file(0)))
        for k in range(1, last + 1):
            metrics = run.read_json(run.metrics_file(k))
            metrics.update(signal_metrics(self.monitor.update(k, metrics)))  # as the loop logged them
            if (to := run.rolled_back_to(k)) is not None:
                self.monitor.reset_to(to)
            self.step_logger.log_step(k, self._tracked(metrics))
        if last == 0 and eval_due(cfg, 0) and not run.eval_metrics_file(0).exists():
            self._step_zero(dict(evaluate(0)))
        if last < cfg.trainer.iterations:
            self.progress.info(
                "run %s: iterations %d-%d of %d (%s backend)%s",
                self.run_id,
                last + 1,
                cfg.trainer.iterations,
                cfg.trainer.iterations,
                cfg.trainer.backend,
                f", resumed after iteration {last}" if last else "",
            )
        return last

    def _step_zero(self, metrics: dict[str, float]) -> None:
        """The warm start's validation: logged, and the monitor's reference for validation success."""
        self.monitor.update(0, metrics)
        self.step_logger.log_step(0, self._tracked(metrics))

    # 3. the loop ---------------------------------------------------------------------------------
    def iterate(self, iteration: Iteration, start: int) -> int:
        """Run iterations ``start + 1 ..`` up to ``trainer.iterations``, each followed by the monitor's
        decision; returns the last iteration run (earlier than planned when the monitor stops it)."""
        k = start
        retries = self.cfg.trainer.actor_loss_retries
        self.clock.restart()  # an iteration's time is its own, not the warm start's or step 0's evaluation
        while k < self.cfg.trainer.iterations:
            k += 1
            try:
                metrics = dict(iteration(k))
            except Exception as exc:
                if not (ray_actor_lost(exc) and retries > 0 and self.session is not None):
                    raise
                retries -= 1
                self._rebuild_session(k, exc)
                k -= 1  # again from the last completed iteration: its stored stages are reused
                continue
            if not self._after_iteration(k, metrics):
                break
        return k

    def _rebuild_session(self, k: int, exc: BaseException) -> None:
        """A Ray actor (or its node) was lost during iteration ``k``: new actors on what the cluster
        has now; the iteration runs again from the last completed one (nothing of it was marked done
        or logged as a step, so nothing is lost or logged twice)."""
        assert self.session is not None
        self.log.warning(
            "iteration %d: a Ray actor was lost (%s: %s); rebuilding the rollout worker and learners",
            k,
            type(exc).__name__,
            str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        learners = self.session.rebuild()
        self.log.warning(
            "retrying from iteration %d with %d learner(s) (trainer.learners=%d)",
            k - 1,
            learners,
            self.cfg.trainer.learners,
        )
        self._queue(
            "set_tags",
            {f"ragen.actor_lost.iteration_{k}": f"{type(exc).__name__}; {learners} learner(s) after"},
        )

    def rollouts_judged(self, k: int) -> None:
        """Iteration ``k``'s rollouts are final (the filter has decided): their MLflow logging starts
        now, while the learner trains on them, and the iteration's end leaves only its metrics."""
        self._queue("log_rollouts", k)

    def _after_iteration(self, k: int, metrics: dict[str, float]) -> bool:
        """Log iteration ``k``, act on the monitor's signals; False when the run should stop."""
        signals = self.monitor.update(k, metrics)
        if signals:
            self._signal(k, signals)
            metrics.update(signal_metrics(signals))
        self._queue("log_step", k, self._tracked(metrics))
        total = self.cfg.trainer.iterations
        line = iteration_line(k, total, metrics, self.clock.lap(), self.clock.eta(k))
        self.progress.info(line)
        self.observer.iteration_done(k, total, line)
        if self.monitor.should_stop:
            self._queue("set_tags", {"echo_trap.action": f"stopped at iteration {k}"})
            return False
        if self.monitor.should_rollback:
            self._roll_back(k)
        return True

    def _signal(self, k: int, signals: Sequence[Signal]) -> None:
        self._queue("set_tags", {f"echo_trap.{s.name}": f"step {s.step}: {s.message}" for s in signals})
        for s in signals:
            self.log.warning("Echo-Trap signal at iteration %d: %s", k, s.message)
        # What the monitor does about them (the config's monitor.action: none, stop or rollback) is decided after.
        self.observer.signalled(k, signals, self.cfg.monitor.action)

    def _roll_back(self, k: int) -> None:
        """Continue from the monitor's chosen earlier step; recorded as an event, never by rewriting
        iteration ``k``."""
        to = self.monitor.rollback_step(range(0, k))
        if to is None or self.session is None:
            return
        self.log.warning("Echo-Trap: rolling back to the checkpoint of iteration %d", to)
        event = self.session.roll_back(k, to, [s.name for s in self.monitor.triggered])
        self.monitor.reset_to(to)
        self._queue("set_tags", {f"echo_trap.rollback_{self.monitor.rollbacks}": f"{k}->{to}"})
        if self.cfg.tracking.log_artifacts:
            self._queue("log_artifact", event, "rollbacks")

    def _tracked(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """What of a step's metrics goes to MLflow (``tracking.metrics``); the core set also holds the keys
        the Echo-Trap monitor reads, which the sweep report replays from MLflow."""
        return tracked_metrics(metrics, self.cfg.tracking.metrics, self.cfg.monitor.metric_keys())

    def _queue(self, call: str, *args: Any) -> None:
        """A tracking call for the step log (at once when tracking has not started: no MLflow run yet)."""
        if self.background is None:
            getattr(self.step_logger, call)(*args)
        else:
            self.background.submit(call, *args)

    # 4. the end ----------------------------------------------------------------------------------
    def finish(self, k: int) -> dict[str, Any]:
        """Flush the tracking calls, tag the best step, upload plots and the final and best models, say
        where to look next; returns the run's ids, its last and best steps and final metrics."""
        run = self.run
        if self.background is not None:
            self.background.flush()  # the training process's tracker holds the run again
        best, final_step = run.best_step(k), run.start_of(k + 1)  # where a last rollback went back to
        self.tracker.set_tags({"ragen.last_iteration": str(k), "ragen.best_step": str(best)})
        self.tracker.set_tags(
            {DESCRIPTION_TAG: run_description(self.cfg, run, self.run_id, k, best, self.flow_run)}
        )
        if self.cfg.tracking.log_artifacts:
            self.tracker.log_plots(run.root / "plots")
        models = log_kept_models(
            self.tracker, run, {"final": final_step or None, "best": best}, self.cfg.monitor.metric_keys()
        )
        self.status = "FINISHED"
        final = run.read_json(run.metrics_file(k)) if k > 0 else {}
        url = self.tracker.run_url(self.mlflow_run) if self.mlflow_run else None
        self.progress.info(
            "run %s finished: %d iterations (%s in this process), best step %s; MLflow run %s%s%s",
            self.run_id,
            k,
            duration(sum(self.clock.times)),
            best,
            self.mlflow_run,
            f" ({url})" if url else "",
            "; registered as " + ", ".join(f"models:/{self.run_id}@{a}" for a in models) if models else "",
        )
        return {
            "models": {alias: f"models:/{self.run_id}@{alias}" for alias in models},
            "run_id": self.run_id,
            "run_dir": str(run.root),
            "mlflow_run_id": self.mlflow_run,
            "mlflow_url": url,
            "last_iteration": k,
            "best_step": best,
            "metrics": final,
        }


def run_description(
    cfg: RagenConfig,
    run: RunDir,
    run_id: str,
    last: int,
    best: int | None,
    flow_run: tuple[str, str] | None = None,
) -> str:
    """The MLflow run's description (markdown, the run page's top): what ran, the Prefect flow run that
    ran it (``flow_run``: name, UI address), and the validation table: success per validation tag at
    each evaluated step, held-out tags marked, the best step's row in bold."""
    algo = cfg.learner.algorithm
    model = cfg.model.imported or cfg.model.path or "the tiny local model (built from environment text)"
    warm = " after an SFT warm start" if cfg.sft is not None else ""
    lines = [
        f"**{run_id}**: {algo.adv_estimator.upper()} (StarPO{'-S' if not cfg.rollout.filter.keeps_everything() else ''}) "
        f"on {', '.join(cfg.train.tags)} with {model}{warm}, {last} of {cfg.trainer.iterations} iterations "
        f"({sum(cfg.train.n_groups)} groups x {cfg.train.group_size} per iteration).",
    ]
    if flow_run is not None:
        lines += ["", f"Prefect flow run: [{flow_run[0]}]({flow_run[1]})"]
    table = validation_table(cfg, run, last, best)
    if table:
        lines += ["", "Validation success per tag:", "", *table]
    if best is not None:
        lines += [
            "",
            f"Best step: {best} (registered as `models:/{run_id}@best`: a version of the model "
            f"`{registry_name(run.info())}`, alias `{run_alias(run_id, 'best')}`)",
        ]
    return "\n".join(lines)


def validation_table(cfg: RagenConfig, run: RunDir, last: int, best: int | None) -> list[str]:
    """A markdown table of the validation success per tag (columns) at each evaluated step up to
    ``last`` (rows), from the run folder; no lines when no step was evaluated."""
    rows: list[tuple[int, dict[str, Any]]] = [
        (s, run.read_json(run.eval_metrics_file(s)))
        for s in range(0, last + 1)
        if run.eval_metrics_file(s).exists()
    ]
    tags = [t for t in dict.fromkeys(cfg.val.tags) if any(f"val-env/{t}/success" in m for _, m in rows)]
    if not tags:
        return []
    head = [t + ("" if t in cfg.train.tags else " (held out)") for t in tags]
    out = ["| step | " + " | ".join(head) + " |", "|---:|" + "---:|" * len(tags)]
    for step, metrics in rows:
        cells = [
            f"{metrics[f'val-env/{t}/success']:.3f}" if f"val-env/{t}/success" in metrics else "-"
            for t in tags
        ]
        label = f"**{step}** (best)" if step == best else str(step)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def git_commit() -> str:
    """The code's git commit (``unknown`` outside a checkout): the ``mlflow.source.git.commit`` tag."""
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_summary_markdown(cfg: RagenConfig, run: RunDir, result: Mapping[str, Any]) -> str:
    """The end-of-run summary a flow run shows (Prefect's artifacts tab): validation success per tag at
    the first, best and last validated steps, the best step, and where the run folder, the MLflow run
    and the registered models are. ``result`` is :meth:`Training.finish`'s."""
    run_id, last, best = result["run_id"], int(result["last_iteration"]), result["best_step"]
    lines = [
        f"## Run `{run_id}`",
        "",
        f"{last} of {cfg.trainer.iterations} iterations; "
        + (f"best step **{best}** (highest validation success)." if best is not None else "never validated."),
        "",
    ]
    steps = [s for s in range(0, last + 1) if run.eval_metrics_file(s).exists()]
    if steps:
        shown = list(dict.fromkeys([steps[0], *([best] if best is not None else []), steps[-1]]))
        evals = {s: run.read_json(run.eval_metrics_file(s)) for s in shown}
        names = {steps[0]: "first", steps[-1]: "last", **({best: "best"} if best is not None else {})}
        header = " | ".join(f"step {s} ({names[s]})" for s in shown)
        lines += [f"| validation success | {header} |", "| --- |" + " ---: |" * len(shown)]
        for tag in dict.fromkeys(cfg.val.tags):
            held_out = "" if tag in cfg.train.tags else " (held out)"
            cells = [evals[s].get(f"val-env/{tag}/success") for s in shown]
            row = " | ".join("-" if v is None else f"{v:.3f}" for v in cells)
            lines.append(f"| {tag}{held_out} | {row} |")
        lines.append("")
    lines.append(f"- run folder: `{result['run_dir']}`")
    mlflow_run, url = result.get("mlflow_run_id"), result.get("mlflow_url")
    if mlflow_run:
        lines.append(f"- MLflow run: [{mlflow_run}]({url})" if url else f"- MLflow run: `{mlflow_run}`")
    else:
        lines.append("- MLflow run: none (tracking was off or the store was unreachable)")
    for alias, uri in (result.get("models") or {}).items():
        lines.append(f"- {alias} model: `{uri}`")
    return "\n".join(lines) + "\n"
