"""Evaluating any policy (a run's checkpoint, a saved model folder, a cached Hugging Face model, a
registered ``models:/`` URI) on any validation tags, e.g. the paper's generalisation tags: what is
played (:func:`plan_evaluation`), the play (:func:`play`), its files (:func:`write_evaluation`), its
MLflow run (:func:`log_evaluation`) and its report per tag (:func:`tag_rows`).

``flows.evaluate`` composes these as the tasks of ``tasks.evaluation``. Success is reported per tag
only: an average over tags would mix a tag the policy trained on with a held-out one and hide the
generalisation gap the tags measure.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from ragen_core.env_groups import EnvGroupsConfig
from ragen_core.errors import RagenError
from ragen_core.learner.checkpoint import WEIGHTS_PRUNED, verify_checkpoint
from ragen_core.models.policy_ref import locate_policy
from ragen_core.models.weights_check import check_model_folder
from ragen_core.progress import duration
from ragen_core.protocol import ProtocolConfig
from ragen_core.run.run_dir import RunDir, atomic_write_text
from ragen_core.run.stages import check_init_policy
from ragen_core.trajectory import write_table

if TYPE_CHECKING:  # pragma: no cover
    import logging

    import pyarrow as pa

    from ragen_core.tracking.tracker import Tracker


class EvaluateRequest(BaseModel):
    policy: str = Field(description="RUN_ID[@STEP] (default: last step), a model folder, or a cached HF name")
    tags: list[str] | None = Field(
        default=None,
        description="validation tags; default: a run's own validation tags (val.tags), for a model "
        "SimpleSokoban",
    )
    n_per_tag: int = Field(default=64, ge=1, description="validation seeds per tag")
    temperature: float = Field(default=0.5, ge=0.0)
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: the run's, else 100")
    seed: int = 0
    out_dir: str | None = Field(default=None, description="default: .state/evals/<name>-<time>")
    log_to_mlflow: bool = True
    engine: Literal["hf", "vllm"] = Field(default="hf", description="rollout backend")
    config: str | None = Field(
        default=None,
        description="a run config whose agent settings (turns, actions, thinking), max_new_tokens and "
        "validation envs (val.env_overrides, val.seed) to play with; default: the run's own, or for a "
        "model each tag's catalogue defaults",
    )


#: The MLflow experiment of evaluations of model folders (a run's evaluations nest under its own run).
EVAL_EXPERIMENT = "ragen-flow-eval"
#: The tags a model folder (which has no validation tags of its own) is evaluated on by default.
MODEL_DEFAULT_TAGS = ["SimpleSokoban"]


class EvaluateError(RagenError):
    """A policy or tags that cannot be evaluated; the message says what exists instead."""


@dataclass(frozen=True)
class Policy:
    """A resolved policy reference: what to load, how to play it, and (a run) the tags it knows.

    ``train_tags`` / ``val_tags`` are None for a model folder or a cached model: nothing says what it
    was trained on, so no tag can be called held out.
    """

    path: Path | str
    protocol: ProtocolConfig | None
    max_new_tokens: int | None
    label: str
    train_tags: list[str] | None = None
    val_tags: list[str] | None = None
    #: a run's policy: the run directory (its evaluations are nested under its MLflow run) ...
    run_dir: Path | None = None
    #: ... and the MLflow LoggedModel of that step, when the run logged one (final, best) ...
    model_id: str | None = None
    #: ... and the step: the iterations the policy trained (0: before training), the step its
    #: evaluation's metrics are logged at, beside the training run's own validation of that step
    step: int | None = None
    #: ... and its validation envs: their settings (FrozenLake's is_slippery, Sokoban's directions)
    #: and base seed, so that an evaluation plays the envs the run validated on
    val_envs: EnvGroupsConfig | None = None

    def mlflow_run_name(self) -> str:
        """The evaluation's MLflow run name: a run's policy by its run and step (``eval-RUN@step30``,
        also when it was named by an alias such as ``@best``, since the runs of one training run are told
        apart by their step), anything else by its label."""
        if self.run_dir is not None and self.step is not None:
            return f"eval-{self.run_dir.name}@step{self.step}"
        return f"eval-{self.label}"

    def default_tags(self) -> list[str]:
        return list(self.val_tags) if self.val_tags else list(MODEL_DEFAULT_TAGS)

    def held_out(self, tag: str) -> bool | None:
        """Whether ``tag`` is one the policy was not trained on (None: unknown, a model)."""
        return None if self.train_tags is None else tag not in self.train_tags


# ---------------------------------------------------------------------------- what is played
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


def resolve_policy(spec: str) -> Policy:
    """The policy ``spec`` names: a run reference (with the run's protocol, max_new_tokens and tags) or
    a model (which has none of its own).

    An unknown reference fails at once (``ragen_core.models.policy_ref``: nothing heavy is loaded to find
    out); ``RUN@STEP`` must name a run and a step it has a checkpoint of (the error lists them).
    """
    ref = locate_policy(spec)
    if ref.kind == "registry":
        return _registered_policy(spec)
    if ref.kind == "model":
        check_model_folder(spec)  # a broken weight file is named here, before a model loads
        return Policy(spec, None, None, Path(spec).name or spec)
    name, at, step = spec.partition("@")
    run = RunDir(ref.source)
    cfg = run.config()
    steps = checkpoint_steps(run)
    have = f"it has steps {_spans(steps)}" if steps else "it has no checkpoint yet"
    if at and not step.strip().isdigit():
        raise EvaluateError(f"{spec}: the step {step!r} is not a number; write {name}@STEP ({have})")
    k = int(step) if at else run.last_complete()
    if k not in steps:
        fix = f"; evaluate one of them, e.g. {name}@{steps[-1]}" if steps else ""
        note = run.checkpoint(k) / WEIGHTS_PRUNED
        why = f" (its weights were {note.read_text(errors='replace').strip()})" if note.is_file() else ""
        raise EvaluateError(f"run {run.root.name} has no checkpoint at step {k}{why}; {have}{fix}")
    if k == 0:  # the weights are checked against their recorded digests before anything loads them
        check_init_policy(run)
    else:
        verify_checkpoint(run.checkpoint(k))
    return Policy(
        run.policy_after(k),
        cfg.agent,
        cfg.rollout.max_new_tokens,
        f"{run.root.name}@{k}",
        train_tags=list(cfg.train.tags),
        val_tags=list(cfg.val.tags),
        run_dir=run.root,
        model_id=run.info().get("logged_models", {}).get(str(k)),
        step=k,
        val_envs=cfg.val,
    )


def check_before_work(policy: Policy | None) -> None:
    """The state folder and the store the evaluation will log to, before a model loads: a damaged
    ``mlflow.db`` or run index, an unreachable tracking server (:class:`EvaluateError`, one line each)."""
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.run.state_checks import state_problems

    tracking = TrackingConfig(experiment=EVAL_EXPERIMENT)
    if policy is not None and policy.run_dir is not None:
        tracking = RunDir(policy.run_dir).config().tracking
    problems = state_problems(tracking)
    if problems:
        raise EvaluateError("cannot evaluate:\n  " + "\n  ".join(problems))


def _registered_policy(uri: str) -> Policy:
    """``models:/<run id>@best`` (or ``/<version>``): the registered LoggedModel's run and step when the
    run is on this machine (so it plays as that run does), else its downloaded files as a model."""
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.run.logged_models import ModelURIError, resolve_model_uri
    from ragen_core.state_folder import locate_run, models_dir, state_dir
    from ragen_core.tracking.tracker import Tracker

    try:
        got = resolve_model_uri(uri, Tracker(TrackingConfig(), state_dir()), models_dir() / "registry")
    except ModelURIError as e:
        raise EvaluateError(str(e)) from e
    if got.run_id and locate_run(got.run_id) is not None:
        policy = resolve_policy(f"{got.run_id}@{got.step}")
        return replace(policy, label=uri.removeprefix("models:/"), model_id=got.model_id)
    return Policy(got.folder, None, None, uri.removeprefix("models:/"), model_id=got.model_id)


class Budget(BaseModel):
    """Tags played with one agent protocol and one response length, on envs made with ``env_overrides``
    (tag -> settings; a tag without any plays the catalogue's defaults) from base seed ``seed`` (None: the
    validation default)."""

    tags: list[str]
    protocol: ProtocolConfig
    max_new_tokens: int
    env_overrides: dict[str, dict[str, Any]] = {}
    seed: int | None = None


def budgets(
    request: EvaluateRequest,
    protocol: ProtocolConfig | None,
    max_new: int | None,
    val_envs: EnvGroupsConfig | None = None,
) -> list[Budget]:
    """How each tag is played: with ``--config``'s agent settings and validation envs, else the run's own
    (``val_envs``), else (a model folder) each tag's catalogue budget (turns, response length) and
    defaults; ``--max-new-tokens`` wins. A run's FrozenLake validated without slips is evaluated without
    slips; a tag the validation envs do not set up (a held-out one) plays its catalogue defaults."""
    from envs.registry import spec
    from ragen_core.config import load_config

    tags = list(request.tags if request.tags is not None else MODEL_DEFAULT_TAGS)
    if request.config is not None:
        cfg = load_config(request.config, [])
        protocol, max_new, val_envs = cfg.agent, cfg.rollout.max_new_tokens, cfg.val
    if protocol is not None:
        max_new = request.max_new_tokens or max_new or 100
        return [Budget(tags=tags, protocol=protocol, max_new_tokens=max_new, **_envs_of(tags, val_envs))]
    by_budget: dict[tuple[int, int], list[str]] = {}
    for tag in tags:
        s = spec(tag)
        by_budget.setdefault((s.max_turn, request.max_new_tokens or s.max_tokens), []).append(tag)
    return [
        Budget(
            tags=group,
            protocol=ProtocolConfig(max_turn=turns),
            max_new_tokens=tokens,
            **_envs_of(group, val_envs),
        )
        for (turns, tokens), group in by_budget.items()
    ]


def _envs_of(tags: list[str], val_envs: EnvGroupsConfig | None) -> dict[str, Any]:
    """A budget's env settings: those of ``val_envs`` for its own ``tags`` and its base seed (none: the
    catalogue's defaults and the validation seed)."""
    if val_envs is None:
        return {}
    overrides = {t: dict(val_envs.env_overrides[t]) for t in tags if t in val_envs.env_overrides}
    return {"env_overrides": overrides, "seed": val_envs.seed}


def plan_evaluation(request: EvaluateRequest) -> tuple[EvaluateRequest, Policy, list[Budget]]:
    """The request with its tags filled in (a run's own validation tags, a model's default), the
    policy it names and how each tag is played. An unknown run, model, step or tag fails here, before
    any work."""
    if request.tags is not None:
        check_tags(request.tags)
    policy = resolve_policy(request.policy)
    if request.tags is None:  # a run is evaluated on its own validation tags, a model on the default
        request = request.model_copy(update={"tags": policy.default_tags()})
        check_tags(policy.default_tags())
    return request, policy, budgets(request, policy.protocol, policy.max_new_tokens, policy.val_envs)


# ---------------------------------------------------------------------------- the play
def _sampling(request: EvaluateRequest, budget: Budget) -> dict[str, Any]:
    return {
        "temperature": request.temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": budget.max_new_tokens,
    }


def play(
    request: EvaluateRequest,
    policy: Policy,
    plan: list[Budget],
    log: logging.Logger | logging.LoggerAdapter[Any],
    open_worker: Callable[..., Any] | None = None,
) -> tuple[pa.Table, dict[str, float]]:
    """Play ``request.n_per_tag`` validation episodes of every tag of ``plan`` with one loaded policy
    (``open_worker``: the rollout worker's class, ``RolloutWorker`` unless a test gives another);
    returns the trajectories and the metrics ``val-env/<tag>/*`` and ``timing_s/testing``."""
    import pyarrow as pa

    if open_worker is None:
        from ragen_core.rollout.worker import RolloutWorker

        open_worker = RolloutWorker
    worker = None
    tables, env_metrics = [], {}
    t0 = time.perf_counter()
    try:
        for b in plan:
            val = EnvGroupsConfig(
                tags=b.tags,
                n_groups=[request.n_per_tag] * len(b.tags),
                group_size=1,
                seed=b.seed,
                env_overrides=b.env_overrides,
            )
            if worker is None:
                protocol, groups = b.protocol.model_dump(), val.model_dump()
                worker = open_worker(str(policy.path), protocol, groups, groups, engine=request.engine)
            else:
                worker.set_groups("val", b.protocol.model_dump(), val.model_dump())
            log.info(
                "playing %s: %d episodes each, %d turn(s), %d new tokens per turn%s",
                ",".join(b.tags),
                request.n_per_tag,
                b.protocol.max_turn,
                b.max_new_tokens,
                "".join(f"; {t} with {o}" for t, o in b.env_overrides.items()),
            )
            table, m = worker.rollout("val", 0, 0, _sampling(request, b), request.seed, policy.label)
            tables.append(table)
            # Success is per tag only (no "success" over several tags: see the module docstring).
            env_metrics.update({k: v for k, v in m.items() if k != "success"})
            for tag in b.tags:
                log.info(
                    "%s: success %.3f (%s)", tag, m[f"{tag}/success"], duration(time.perf_counter() - t0)
                )
    finally:
        if worker is not None:
            worker.close()
    table = pa.concat_tables(tables)
    metrics = {f"val-env/{k}": v for k, v in env_metrics.items()}
    metrics["timing_s/testing"] = time.perf_counter() - t0
    return table, metrics


def write_evaluation(
    request: EvaluateRequest, state: Path, label: str, table: pa.Table, metrics: dict[str, float]
) -> tuple[Path, Path]:
    """``eval.parquet`` and ``metrics.json`` in ``request.out_dir`` (default: a new
    ``<state>/evals/<label>-<time>``); returns (the folder, the Parquet file)."""
    out = Path(request.out_dir or state / "evals" / f"{label.replace('/', '_')}-{int(time.time())}")
    path = write_table(table, out / "eval.parquet")
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True))
    return out, path


