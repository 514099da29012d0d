"""Rerun one stage of one iteration of a finished run from what is on disk, and compare."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import BaseModel, Field

from flows.reporting import env_tags, name_flow_run, prefect_only_logger, report_artifact
from flows.settings import configure_environment
from ragen_core.run.rerun import log_rerun, rerun_markdown, rerun_stage
from ragen_core.run.rerun_checks import RerunError, check_rerun
from ragen_core.run.run_dir import find_run

__all__ = ["RerunError", "RerunRequest", "check_rerun", "rerun"]


class RerunRequest(BaseModel):
    run: str = Field(description="run id or run directory")
    iteration: int = Field(ge=0, description="iteration to rerun (evaluate: the step)")
    stage: Literal["rollout", "learn", "evaluate"] = "learn"
    out_dir: str | None = Field(default=None, description="default: <run>/reruns/iter_<k>")


@flow(name="ragen-rerun", flow_run_name="rerun/{request.run}/iteration-{request.iteration}/{request.stage}")
def rerun(request: RerunRequest) -> dict[str, object]:
    state = configure_environment()
    run = find_run(request.run)
    check_rerun(run, request.iteration, request.stage)
    log = prefect_only_logger()  # the CLI prints the verdict itself
    cfg = run.config()
    name_flow_run(
        None,
        log,
        tags=["ragen", "rerun", f"stage:{request.stage}", f"run:{run.root.name}", *env_tags(cfg.train.tags)],
    )
    result = rerun_stage(run, request.iteration, request.stage, request.out_dir)
    log.info("%s of iteration %d: %s", request.stage, request.iteration, result.detail)
    mlflow_run = log_rerun(run, result, state)
    report_artifact(
        rerun_markdown(run.root.name, result, mlflow_run),
        f"{run.root.name}-iter-{result.k}-{result.stage}",
        f"verdict of the rerun of {result.stage} of iteration {result.k}",
        prefix="rerun",
    )
    return {
        "stage": result.stage,
        "iteration": result.k,
        "output": str(result.output),
        "stored": str(result.stored),
        "identical": result.identical,
        "verdict": result.verdict,
        "detail": result.detail,
        "mlflow_run_id": mlflow_run,
    }
