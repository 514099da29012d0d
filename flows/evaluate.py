"""Evaluate any policy (a run's checkpoint, a saved model folder, or a cached Hugging Face model)
on any validation tags, e.g. the paper's generalisation tags."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from flows.settings import configure_environment
from ragen_core.env_groups import EnvGroupsConfig
from ragen_core.pipeline import RunDir, atomic_write_text, find_run
from ragen_core.protocol import ProtocolConfig
from ragen_core.trajectory import write_table


class EvaluateRequest(BaseModel):
    policy: str = Field(description="RUN_ID[@STEP] (default: last step), a model folder, or a cached HF name")
    tags: list[str] = Field(default_factory=lambda: ["SimpleSokoban"], description="validation tags")
    n_per_tag: int = Field(default=64, ge=1, description="validation seeds per tag")
    temperature: float = Field(default=0.5, ge=0.0)
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: the run's, else 100")
    seed: int = 0
    out_dir: str | None = Field(default=None, description="default: .state/evals/<name>-<time>")
    log_to_mlflow: bool = True
    engine: Literal["hf", "vllm"] = Field(default="hf", description="rollout backend")


def _resolve_policy(spec: str) -> tuple[Path | str, ProtocolConfig, int | None, str]:
    """(policy path or name, protocol, max_new_tokens, label) for a run reference or a model."""
    name, _, step = spec.partition("@")
    try:
        run = find_run(name)
    except FileNotFoundError:
        return spec, ProtocolConfig(), None, Path(spec).name or spec
    cfg = run.config()
    k = int(step) if step else run.last_complete()
    return RunDir(run.root).policy_after(k), cfg.agent, cfg.rollout.max_new_tokens, f"{run.root.name}@{k}"


@flow(name="ragen-evaluate", flow_run_name="evaluate")
def evaluate(request: EvaluateRequest) -> dict[str, object]:
    state = configure_environment()
    from ragen_core.rollout.worker import RolloutWorker

    policy, protocol, max_new, label = _resolve_policy(request.policy)
    val = EnvGroupsConfig(tags=request.tags, n_groups=[request.n_per_tag] * len(request.tags), group_size=1)
    worker = RolloutWorker(str(policy), protocol.model_dump(), val.model_dump(), val.model_dump(),
                           engine=request.engine)
    params = {"temperature": request.temperature, "top_p": 1.0, "top_k": -1,
              "max_new_tokens": request.max_new_tokens or max_new or 100}
    t0 = time.perf_counter()
    try:
        table, env_metrics = worker.rollout("val", 0, params, request.seed, label)
    finally:
        worker.close()
    metrics = {f"val-env/{k}": v for k, v in env_metrics.items()}
    metrics["timing_s/testing"] = time.perf_counter() - t0
    out = Path(request.out_dir or state / "evals" / f"{label.replace('/', '_')}-{int(time.time())}")
    path = write_table(table, out / "eval.parquet")
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True))
    log = get_run_logger()
    for tag in request.tags:
        log.info("%s: success %.3f", tag, metrics.get(f"val-env/{tag}/success", float("nan")))
    mlflow_run = None
    if request.log_to_mlflow:
        from ragen_core.tracking import Tracker, TrackingConfig

        tracker = Tracker(TrackingConfig(experiment="ragen-flow-eval"), state)
        mlflow_run = tracker.start(f"eval-{label}", request.model_dump(), tags={"ragen.policy": str(policy)})
        tracker.log_iteration(0, metrics)
        tracker.log_artifact(path, "eval")
        tracker.end()
    return {"policy": str(policy), "out_dir": str(out), "metrics": metrics, "mlflow_run_id": mlflow_run}