# ---------------------------------------------------------------------------- MLflow
@dataclass(frozen=True)
class LoggedEvaluation:
    """Where an evaluation was logged (all None: not logged)."""

    run_id: str | None = None
    experiment: str | None = None
    parent_run_id: str | None = None  # a run's policy: the training run it is nested under


def run_tags(policy: Policy, tags: list[str]) -> dict[str, str]:
    """The MLflow tags of an evaluation: what it evaluates, on which tags, which of them are held out."""
    from ragen_core.state_folder import index_entry

    # a run's policy folder as runs.json records it (relative to the state folder, which may move)
    where = index_entry(policy.path) if policy.run_dir is not None else str(policy.path)
    out = {"ragen.policy": where, "ragen.tags": ",".join(tags), "ragen.evaluates": policy.label}
    if policy.step is not None:
        out["ragen.step"] = str(policy.step)
    if policy.model_id:
        out["ragen.model_id"] = policy.model_id
    if policy.train_tags is not None:
        out["ragen.train_tags"] = ",".join(policy.train_tags)
        out["ragen.held_out_tags"] = ",".join(t for t in tags if policy.held_out(t))
    return out


def log_evaluation(
    request: EvaluateRequest,
    policy: Policy,
    plan: list[Budget],
    metrics: dict[str, float],
    path: Path,
    state: Path,
) -> LoggedEvaluation:
    """An MLflow run of the evaluation (:meth:`Policy.mlflow_run_name`; its metrics at the step it
    evaluated, 0 for a model; ``eval/``: the trajectories), nested under the training run of a run's
    policy (in its experiment), else in :data:`EVAL_EXPERIMENT`; linked to the LoggedModel it
    evaluated, if any. Nothing when ``request.log_to_mlflow`` is off."""
    if not request.log_to_mlflow:
        return LoggedEvaluation()
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.tracking.tracker import Tracker

    tracking, parent = TrackingConfig(experiment=EVAL_EXPERIMENT), None
    if policy.run_dir is not None:  # nested under the training run, in its experiment
        trained = RunDir(policy.run_dir)
        tracking = trained.config().tracking.model_copy(update={"log_artifacts": True})
        parent = trained.info().get("mlflow_run_id")
    tracker = Tracker(tracking, state)
    params = {**request.model_dump(), "budgets": [b.model_dump() for b in plan]}
    tags = run_tags(policy, list(request.tags or []))
    mlflow_run = tracker.start(policy.mlflow_run_name(), params, tags=tags, parent_run_id=parent)
    step = policy.step or 0
    tracker.log_iteration(step, metrics)
    if policy.model_id:  # the LoggedModel's page lists the evaluations of it
        link_metrics(tracker, mlflow_run, policy.model_id, metrics, step)
    tracker.log_artifact(path, "eval")
    if tracker.offline is not None:
        _failed_logging(tracker, mlflow_run, path)
    tracker.end()
    return LoggedEvaluation(mlflow_run, tracking.experiment, parent)


