"""A run's kept policies as MLflow models: a LoggedModel per kept step (the final policy and the best
validated one), its metrics linked to it, and each registered as a version of the *config's* registered
model (:func:`registry_name`: the config file's name, or a sweep member's group), so that the seeds and
reruns of one config are versions of one model on the MLflow UI's "Models" page, not a model each.
A version carries the run, the step and the step's validation success as tags, and the run's aliases
``<run id>-best`` and ``<run id>-final`` (:func:`run_alias`) point at it. ``ragen evaluate
models:/<run id>@best`` (or ``@final``) finds it by its run tag, and the runs registered before
2026-12-05 (a model per run, named after it) as they are.

A LoggedModel's files are the policy folder (a Hugging Face folder: weights, tokenizer, chat
template) that the run directory holds; a step already logged (a resumed run ends on the same best
step) reuses its model, recorded in ``run.json`` (``logged_models``). Reaching a model back from the
registry (:func:`resolve_model_uri`) prefers that run directory and downloads only what is not on
this machine. No MLflow import at module level: the tracker owns the store.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_core.errors import RagenError
from ragen_core.run.run_dir import RunDir, find_run
from ragen_core.state_folder import index_entry, locate_run
from ragen_core.tracking.keys import metric_key, tracked_metrics
from ragen_core.tracking.tracker import Tracker

#: The registry aliases of a run's kept policies.
ALIASES = ("final", "best")
#: Tags of every LoggedModel and model version: which run and step it is (what ``resolve_model_uri`` reads).
RUN_TAG, STEP_TAG = "ragen.run_id", "ragen.step"
#: ``run.json``'s record of the registered model a run's policies are versions of.
REGISTERED_KEY = "registered_model"


def registry_name(info: Mapping[str, Any]) -> str:
    """The registered model a run's policies are versions of (``info``: its ``run.json``): one per
    config. A sweep member's is its sweep group (``<sweep>.<group>``: the seeds of one variant); a run's
    the config file it was trained from (``config_name``); a run that recorded neither (registered
    before 2026-12-05) keeps the model named after its id that it already has."""
    if info.get(REGISTERED_KEY):
        return str(info[REGISTERED_KEY])
    if info.get("sweep") and info.get("sweep_group"):
        name = f"{info['sweep']}.{info['sweep_group']}"
    else:
        name = str(info.get("config_name") or info["run_id"])
    return re.sub(r"[/:]", "-", name)  # what MLflow refuses in a registered model's name


def run_alias(run_id: str, alias: str) -> str:
    """The run's own alias for its ``alias`` (``best``, ``final``) policy on the config's registered
    model: ``<run id>-<alias>``, with what aliases may not hold (``.`` of sweep members' ids) as ``-``."""
    return re.sub(r"[^\w-]", "-", f"{run_id}-{alias}")


class ModelURIError(RagenError):
    """A ``models:/`` URI that names no registered model, version or alias."""


def logged_model_name(run_id: str, step: int) -> str:
    """``<run id>-step-<k>``, with the characters MLflow refuses in a LoggedModel's name (``.``, which
    sweep members' run ids have, ``/ : % " '``) as ``-``. The registered model keeps the run id."""
    return re.sub(r"[/:.%\"']", "-", f"{run_id}-step-{step}")


def step_metrics(run: RunDir, step: int) -> dict[str, float]:
    """What the run measured of the policy after ``step`` iterations: the iteration's metrics (when
    ``step`` > 0) and its validation (when it was validated)."""
    out: dict[str, float] = {}
    if step > 0 and run.metrics_file(step).exists():
        out.update(run.read_json(run.metrics_file(step)))
    if run.eval_metrics_file(step).exists():
        out.update(run.read_json(run.eval_metrics_file(step)))
    # finite numbers only, as the run logged them (``Tracker.log_iteration`` skips the rest)
    return {k: float(v) for k, v in out.items() if isinstance(v, int | float) and math.isfinite(v)}


def log_kept_models(
    tracker: Tracker, run: RunDir, steps: dict[str, int | None], core_extra: Sequence[str] = ()
) -> dict[str, str]:
    """Log each kept step (``{"final": 12, "best": 9}``) as a LoggedModel of the tracker's run (once per
    step), link its metrics (those ``tracking.metrics`` sends; ``core_extra``: beyond the core set),
    register it under the run id and point the alias at it. Returns ``{alias: model_id}``; nothing (and no error) when the tracker is offline or artifacts are off."""
    if tracker.run_id is None or tracker.offline is not None or not tracker.cfg.log_artifacts:
        return {}

    client, mlflow_run = tracker.client, tracker.run_id
    info = run.info()
    run_id = info["run_id"]
    logged: dict[str, str] = dict(info.get("logged_models", {}))
    experiment = client.get_run(mlflow_run).info.experiment_id
    out: dict[str, str] = {}
    try:
        for alias, step in steps.items():
            if step is None:
                continue
            model_id = logged.get(str(step))
            if model_id is None:
                model = client.create_logged_model(
                    experiment,
                    name=logged_model_name(run_id, step),
                    source_run_id=mlflow_run,
                    tags={RUN_TAG: run_id, STEP_TAG: str(step)},
                    params={"step": str(step), "policy_dir": index_entry(run.policy_after(step))},
                    model_type="transformers",
                )
                model_id = model.model_id
                client.log_model_artifacts(model_id, str(run.policy_after(step)))
                client.finalize_logged_model(model_id, "READY")
                default = int(os.path.getmtime(run.policy_after(step)) * 1000)
                # what the run sent of the step (``tracking.metrics``): a linked metric is also the run's
                linked = tracked_metrics(step_metrics(run, step), tracker.cfg.metrics, core_extra)
                link_metrics(client, mlflow_run, model_id, linked, step, default)
                logged[str(step)] = model_id
                run.update_info(logged_models=logged)
            out[alias] = model_id
        if out:
            name = registry_name(info)
            tags = {
                alias: _version_tags(run_id, int(step), run)
                for alias, step in steps.items()
                if step is not None
            }
            _register(client, name, run_id, mlflow_run, out, tags)
            if info.get(REGISTERED_KEY) != name:
                run.update_info(**{REGISTERED_KEY: name})
    except Exception as e:  # a store that fails here takes the tracker offline, as every other call
        tracker.go_offline(f"log the kept models of run {mlflow_run}", e)
        return {}
    return out


def model_id_of(version: Any) -> str:
    """The LoggedModel of a registered version: its source ``models:/<model id>`` (the SQL registry
    keeps no ``model_id`` of its own)."""
    return str(version.model_id or version.source.removeprefix("models:/"))


_DEFAULT_URI_LOCK = threading.Lock()


@contextmanager
def _default_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's registry resolves a version's ``models:/<id>`` source (the source that links the
    version to its LoggedModel) with ``MlflowClient()``, on the process's default tracking URI, not
    on the calling client's. For that call the default is this store; before and after, it is what it
    was (the environment variable included, which ``mlflow.set_tracking_uri`` also sets)."""
    import mlflow

    with _DEFAULT_URI_LOCK:
        env = os.environ.get("MLFLOW_TRACKING_URI")
        # None when nothing set one: restoring get_tracking_uri()'s answer then would set MLflow's
        # default (sqlite:///mlflow.db in the working directory) for good, and every later default
        # client of the process (traces, the registry's source lookups) used that file
        previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None  # type: ignore[no-untyped-call]
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]  # None: unset, as MLflow allows
            if env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env


def link_metrics(
    client: Any, mlflow_run: str, model_id: str, values: Mapping[str, float], step: int, default_ts: int
) -> None:
    """Link ``values``, which ``mlflow_run`` logged at ``step``, to the LoggedModel ``model_id``.

    They are sent again with the timestamp the step was logged with (one for all its metrics; else
    ``default_ts``): MLflow keeps one row per (key, step, timestamp, value) in a run's history, so the
    run's curves get no second point while the model gets its own rows."""
    from mlflow.entities import Metric

    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    if not finite:
        return
    history = client.get_metric_history(mlflow_run, metric_key(min(finite)))
    timestamp = {m.step: m.timestamp for m in history}.get(step, default_ts)
    metrics = [
        Metric(metric_key(k), v, timestamp, step, model_id=model_id) for k, v in sorted(finite.items())
    ]
    client.log_batch(mlflow_run, metrics=metrics)


def _version_tags(run_id: str, step: int, run: RunDir) -> dict[str, str]:
    """A model version's tags: its run and step, and what the step's validation measured (the success
    per validation tag), so the "Models" page compares versions without opening each run."""
    tags = {RUN_TAG: run_id, STEP_TAG: str(step)}
    for key, value in sorted(step_metrics(run, step).items()):
        if key.startswith("val-env/") and key.endswith("/success"):
            tags[key] = f"{value:.4f}"
    return tags


def _register(
    client: Any,
    name: str,
    run_id: str,
    mlflow_run: str,
    models: dict[str, str],
    tags: Mapping[str, Mapping[str, str]],
) -> None:
    """One registered model per config (``name``), a version per kept model (tagged: ``tags`` per
    alias), the run's aliases on its versions; a model named after the run id (the layout before
    2026-12-05) gets its ``best`` / ``final`` aliases as it always did."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description=f"policies kept by the ragen-flow runs of {name}")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    versions = {model_id_of(v): v.version for v in client.search_model_versions(f"name='{name}'")}
    for alias, model_id in models.items():
        if model_id not in versions:
            with _default_tracking_uri(client.tracking_uri):
                versions[model_id] = client.create_model_version(
                    name, source=f"models:/{model_id}", run_id=mlflow_run, model_id=model_id
                ).version
        for key, value in tags.get(alias, {}).items():
            client.set_model_version_tag(name, versions[model_id], key, value)
        client.set_registered_model_alias(
            name, alias if name == run_id else run_alias(run_id, alias), versions[model_id]
        )


def _by_alias(client: Any, name: str, alias: str) -> Any:
    """The version ``name@alias`` names; for ``<run id>@best`` / ``@final`` of a run whose policies are
    versions of its config's model, that run's version (found by its run tag, so on any machine)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if alias not in ALIASES or "'" in name:
            raise
        # (a search returns no aliases: ask each registered model holding a version of the run)
        models = dict.fromkeys(v.name for v in client.search_model_versions(f"tags.`{RUN_TAG}` = '{name}'"))
        for model in models:
            with contextlib.suppress(MlflowException):
                return client.get_model_version_by_alias(model, run_alias(name, alias))
        raise e


@dataclass
class ResolvedModel:
    """Where a ``models:/`` URI's policy is on this machine, and what it came from."""

    folder: Path
    model_id: str
    run_id: str
    step: int
    mlflow_run_id: str | None


def resolve_model_uri(uri: str, tracker: Tracker, cache: Path) -> ResolvedModel:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` -> the policy folder: the training
    run's own folder when it is on this machine, else the model's files downloaded into ``cache``."""
    from mlflow.exceptions import MlflowException

    rest = uri.removeprefix("models:/")
    client = tracker.client
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = _by_alias(client, name, alias)
        elif "/" in rest:
            name, number = rest.rsplit("/", 1)
            version = client.get_model_version(name, number)
        else:
            raise ModelURIError(f"{uri}: use models:/<name>@<alias> (e.g. @best) or models:/<name>/<version>")
        model = client.get_logged_model(model_id_of(version))
    except MlflowException as e:
        raise ModelURIError(
            f"{uri}: not in the MLflow registry at {tracker.tracking_uri} ({e.error_code}); "
            "each finished run registers its kept policies as models:/<run id>@best and @final (on the "
            "MLflow UI's Models page: the config's model, aliases <run id>-best and <run id>-final)"
        ) from e
    run_id, step = model.tags.get(RUN_TAG, ""), int(model.tags.get(STEP_TAG, "0"))
    folder: Path | None = None
    if run_id and locate_run(run_id) is not None:
        folder = find_run(run_id).policy_after(step)
    if folder is None or not (folder / "config.json").is_file():  # not on this machine: fetch the files
        import mlflow.artifacts

        target = cache / model.model_id
        if not (target / "config.json").is_file():
            got = mlflow.artifacts.download_artifacts(
                artifact_uri=model.artifact_location, dst_path=str(target), tracking_uri=tracker.tracking_uri
            )
            if Path(got) != target and (Path(got) / "config.json").is_file():
                target = Path(got)
        folder = target
    return ResolvedModel(folder, model.model_id, run_id, step, model.source_run_id)
