"""The training flow: warm start, then reproducible iterations, tracked in MLflow.

``train`` is the Prefect flow a user runs (``ragen train``, or a deployment from ``prefect.yaml``);
each iteration groups four tasks (rollout -> filter -> learn -> evaluate), as a parent task run that
nests them (``trainer.iteration_as: task``, the default for every config: no API round trips) or as a
subflow of its own (``subflow``: a flow-run page per iteration). This module only composes:
the stages are ``ragen_core.run.stages`` (as the tasks of ``tasks.stages``), and the loop with its
decisions (resume, re-logging, Echo-Trap stop and rollback, best step) is ``ragen_core.run.training``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Literal

import prefect.runtime
from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, get_run_context
from prefect.futures import PrefectFuture
from prefect.settings import temporary_settings
from pydantic import BaseModel, Field

from flows.reporting import (
    PrefectObserver,
    flow_run_url,
    link_mlflow_run,
    name_flow_run,
    progress_logger,
    report_artifact,
    train_tags,
)
from flows.service_watch import watch_prefect_server
from flows.settings import configure_environment, deprioritise_ephemeral_server, ephemeral_server_pids
from ragen_core.config import RagenConfig
from ragen_core.run.run_dir import RunDir
from ragen_core.run.session import Session
from ragen_core.run.stages import (
    eval_due,
    finish_iteration,
    init_policy_stage,
    prune_checkpoints,
    rollout_ahead,
)
from ragen_core.run.training import Training, open_run, run_summary_markdown
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
    concurrency_limit: str | None = Field(
        default=None,
        description="hold a slot of this Prefect global concurrency limit while training (sweep members on "
        "workers: e.g. gpu); waits for a free slot first",
    )


@task(
    name="warm-start", task_run_name="warm-start", cache_policy=NO_CACHE, persist_result=False
)  # idempotent: it checks the folder
def warm_start_task(run_root: str) -> str:
    run = RunDir(run_root)
    return str(init_policy_stage(run.config(), run))


def play_ahead(run_root: str, k: int, session: Session) -> PrefectFuture[dict[str, Any]] | None:
    """Start the rollouts played during iteration ``k``'s update, if any (``stages.rollout_ahead``):
    a submitted task where the rollout worker and the learner are actors of their own, else played
    now, before the update (the same results, one after the other)."""
    ahead = rollout_ahead(session.cfg, k)
    if ahead is None:
        return None
    task = rollout_task.with_options(task_run_name=f"rollout-ahead-{ahead}")
    if session.parallel_actors:
        return task.submit(run_root, ahead)
    task(run_root, ahead)
    return None


def run_iteration(run_root: str, k: int) -> dict[str, float]:
    """One iteration: rollout -> filter -> learn (+ checkpoint) -> evaluate when due; then DONE.

    One-step off-policy (``trainer.off_policy_steps: 1``): the next iteration's rollouts are played
    during the learn stage, by the policy before it (stored, so the next iteration reuses them)."""
    run = RunDir(run_root)
    session = session_for(run)
    cfg = session.cfg
    rollout = rollout_task(run_root, k)
    kept = filter_task(run_root, k)
    playing = play_ahead(run_root, k, session)
    try:
        learned = learn_task(run_root, k, kept["kept"])
    finally:  # never left running past its iteration, where a rebuilt session could meet it
        if playing is not None:
            playing.wait()
    if playing is not None:
        playing.result()
    metrics: dict[str, float] = {**rollout["metrics"], **kept["metrics"], **learned["metrics"]}
    if eval_due(cfg, k):
        metrics.update(evaluate_task(run_root, k)["metrics"])
    finish_iteration(run, k, metrics)
    prune_checkpoints(cfg, run, k)
    return metrics


def _iteration_name(parameters: dict[str, Any]) -> str:
    """``<run id>/iteration-<k>`` (the run folder is named after the run id; k as on disk and in MLflow)."""
    return f"{Path(parameters['run_root']).name}/iteration-{parameters['k']}"


#: An iteration as a flow run of its own (``trainer.iteration_as: subflow``) ...
iteration_flow = flow(
    name="ragen-iteration", flow_run_name=lambda: _iteration_name(prefect.runtime.flow_run.parameters)
)(run_iteration)
#: ... or as a parent task run nesting the stage tasks (``task``, the default): Prefect orchestrates task runs on
#: the client, so this costs no API round trips; the stage tasks' caching decides what reruns.
iteration_task = task(
    name="ragen-iteration",
    task_run_name=lambda: _iteration_name(prefect.runtime.task_run.parameters),
    cache_policy=NO_CACHE,
    persist_result=False,
)(run_iteration)


def iteration_runner(cfg: RagenConfig) -> Any:
    """The iteration callable ``trainer.iteration_as`` asks for."""
    return iteration_task if cfg.trainer.iteration_as == "task" else iteration_flow


@flow(name="ragen-train", flow_run_name="train", result_serializer="json")
def train(request: TrainRequest | None = None) -> dict[str, Any]:
    """Train (or resume) a run; returns its run id, MLflow run id and final metrics.

    Everything that can be checked is checked before anything is written, and the run stays locked
    until the flow returns (``ragen_core.run.training.open_run``); the loop's decisions (where to start,
    what to re-log, when to stop or roll back, the best step) are the library's (``Training``).
    """
    request = request or TrainRequest()
    with slot_of(request.concurrency_limit):
        return _train(request)


#: seconds a member's slot outlives its process (renewed by a live one well before it runs out)
SLOT_LEASE_S = 60.0


def slot_of(limit: str | None) -> contextlib.AbstractContextManager[Any]:
    """One slot of the Prefect global concurrency limit ``limit`` (none: no limit), renewed while held.

    The lease is short (Prefect's default is 5 minutes): when a member's process dies without giving
    its slot back (a worker killed), the server frees it when the lease runs out, and a member
    dispatched again must not wait that long for it."""
    if limit is None:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    get_run_logger().info("waiting for a slot of concurrency limit %r", limit)
    return concurrency(limit, occupy=1, strict=True, lease_duration=SLOT_LEASE_S)


def _train(request: TrainRequest) -> dict[str, Any]:
    state = configure_environment()
    deprioritise_ephemeral_server()  # it records this flow's task runs; training should not wait on it
    watch_prefect_server(ephemeral_server_pids())  # a server that dies ends the run at once, named
    log = get_run_logger()
    opened = open_run(
        state,
        log,
        config=request.config,
        overrides=request.overrides,
        resume=request.resume,
        name=request.run_name,
        backend=request.backend,
    )
    with (
        opened as (run, cfg, tracker),
        Training(run, cfg, tracker, log, progress_logger(), PrefectObserver(run.root.name)) as training,
    ):
        run_tags = train_tags(cfg, run.info())
        name_flow_run(f"train/{training.run_id}", log, tags=run_tags)
        context = get_run_context()
        assert isinstance(context, FlowRunContext) and context.flow_run is not None  # this flow's run
        mlflow_run = training.start_tracking(
            request.parent_run_id,
            {"prefect.flow_run_id": str(context.flow_run.id)},
            (f"train/{training.run_id}", flow_run_url(str(context.flow_run.id))),
        )
        link_mlflow_run(training.run_id, tracker.run_url(mlflow_run), mlflow_run)
        # the run's task runs (and iteration subflows) carry its tags too: filterable alike
        with tags(*run_tags):
            warm_start_task(str(run.root))
            training.log_config()
            register_session(run, training.open_session(), training.rollouts_judged)
            try:
                last = training.catch_up(evaluate=lambda step: evaluate_task(str(run.root), step)["metrics"])
                iteration = iteration_runner(cfg)
                # Prefect's flow-run heartbeat thread rounds every subflow up to a whole second on exit;
                # iterations are tracked by their own DONE marks, so their subflows need no heartbeat.
                with temporary_settings(updates={"flows.heartbeat_frequency": None}):
                    last = training.iterate(lambda k: iteration(str(run.root), k), start=last)
                result = training.finish(last)
            finally:
                drop_session(run)
        report_artifact(
            run_summary_markdown(cfg, run, result),
            training.run_id,
            f"summary of run {training.run_id}: validation success, best step, where it is",
            prefix="summary",
        )
        return result