def _failed_logging(tracker: Tracker, mlflow_run: str, path: Path) -> None:
    """An evaluation whose MLflow logging failed is no success: its run is ended FAILED where the
    store still takes that (never left RUNNING by us), and one line says what is missing and how to
    log it (the trajectories are kept; an evaluation has no resume, so it is run again)."""
    with contextlib.suppress(Exception):  # the store is failing: the line below says so already
        tracker.client.set_terminated(mlflow_run, status="FAILED")
    raise EvaluateError(
        f"the evaluation finished but was not logged to MLflow: {tracker.offline}; its MLflow run "
        f"{mlflow_run} lacks its metrics or trajectories (kept in {path}); once the store works "
        "(free disk space, or fix tracking.tracking_uri), run the same `ragen evaluate` again to log it"
    )


def link_metrics(tracker: Tracker, run_id: str, model_id: str, metrics: dict[str, float], step: int) -> None:
    """The evaluation's metrics (logged at ``step`` by MLflow run ``run_id``) linked to the LoggedModel
    it evaluated; a failing store takes the tracker offline, as its own calls do."""
    from ragen_core.run.logged_models import link_metrics as link

    try:
        link(tracker.client, run_id, model_id, metrics, step, int(time.time() * 1000))
    except Exception as e:
        tracker.go_offline(f"link the evaluation to model {model_id}", e)


