"""The training flow: warm start, then reproducible iterations, tracked in MLflow.

``train`` is the Prefect flow a user runs (``ragen train``, or a deployment from ``prefect.yaml``);
each iteration groups four tasks (rollout -> filter -> learn -> evaluate), as a subflow of its own
(``trainer.iteration_as: subflow``, the default) or as a parent task run that nests them (``task``:
no API round trips, for tiny configs whose iterations take a second). The library does the work
(``ragen_core.stages``); this module adds orchestration, caching, retries, tracking and the
Echo-Trap monitor. Metrics reach MLflow only after the iteration's ``metrics.json`` and DONE mark
are on disk (from a background thread, while the next iteration runs; in order, and flushed before
the run ends), and logging is idempotent per step, so a killed run resumes with no iteration lost,
duplicated or double-logged.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import prefect.runtime
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.settings import temporary_settings
from pydantic import BaseModel, Field

from flows.reporting import IterationClock, duration, iteration_line, progress_logger
from flows.settings import configure_environment
from ragen_core.config import DEFAULT_CONFIG, RagenConfig, config_hash, dump_config, flatten, load_config
from ragen_core.integrity import record
from ragen_core.model_import import model_provenance
from ragen_core.monitor import EchoTrapMonitor
from ragen_core.preflight import preflight
from ragen_core.resume import resume_config
from ragen_core.run_dir import RunDir, create_run, find_run, run_name
from ragen_core.run_lock import RunLock
from ragen_core.session import Session
from ragen_core.stages import check_resumable, eval_due, finish_iteration, init_policy_stage
from ragen_core.tracking import BackgroundLog, Tracker
from ragen_core.trajectory import read_trajectories
from tasks.stages import (
    drop_session,
    evaluate_task,
    filter_task,
    learn_task,
    register_session,
    rollout_task,
    session_for,
)


class TrainRequest(BaseModel):
    """What to train (the Prefect UI shows this as a form)."""

    config: str | None = Field(
        default=None,
        description="YAML config file (a new run: default configs/bandit-tiny.yaml; "
        "with resume: only to check it is the run's own)",
    )
    overrides: list[str] = Field(default_factory=list, description="KEY=VALUE, e.g. trainer.iterations=3")
    resume: str | None = Field(default=None, description="run id (or run directory) to continue")
    run_name: str | None = Field(default=None, description="name prefix of a new run")
    parent_run_id: str | None = Field(default=None, description="MLflow parent run (sweeps)")
    backend: Literal["ray", "local"] | None = Field(default=None, description="overrides trainer.backend")


def _git_commit() -> str:
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


@task(name="warm-start", cache_policy=NO_CACHE, persist_result=False)  # idempotent: it checks the folder
def warm_start_task(run_root: str) -> str:
    run = RunDir(run_root)
    return str(init_policy_stage(run.config(), run))


def run_iteration(run_root: str, k: int) -> dict[str, float]:
    """One iteration: rollout -> filter -> learn (+ checkpoint) -> evaluate when due; then DONE."""
    run = RunDir(run_root)
    cfg = session_for(run).cfg
    rollout = rollout_task(run_root, k)
    kept = filter_task(run_root, k)
    learned = learn_task(run_root, k, kept["kept"])
    metrics: dict[str, float] = {**rollout["metrics"], **kept["metrics"], **learned["metrics"]}
    if eval_due(cfg, k):
        metrics.update(evaluate_task(run_root, k)["metrics"])
    finish_iteration(run, k, metrics)
    return metrics


def _iteration_name(parameters: dict[str, Any]) -> str:
    """``<run id>/iteration-<k>`` (the run folder is named after the run id; k as on disk and in MLflow)."""
    return f"{Path(parameters['run_root']).name}/iteration-{parameters['k']}"


#: An iteration as a flow run of its own (``trainer.iteration_as: subflow``, the default) ...
iteration_flow = flow(
    name="ragen-iteration", flow_run_name=lambda: _iteration_name(prefect.runtime.flow_run.parameters)
)(run_iteration)
#: ... or as a parent task run nesting the stage tasks (``task``): Prefect orchestrates task runs on
#: the client, so this costs no API round trips; the stage tasks' caching decides what reruns.
iteration_task = task(
    name="ragen-iteration",
    task_run_name=lambda: _iteration_name(prefect.runtime.task_run.parameters),
    cache_policy=NO_CACHE,
    persist_result=False,
)(run_iteration)


def _name_flow_run(name: str, log: Any) -> None:
    """Rename this flow run once its run id is known (before that, Prefect shows ``train``). A name
    is a convenience: an API that refuses it costs a warning, not the run."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(get_run_context().flow_run.id, name=name)
    except (httpx.HTTPError, PrefectHTTPStatusError, OSError) as exc:
        log.warning("could not name the Prefect flow run %r: %s", name, exc)


