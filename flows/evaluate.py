"""Evaluate any policy (a run's checkpoint, a saved model folder, or a cached Hugging Face model)
on any validation tags, e.g. the paper's generalisation tags."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from prefect import flow
from pydantic import BaseModel, Field

from flows.reporting import progress_logger
from flows.settings import configure_environment
from ragen_core.checkpoint import verify_checkpoint
from ragen_core.env_groups import EnvGroupsConfig
from ragen_core.errors import RagenError
from ragen_core.progress import duration
from ragen_core.protocol import ProtocolConfig
from ragen_core.run_dir import RunDir, atomic_write_text, find_run
from ragen_core.stages import check_init_policy
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
    config: str | None = Field(
        default=None,
        description="a run config whose agent settings (turns, actions, "
        "thinking) and max_new_tokens to play with; default: the run's own, or for a "
        "model each tag's catalogue budgets",
    )


class EvaluateError(RagenError):
    """A policy or tags that cannot be evaluated; the message says what exists instead."""


def _spans(steps: list[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"``."""
    out: list[str] = []
    for i, k in enumerate(steps):
        if i and k == steps[i - 1] + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


def checkpoint_steps(run: RunDir) -> list[int]:
    """The steps of ``run`` with a saved policy (0: the starting policy, k: after iteration k)."""
    steps = [0] if run.policy_after(0).is_dir() else []
    for d in sorted(run.root.glob("iter_*")):
        k = d.name.removeprefix("iter_")
        if k.isdigit() and int(k) > 0 and run.policy_after(int(k)).is_dir():
            steps.append(int(k))
    return steps


def check_tags(tags: list[str]) -> None:
    from ragen_core.config import tag_problems

    if not tags:
        raise EvaluateError("--tags is empty; name at least one validation tag, e.g. --tags Bandit")
    problems = tag_problems(tags, "--tags")
    if problems:
        raise EvaluateError("\n".join(problems))


def resolve_policy(spec: str) -> tuple[Path | str, ProtocolConfig | None, int | None, str]:
    """(policy path or name, protocol, max_new_tokens, label) for a run reference or a model (which has
    no protocol or max_new_tokens of its own: None).

    ``RUN@STEP`` must name a run and a step it has a checkpoint of (the error lists them); anything
    else that is not a run is a model folder or a cached Hugging Face name.
    """
    name, at, step = spec.partition("@")
    try:
        run = find_run(name)
    except FileNotFoundError:
        if at and not Path(spec).exists():  # RUN@STEP: a run was meant; say why it was not found
            raise
        return spec, None, None, Path(spec).name or spec
    cfg = run.config()
    steps = checkpoint_steps(run)
    have = f"it has steps {_spans(steps)}" if steps else "it has no checkpoint yet"
    if at and not step.strip().isdigit():
        raise EvaluateError(f"{spec}: the step {step!r} is not a number; write {name}@STEP ({have})")
    k = int(step) if at else run.last_complete()
    if k not in steps:
        fix = f"; evaluate one of them, e.g. {name}@{steps[-1]}" if steps else ""
        raise EvaluateError(f"run {run.root.name} has no checkpoint at step {k}; {have}{fix}")
    if k == 0:  # the weights are checked against their recorded digests before anything loads them
        check_init_policy(run)
    else:
        verify_checkpoint(run.checkpoint(k))
    return run.policy_after(k), cfg.agent, cfg.rollout.max_new_tokens, f"{run.root.name}@{k}"


class Budget(BaseModel):
    """Tags played with one agent protocol and one response length."""

    tags: list[str]
    protocol: ProtocolConfig
    max_new_tokens: int


def budgets(request: EvaluateRequest, protocol: ProtocolConfig | None, max_new: int | None) -> list[Budget]:
    """How each tag is played: with ``--config``'s agent settings, else the run's own, else (a model
    folder) each tag's catalogue budget (turns, response length); ``--max-new-tokens`` wins."""
    from envs.registry import spec
    from ragen_core.config import load_config

    if request.config is not None:
        cfg = load_config(request.config, [])
        protocol, max_new = cfg.agent, cfg.rollout.max_new_tokens
    if protocol is not None:
        return [
            Budget(
                tags=request.tags, protocol=protocol, max_new_tokens=request.max_new_tokens or max_new or 100
            )
        ]
    out: dict[tuple[int, int], Budget] = {}
    for tag in request.tags:
        s = spec(tag)
        key = (s.max_turn, request.max_new_tokens or s.max_tokens)
        if key not in out:
            out[key] = Budget(tags=[], protocol=ProtocolConfig(max_turn=s.max_turn), max_new_tokens=key[1])
        out[key].tags.append(tag)
    return list(out.values())


@flow(name="ragen-evaluate", flow_run_name="evaluate/{request.policy}")
def evaluate(request: EvaluateRequest) -> dict[str, object]:
    state = configure_environment()
    import pyarrow as pa

    from ragen_core.rollout.worker import RolloutWorker

    check_tags(request.tags)
    policy, protocol, max_new, label = resolve_policy(request.policy)
    plan = budgets(request, protocol, max_new)
    log = progress_logger()
    worker = None
    tables, env_metrics = [], {}
    t0 = time.perf_counter()
    try:
        for b in plan:
            val = EnvGroupsConfig(tags=b.tags, n_groups=[request.n_per_tag] * len(b.tags), group_size=1)
            if worker is None:
                worker = RolloutWorker(
                    str(policy),
                    b.protocol.model_dump(),
                    val.model_dump(),
                    val.model_dump(),
                    engine=request.engine,
                )
            else:
                worker.set_groups("val", b.protocol.model_dump(), val.model_dump())
            log.info(
                "playing %s: %d episodes each, %d turn(s), %d new tokens per turn",
                ",".join(b.tags),
                request.n_per_tag,
                b.protocol.max_turn,
                b.max_new_tokens,
            )
            params = {
                "temperature": request.temperature,
                "top_p": 1.0,
                "top_k": -1,
                "max_new_tokens": b.max_new_tokens,
            }
            table, m = worker.rollout("val", 0, 0, params, request.seed, label)
            tables.append(table)
            env_metrics.update({k: v for k, v in m.items() if k != "success"})
            for tag in b.tags:
                log.info(
                    "%s: success %.3f (%s)", tag, m[f"{tag}/success"], duration(time.perf_counter() - t0)
                )
    finally:
        if worker is not None:
            worker.close()
    # every tag has n_per_tag episodes: the mean over episodes is the mean over tags
    env_metrics["success"] = sum(env_metrics[f"{t}/success"] for t in request.tags) / len(request.tags)
    table = pa.concat_tables(tables)
    metrics = {f"val-env/{k}": v for k, v in env_metrics.items()}
    metrics["timing_s/testing"] = time.perf_counter() - t0
    out = Path(request.out_dir or state / "evals" / f"{label.replace('/', '_')}-{int(time.time())}")
    path = write_table(table, out / "eval.parquet")
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True))
    mlflow_run = None
    if request.log_to_mlflow:
        from ragen_core.tracking import Tracker, TrackingConfig

        tracker = Tracker(TrackingConfig(experiment="ragen-flow-eval"), state)
        params = {**request.model_dump(), "budgets": [b.model_dump() for b in plan]}
        mlflow_run = tracker.start(f"eval-{label}", params, tags={"ragen.policy": str(policy)})
        tracker.log_iteration(0, metrics)
        tracker.log_artifact(path, "eval")
        tracker.end()
    return {"policy": str(policy), "out_dir": str(out), "metrics": metrics, "mlflow_run_id": mlflow_run}