# ---------------------------------------------------------------------------- the report
def tag_rows(policy: Policy, tags: list[str], metrics: dict[str, float]) -> list[dict[str, object]]:
    """One row per tag: ``tag``, ``success``, ``held_out`` (None: unknown, a model), ``success_means``;
    the tags the policy was trained on first, then the held-out ones, each in the order given."""
    from envs.registry import success_means

    rows: list[dict[str, object]] = [
        {
            "tag": tag,
            "success": metrics.get(f"val-env/{tag}/success"),
            "held_out": policy.held_out(tag),
            "success_means": success_means(tag) or "",
        }
        for tag in tags
    ]
    return sorted(rows, key=lambda r: bool(r["held_out"]))  # stable: the given order within each part


def evaluation_markdown(
    label: str,
    rows: list[dict[str, object]],
    n: int,
    mlflow_run: str | None,
    out_dir: str | Path | None = None,
    run_dir: str | Path | None = None,
) -> str:
    """The evaluation as markdown: success per tag, the trained-on tags apart from the held-out ones,
    and where it is (the output folder, the evaluated run's folder, the MLflow run)."""
    lines = [f"## Evaluation of `{label}`", "", f"{n} episodes per tag (validation seeds)."]
    if mlflow_run:
        lines.append(f"MLflow run `{mlflow_run}`.")
    if out_dir is not None:
        lines.append(f"Episodes and metrics in `{out_dir}`.")
    if run_dir is not None:
        lines.append(f"Evaluated run folder `{run_dir}`.")
    lines += [
        "",
        "| tag | success | trained on it | an episode succeeds when |",
        "| --- | ---: | --- | --- |",
    ]
    for r in rows:
        held = r["held_out"]
        part = "unknown (a model)" if held is None else ("**held out**" if held else "yes")
        value = r["success"]
        shown = f"{value:.3f}" if isinstance(value, float) else "-"
        lines.append(f"| {r['tag']} | {shown} | {part} | {r['success_means']} |")
    if any(r["held_out"] is True for r in rows):
        lines += [
            "",
            "Held-out tags measure generalisation: compare them with the trained-on tags, never average them.",
        ]
    return "\n".join(lines) + "\n"


def evaluation_result(
    policy: Policy,
    out: Path,
    metrics: dict[str, float],
    rows: list[dict[str, object]],
    logged: LoggedEvaluation,
) -> dict[str, object]:
    """What ``ragen evaluate`` (and a deployment's flow run) returns."""
    return {
        "policy": str(policy.path),
        "label": policy.label,
        "out_dir": str(out),
        "metrics": metrics,
        "tags": rows,
        "mlflow_run_id": logged.run_id,
        "mlflow_experiment": logged.experiment,
        "mlflow_parent_run_id": logged.parent_run_id,
    }