def iteration_runner(cfg: RagenConfig) -> Any:
    """The iteration callable ``trainer.iteration_as`` asks for."""
    return iteration_task if cfg.trainer.iteration_as == "task" else iteration_flow


def _transcripts(path: Path, n: int) -> list[dict[str, Any]]:
    rows = []
    for t in read_trajectories(path)[:n]:
        rows.append(
            {
                "env_tag": t.env_tag,
                "seed": t.seed,
                "success": t.success,
                "score": t.score,
                "turns": t.turn_count,
                "actions": t.actions,
                "transcript": "\n".join(f"<{m['role']}> {m['content']}" for m in t.messages[1:]),
            }
        )
    return rows


def _log_step(tracker: Tracker, run: RunDir, cfg: RagenConfig, k: int, metrics: dict[str, float]) -> None:
    """Log one step's artifacts, then its metrics with the step's ``iteration`` marker (idempotent per
    step): a tracking server lost in between leaves the step unmarked, so a resume logs it whole."""
    if k in tracker.logged_steps:
        return
    if cfg.tracking.log_artifacts:
        if k > 0 and run.rollouts(k).exists():
            tracker.log_artifact(run.rollouts(k), f"rollouts/iter_{k:04d}")
            # Per-iteration JSON only: appending to the MLflow table re-uploads it whole each time.
            tracker.log_transcripts(
                _transcripts(run.rollouts(k), cfg.tracking.transcripts_per_iteration),
                k,
                append_table=k == cfg.trainer.iterations,
            )
        if run.eval_file(k).exists():
            tracker.log_artifact(run.eval_file(k), "eval")
    tracker.log_iteration(k, metrics)


@flow(name="ragen-train", flow_run_name="train", result_serializer="json")
def train(request: TrainRequest | None = None) -> dict[str, Any]:
    """Train (or resume) a run; returns its run id, MLflow run id and final metrics.

    Everything that can be checked (config, overrides, run name, machine, tracking server, the run
    lock) is checked before anything is written; a resume accepts only what ``ragen_core.resume``
    allows. The run stays locked (``ragen_core.run_lock``) until the flow returns.
    """
    request = request or TrainRequest()
    state = configure_environment()
    log = get_run_logger()
    lock = None
    if request.resume:
        run = find_run(request.resume)
        lock = RunLock(run.root).acquire()
        try:
            cfg, changes = resume_config(
                run.root, run.config(), check_resumable(run), request.config, request.overrides
            )
        except BaseException:
            lock.release()
            raise
    else:
        config = request.config or DEFAULT_CONFIG
        cfg = load_config(config, request.overrides)
        preflight(cfg)
        name, changes = run_name(cfg, request.run_name, config), {}
    try:
        tracker = Tracker(cfg.tracking, state)  # an unreachable server fails here, before a run folder exists
        if lock is None:
            run = create_run(cfg, name)
            lock = RunLock(run.root).acquire()
        elif changes:
            record(dump_config(cfg, run.config_path))
            run.update_info(
                resumes=[
                    *run.info().get("resumes", []),
                    {"at": time.time(), "changes": {k: list(v) for k, v in changes.items()}},
                ]
            )
            log.info("resumed with %s", ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items()))
        return _train(request, state, run, cfg, tracker, log)
    finally:
        if lock is not None:
            lock.release()


