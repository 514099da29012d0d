"""Evaluate any policy (a run's checkpoint, a saved model folder, or a cached Hugging Face model)
on any validation tags, e.g. the paper's generalisation tags.

``evaluate`` is the Prefect flow a user runs (``ragen evaluate``, or a deployment): it only composes
the tasks of ``tasks.evaluation`` (plan -> play -> log to MLflow); the work is
``ragen_core.run.evaluation``'s.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.reporting import artifact_key, env_tags, name_flow_run, progress_logger
from flows.settings import configure_environment
from ragen_core.run.evaluation import (
    EvaluateRequest,
    Policy,
    evaluation_markdown,
    evaluation_result,
    tag_rows,
)
from tasks.evaluation import in_flow_run, log_task, plan_task, play_task


@flow(name="ragen-evaluate", flow_run_name="evaluate/{request.policy}")
def evaluate(request: EvaluateRequest) -> dict[str, object]:
    """Evaluate ``request.policy`` on its tags; returns the metrics, the rows per tag (trained-on tags
    apart from held-out ones), the output folder and the MLflow run."""
    state = configure_environment()
    log = progress_logger()
    request, policy, plan = in_flow_run(plan_task)(request)  # an unknown run, model or tag fails here
    name_flow_run(None, log, tags=evaluation_tags(policy, request))
    played = in_flow_run(play_task)(request, policy, plan, str(state), log)
    logged = in_flow_run(log_task)(request, policy, plan, played, str(state))
    rows = tag_rows(policy, list(request.tags or []), played["metrics"])
    evaluation_artifact(policy, rows, request, logged.run_id, played["out_dir"])
    return evaluation_result(policy, Path(played["out_dir"]), played["metrics"], rows, logged)


def evaluation_tags(policy: Policy, request: EvaluateRequest) -> list[str]:
    """The evaluate flow run's Prefect tags: ``ragen``, ``evaluation``, ``env:<tag>`` per evaluated tag
    and, for a run's policy, ``run:<run id>`` (the training flow run is ``train/<run id>``)."""
    out = ["ragen", "evaluation", *env_tags(request.tags or [])]
    if policy.run_dir is not None:
        out.append(f"run:{policy.run_dir.name}")
    return out


def evaluation_artifact(
    policy: Policy,
    rows: list[dict[str, object]],
    request: EvaluateRequest,
    mlflow_run: str | None,
    out_dir: str,
) -> None:
    """The evaluation's summary, markdown artifact ``evaluation-<label>`` on the flow run (none outside
    a flow run: a flow's ``.fn`` called directly has no flow run to attach it to)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    create_markdown_artifact(
        evaluation_markdown(policy.label, rows, request.n_per_tag, mlflow_run, out_dir, policy.run_dir),
        key=artifact_key("evaluation", policy.label),
        description=f"success per tag of {policy.label}",
    )
