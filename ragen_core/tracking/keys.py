"""Names and tag texts as MLflow takes them: a metric, param or tag name MLflow accepts
(:func:`metric_key`), and the ``ragen.logged_steps`` tag's list of steps (:func:`format_steps`,
:func:`parse_steps`), the history of a param a resume changed (:func:`resumed_value_tags`), and the
metrics a training run sends to MLflow (:data:`CORE_METRICS`, :func:`tracked_metrics`)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

from ragen_core.config.tracking import MetricsLevel

MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH

#: The query that opens a page of the MLflow UI (3.x) on its model-training view. The UI keeps one view
#: per browser (local storage ``mlflow.workflowType``, GenAI for a fresh browser), and that choice wins
#: over the experiment's kind tag: a fresh browser lands on the GenAI pages (a run on "Evaluations", an
#: experiment on "Usage") unless the link names the view; the URL's ``workflowType`` wins over the stored one.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
#: The run tag MLflow shows as the run's description (markdown, at the top of its Overview).
DESCRIPTION_TAG = "mlflow.note.content"
#: The run tag with the address of the Prefect flow run that trained it (``prefect.flow_run_id``: its id).
FLOW_RUN_URL_TAG = "prefect.flow_run_url"


_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def format_steps(steps: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 5}`` -> ``"0-3,5"`` (what the ``ragen.logged_steps`` tag holds)."""
    out: list[list[int]] = []
    for k in sorted(set(steps)):
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def parse_steps(text: str) -> set[int]:
    """The inverse of :func:`format_steps`."""
    steps: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        steps.update(range(int(a), int(b or a) + 1))
    return steps


def metric_key(name: str) -> str:
    """A name MLflow accepts for a metric, param or tag: ``@`` -> ``_at_``, any other character
    outside ``[A-Za-z0-9_./ :-]`` -> ``_``, no empty / ``.`` / ``..`` path parts, at most 250 chars."""
    key = _BAD_CHARS.sub("_", str(name).replace("@", "_at_"))
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    key = "/".join(parts) or "_"
    return key[:MAX_KEY_LEN]


#: ``ragen.resume.<param>``: the values accepted resumes gave a param, oldest first (``2 -> 4 -> 8``
#: for ``trainer.iterations`` extended twice); MLflow keeps a param's first value.
RESUMED_VALUES_PREFIX = "ragen.resume."


def resumed_value_tags(
    changed: Mapping[str, str], existing: Mapping[str, str], tags: Mapping[str, str]
) -> dict[str, str]:
    """The ``ragen.resume.<param>`` tags of a resume: each changed param's history (from the run's
    ``tags``, else its first value in ``existing``), then its new value."""
    out = {}
    for key, value in changed.items():
        tag = RESUMED_VALUES_PREFIX + key
        history = tags.get(tag) or existing[key]
        if history.rsplit(" -> ", 1)[-1] != value:
            history = f"{history} -> {value}"
        out[tag] = history if len(history) <= 5000 else "... " + history[-4996:]
    return out


#: What a training run sends to MLflow with ``tracking.metrics: core`` (the default), as names or globs
#: of the run's own metric names: the curves a researcher reads first, and every key that something
#: reads back from MLflow (the run's plots, the sweep report's comparison, curves and Echo-Trap replay,
#: the kept models' metrics). ``tracking.metrics: all`` sends every metric; the run folder's
#: ``metrics.json`` keeps every metric either way.
CORE_METRICS: tuple[str, ...] = (
    "val-env/success",  # validation success: over the tags, and per tag
    "val-env/*/success",
    "train/success",  # training success over the train tags
    "score/mean",  # the training trajectories' mean score, before the filter
    "rollout/filter_kept_ratio",  # the share of groups the filter kept
    "rollout/in_group_std",  # in-group reward std, before the filter (Echo-Trap's first signal)
    "actor/entropy",
    "actor/ppo_kl",  # KL to the rollout policy; with a KL loss or penalty, that term too
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/grad_norm",  # pre-clip
    "critic/grad_norm",
    "response_length/mean",
    "timing_s/step",  # the iteration's wall time
    "perf/total_num_tokens",  # the sweep report's token count
    "collapse/mi_estimate",  # RAGEN-2's template collapse (every monitor.collapse_every iterations)
    "monitor/*",  # an Echo-Trap signal, at the step it fired
    "tracking/*",  # the tracker's own counts (non-finite values skipped)
)

V = TypeVar("V")


def is_core_metric(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether ``name`` is one of :data:`CORE_METRICS` or of ``extra`` (names or globs)."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in (*CORE_METRICS, *extra))


def tracked_metrics(metrics: Mapping[str, V], level: MetricsLevel, extra: Iterable[str] = ()) -> dict[str, V]:
    """The part of ``metrics`` that goes to MLflow at ``tracking.metrics`` ``level``: all of them, or the
    core ones (:data:`CORE_METRICS` and ``extra``, e.g. the keys the run's Echo-Trap monitor reads)."""
    if level == "all":
        return dict(metrics)
    patterns = tuple(extra)
    return {k: v for k, v in metrics.items() if is_core_metric(k, patterns)}