def _train(  # noqa: C901 - the loop with its resume, monitor and rollback decisions, still to move into ragen_core
    request: TrainRequest, state: Path, run: RunDir, cfg: RagenConfig, tracker: Tracker, log: Any
) -> dict[str, Any]:
    if request.backend:
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"backend": request.backend})})
    info = run.info()
    log.info("run %s in %s", info["run_id"], run.root)
    _name_flow_run(f"train/{info['run_id']}", log)
    mlflow_run = tracker.start(
        info["run_id"],
        flatten(cfg),
        tags={
            "ragen.run_id": info["run_id"],
            "ragen.config_hash": config_hash(cfg),
            "ragen.run_dir": str(run.root.resolve()),
            "mlflow.source.git.commit": _git_commit(),
            "prefect.flow_run_id": str(get_run_context().flow_run.id),
            **model_provenance(cfg.model.source()),
        },
        run_id=info.get("mlflow_run_id"),
        parent_run_id=request.parent_run_id,
    )
    run.update_info(mlflow_run_id=mlflow_run)
    # An iteration's MLflow calls overlap the next iteration (in order; errors surface at the next one).
    background = BackgroundLog(cfg.tracking.background)
    session = None
    status = "FAILED"
    try:
        warm_start_task(str(run.root))
        if cfg.tracking.log_artifacts and "config.yaml" not in info.get("logged_artifacts", []):
            tracker.log_artifact(run.config_path)
            if tracker.offline is None:  # uploaded, not skipped by a tracker that lost its server
                run.update_info(logged_artifacts=["config.yaml"])
        session = Session(cfg, run, backend=cfg.trainer.backend)
        register_session(run, session)
        monitor = EchoTrapMonitor(cfg.monitor)
        last = run.last_complete()
        # Re-log what a killed run finished but did not log (log_iteration skips logged steps).
        if run.eval_metrics_file(0).exists():
            _log_step(tracker, run, cfg, 0, run.read_json(run.eval_metrics_file(0)))
        for k in range(1, last + 1):
            m = run.read_json(run.metrics_file(k))
            monitor.update(k, m)
            if (to := run.rolled_back_to(k)) is not None:
                monitor.reset_to(to)
            _log_step(tracker, run, cfg, k, m)
        if last == 0 and eval_due(cfg, 0) and not run.eval_metrics_file(0).exists():
            _log_step(tracker, run, cfg, 0, evaluate_task(str(run.root), 0)["metrics"])
        k = last
        progress = progress_logger()
        clock = IterationClock(cfg.trainer.iterations)
        if k < cfg.trainer.iterations:
            progress.info(
                "run %s: iterations %d-%d of %d (%s backend)%s",
                info["run_id"],
                k + 1,
                cfg.trainer.iterations,
                cfg.trainer.iterations,
                cfg.trainer.backend,
                f", resumed after iteration {k}" if k else "",
            )
        # Prefect's flow-run heartbeat thread rounds every subflow up to a whole second on exit;
        # iterations are tracked by their own DONE marks, so their subflows need no heartbeat.
        iteration = iteration_runner(cfg)
        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            while k < cfg.trainer.iterations:
                k += 1
                metrics = iteration(str(run.root), k)
                signals = monitor.update(k, metrics)
                if signals:
                    background.submit(
                        tracker.set_tags,
                        {f"echo_trap.{s.name}": f"step {s.step}: {s.message}" for s in signals},
                    )
                    metrics.update({f"monitor/{s.name}": 1.0 for s in signals})
                    for s in signals:
                        log.warning("Echo-Trap signal at iteration %d: %s", k, s.message)
                background.submit(_log_step, tracker, run, cfg, k, dict(metrics))
                progress.info(iteration_line(k, cfg.trainer.iterations, metrics, clock.lap(), clock.eta(k)))
                if monitor.should_stop:
                    background.submit(tracker.set_tags, {"echo_trap.action": f"stopped at iteration {k}"})
                    break
                if monitor.should_rollback:
                    to = monitor.rollback_step(range(0, k))
                    if to is not None:
                        log.warning("Echo-Trap: rolling back to the checkpoint of iteration %d", to)
                        record = session.roll_back(k, to, [s.name for s in monitor.triggered])
                        monitor.reset_to(to)
                        background.submit(
                            tracker.set_tags, {f"echo_trap.rollback_{monitor.rollbacks}": f"{k}->{to}"}
                        )
                        if cfg.tracking.log_artifacts:
                            background.submit(tracker.log_artifact, record, "rollbacks")
        background.flush()
        best, final_step = run.best_step(k), run.start_of(k + 1)  # where a last rollback went back to
        tracker.set_tags({"ragen.last_iteration": str(k), "ragen.best_step": str(best)})
        if cfg.tracking.log_artifacts:
            tracker.log_plots(run.root / "plots")
            if final_step > 0:
                tracker.log_artifacts(run.policy_after(final_step), "model/final")
            if best is not None:
                tracker.log_artifacts(run.policy_after(best), "model/best")
        status = "FINISHED"
        final = run.read_json(run.metrics_file(k)) if k > 0 else {}
        url = tracker.run_url(mlflow_run)
        progress.info(
            "run %s finished: %d iterations (%s in this process), best step %s; MLflow run %s%s",
            info["run_id"],
            k,
            duration(sum(clock.times)),
            best,
            mlflow_run,
            f" ({url})" if url else "",
        )
        return {
            "run_id": info["run_id"],
            "run_dir": str(run.root),
            "mlflow_run_id": mlflow_run,
            "mlflow_url": url,
            "last_iteration": k,
            "best_step": best,
            "metrics": final,
        }
    finally:
        background.close()
        if session is not None:
            drop_session(run)
            session.close()
        tracker.end(status)
        offline = tracker.offline_message(
            info["run_id"], run.root
        )  # MLflow went away mid-run: say what to do
        if offline:
            log.warning(offline)
