"""Rerun one stage of one iteration of a finished run from what is on disk, and compare."""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from flows.settings import configure_environment
from ragen_core.errors import RagenError
from ragen_core.run.rerun import rerun_stage
from ragen_core.run.run_dir import RunDir, find_run


class RerunError(RagenError):
    """A rerun that cannot be done (no such iteration or stage); the message says which exist."""


class RerunRequest(BaseModel):
    run: str = Field(description="run id or run directory")
    iteration: int = Field(ge=0, description="iteration to rerun (evaluate: the step)")
    stage: Literal["rollout", "learn", "evaluate"] = "learn"
    out_dir: str | None = Field(default=None, description="default: <run>/reruns/iter_<k>")


def check_rerun(run: RunDir, k: int, stage: str) -> None:
    """Raise :class:`RerunError` unless iteration ``k`` of ``run`` is stored with its ``stage``.

    Step 0 is the policy before training: it has an evaluation but no rollout or learner step.
    """
    last = run.last_complete()
    choose = f"use --iteration 1..{last}" if last else "the run has no complete iteration yet"
    if k == 0 and stage != "evaluate":
        raise RerunError(
            f"iteration 0 has no {stage} stage: iterations start at 1, and step 0 (the policy "
            f"before training) can only be evaluated (--stage evaluate); {choose}"
        )
    if k > last:
        raise RerunError(
            f"iteration {k} of run {run.root.name} is not complete (last complete: {last}); {choose}"
        )


@flow(name="ragen-rerun", flow_run_name="rerun/{request.run}/iteration-{request.iteration}/{request.stage}")
def rerun(request: RerunRequest) -> dict[str, object]:
    configure_environment()
    run = find_run(request.run)
    check_rerun(run, request.iteration, request.stage)
    result = rerun_stage(run, request.iteration, request.stage, request.out_dir)
    get_run_logger().info("%s of iteration %d: %s", request.stage, request.iteration, result.detail)
    return {
        "stage": result.stage,
        "iteration": result.k,
        "output": str(result.output),
        "stored": str(result.stored),
        "identical": result.identical,
        "detail": result.detail,
    }
