"""Prefect tasks of the evaluate flow: thin wrappers over ``ragen_core.run.evaluation``.

As the stage tasks (``tasks.stages``), they keep no Prefect cache and persist no result; the play
task returns the paths it wrote and the metrics. The flow's logger is passed in, so the progress
lines of a play reach the terminal and the flow run's logs as they did before the flow had tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from ragen_core.run import evaluation
from ragen_core.run.evaluation import Budget, EvaluateRequest, LoggedEvaluation, Policy

P = ParamSpec("P")
R = TypeVar("R")


def in_flow_run(step: Task[P, R]) -> Callable[P, R]:
    """``step`` as a task run inside a flow run; outside one (the flow's ``.fn`` called directly, as
    unit tests do) its plain function, where a task run would start a temporary Prefect server."""
    from prefect.context import FlowRunContext

    return cast("Callable[P, R]", step) if FlowRunContext.get() is not None else step.fn


@task(name="evaluation-plan", cache_policy=NO_CACHE, persist_result=False)
def plan_task(request: EvaluateRequest) -> tuple[EvaluateRequest, Policy, list[Budget]]:
    return evaluation.plan_evaluation(request)


@task(name="evaluation-play", cache_policy=NO_CACHE, persist_result=False)
def play_task(
    request: EvaluateRequest, policy: Policy, plan: list[Budget], state: str, log: Any
) -> dict[str, Any]:
    table, metrics = evaluation.play(request, policy, plan, log)
    out, path = evaluation.write_evaluation(request, Path(state), policy.label, table, metrics)
    return {"out_dir": str(out), "path": str(path), "metrics": metrics}


@task(name="evaluation-log", cache_policy=NO_CACHE, persist_result=False)
def log_task(
    request: EvaluateRequest, policy: Policy, plan: list[Budget], played: dict[str, Any], state: str
) -> LoggedEvaluation:
    return evaluation.log_evaluation(
        request, policy, plan, played["metrics"], Path(played["path"]), Path(state)
    )
