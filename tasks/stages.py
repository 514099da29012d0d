"""Prefect tasks: thin wrappers over the stages of ``ragen_core.run.stages``.

Tasks take the run directory and an iteration and return paths and small metric dicts. They keep
no Prefect cache and persist no result: whether a stage's stored output can be reused is decided
by the library from the run directory alone (``ragen_core.run.stage_record``: only this run's outputs,
only while they match their recorded digests and inputs), so a resumed run never takes another
run's result, and no pickled result is ever read back. The live rollout worker and learner are not
task inputs: they are looked up in the session registry of this process, beside what the run wants
told when an iteration's rollouts are judged (its MLflow logging starts then, while the learner
trains).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from ragen_core.errors import ray_actor_lost
from ragen_core.run import stages
from ragen_core.run.run_dir import RunDir
from ragen_core.run.session import Session

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State, TaskRun

_SESSIONS: dict[str, Session] = {}
_ROLLOUTS_JUDGED: dict[str, Callable[[int], None]] = {}


def register_session(
    run: RunDir, session: Session, rollouts_judged: Callable[[int], None] | None = None
) -> None:
    """The live session of ``run`` for its stage tasks; ``rollouts_judged(k)`` is called once the
    filter task of iteration ``k`` has decided (the rollouts are final from then on)."""
    key = str(run.root.resolve())
    _SESSIONS[key] = session
    if rollouts_judged is None:
        _ROLLOUTS_JUDGED.pop(key, None)  # not an earlier registration's
    else:
        _ROLLOUTS_JUDGED[key] = rollouts_judged


def session_for(run: RunDir) -> Session:
    key = str(run.root.resolve())
    if key not in _SESSIONS:
        raise RuntimeError(f"no live session for run {run.root}; start it through flows.train")
    return _SESSIONS[key]


def drop_session(run: RunDir) -> Session | None:
    key = str(run.root.resolve())
    _ROLLOUTS_JUDGED.pop(key, None)
    return _SESSIONS.pop(key, None)


def _ray_actor_lost(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only when a Ray actor or worker died (a retry can help), never on a config error."""
    try:
        state.result()
    except Exception as exc:
        return ray_actor_lost(exc)
    return False


# Every stage task: cache_policy=NO_CACHE, persist_result=False (no cache, no stored result: see the
# module docstring).
# Task runs are named after their iteration (``learn-3``), so Prefect's list of a run's task runs
# reads as the run's iterations, not as Prefect's random suffixes.
@task(
    name="rollout",
    task_run_name="rollout-{k}",
    retries=1,
    retry_condition_fn=_ray_actor_lost,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def rollout_task(run_root: str, k: int) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    path, metrics = stages.rollout_stage(session.cfg, run, k, session)
    return {"path": str(path), "metrics": metrics}


@task(name="filter", task_run_name="filter-{k}", cache_policy=NO_CACHE, persist_result=False)
def filter_task(run_root: str, k: int) -> dict[str, Any]:
    run = RunDir(run_root)
    kept, metrics = stages.filter_stage(session_for(run).cfg, run, k)
    judged = _ROLLOUTS_JUDGED.get(str(run.root.resolve()))
    if judged is not None:
        judged(k)
    return {"kept": kept, "metrics": metrics}


@task(
    name="learn",
    task_run_name="learn-{k}",
    retries=1,
    retry_condition_fn=_ray_actor_lost,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def learn_task(run_root: str, k: int, kept: list[int]) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    metrics = stages.learn_stage(session.cfg, run, k, session, kept)
    return {"path": str(run.checkpoint(k)), "metrics": metrics}


@task(
    name="evaluate",
    task_run_name="evaluate-step-{step}",
    retries=1,
    retry_condition_fn=_ray_actor_lost,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def evaluate_task(run_root: str, step: int) -> dict[str, Any]:
    run = RunDir(run_root)
    session = session_for(run)
    path, metrics = stages.evaluate_stage(session.cfg, run, step, session)
    return {"path": str(path), "metrics": metrics}
