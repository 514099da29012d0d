"""Prefect tasks: thin wrappers over ``ragen_core.pipeline`` stages.

Tasks take the run directory and an iteration and return paths and small metric dicts, so their
inputs hash. Cache keys combine the config hash, the stage, the iteration and the digests of the
upstream artifacts on disk (the policy a rollout used, the rollouts a learner step read), so
rerunning a finished iteration is a cache hit and changing an upstream artifact invalidates what
depends on it. The live rollout worker and learner are not task inputs: they are looked up in the
session registry of this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from ragen_core import pipeline
from ragen_core.pipeline import RunDir, Session, file_digest

_SESSIONS: dict[str, Session] = {}


def register_session(run: RunDir, session: Session) -> None:
    _SESSIONS[str(run.root.resolve())] = session


def session_for(run: RunDir) -> Session:
    key = str(run.root.resolve())
    if key not in _SESSIONS:
        raise RuntimeError(f"no live session for run {run.root}; start it through flows.train")
    return _SESSIONS[key]


def drop_session(run: RunDir) -> Session | None:
    return _SESSIONS.pop(str(run.root.resolve()), None)


def _key(stage: str, run_root: str, k: int, *inputs: Path) -> str | None:
    run = RunDir(run_root)
    digests = []
    for p in inputs:
        if not p.exists():
            return None  # an input is missing: no cache key, the task runs
        digests.append(file_digest(p)[:16])
    return ":".join([run.info().get("config_hash", "?"), stage, str(k), *digests])


def _learner_state(run: RunDir, k: int) -> Path:
    """What a learner step of iteration ``k`` starts from: the previous checkpoint (or the init policy)."""
    return run.init_policy if k == 1 else run.checkpoint(k - 1)


def _rollout_key(ctx: TaskRunContext, params: dict[str, Any]) -> str | None:
    run, k = RunDir(params["run_root"]), params["k"]
    return _key("rollout", params["run_root"], k, run.policy_after(k - 1))


def _filter_key(ctx: TaskRunContext, params: dict[str, Any]) -> str | None:
    run, k = RunDir(params["run_root"]), params["k"]
    return _key("filter", params["run_root"], k, run.rollouts(k))


def _learn_key(ctx: TaskRunContext, params: dict[str, Any]) -> str | None:
    run, k = RunDir(params["run_root"]), params["k"]
    return _key("learn", params["run_root"], k, _learner_state(run, k), run.rollouts(k), run.filter_file(k))


def _eval_key(ctx: TaskRunContext, params: dict[str, Any]) -> str | None:
    run, step = RunDir(params["run_root"]), params["step"]
    return _key("evaluate", params["run_root"], step, run.policy_after(step))


def _ray_actor_lost(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only when a Ray actor or worker died (a retry can help), never on a config error."""
    try:
        state.result()
    except Exception as exc:
        return type(exc).__name__ in {"RayActorError", "ActorDiedError", "WorkerCrashedError",
                                      "ActorUnavailableError", "NodeDiedError"}
    return False


@task(name="rollout", cache_key_fn=_rollout_key, retries=1, retry_condition_fn=_ray_actor_lost)
def rollout_task(run_root: str, k: int) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    session.restore(k - 1)
    path, metrics = pipeline.rollout_stage(session.cfg, run, k, session)
    return {"path": str(path), "metrics": metrics}


@task(name="filter", cache_key_fn=_filter_key)
def filter_task(run_root: str, k: int) -> dict[str, Any]:
    run = RunDir(run_root)
    kept, metrics = pipeline.filter_stage(session_for(run).cfg, run.rollouts(k), run.filter_file(k))
    return {"kept": kept, "metrics": metrics}


@task(name="learn", cache_key_fn=_learn_key, retries=1, retry_condition_fn=_ray_actor_lost)
def learn_task(run_root: str, k: int, kept: list[int]) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    session.restore(k - 1)
    metrics = pipeline.learn_stage(session.cfg, run, k, session, run.rollouts(k), kept)
    return {"path": str(run.checkpoint(k)), "metrics": metrics}


@task(name="evaluate", cache_key_fn=_eval_key, retries=1, retry_condition_fn=_ray_actor_lost)
def evaluate_task(run_root: str, step: int) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    session.restore(step)
    path, metrics = pipeline.evaluate_stage(session.cfg, run, step, session)
    return {"path": str(path), "metrics": metrics}
