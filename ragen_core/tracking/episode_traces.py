"""Episodes as MLflow traces: one trace per episode, one chat span per turn, the outcome as feedback.

A researcher reads a run's episodes in the MLflow UI (the run's Traces tab, the experiment's Sessions
tab) instead of in Parquet files. What is traced (docs/metrics.md, "Episodes as MLflow traces"):

* each iteration, a sample of the train rollouts: per env tag ``traces_per_tag`` episodes, half
  (rounded up) from groups the filter kept and the rest from groups it dropped, so both sides of its
  decision are in every iteration's sample; on each side the largest score std first, and a group's
  members side by side;
* at the final step, every validation episode (tags taken in turn when the cap cuts);
* at most ``max_traces_per_step`` traces per step and file.

A trace holds a root span (``AGENT``: the whole conversation) and one ``CHAT_MODEL`` span per turn
whose inputs are ``{"messages": [...]}`` (the conversation up to the turn's user message) and whose
output is the assistant text: the shapes the MLflow UI renders as a chat. The text is the trajectory
table's ``messages`` column, which holds exactly what the model saw and wrote (docs/architecture.md
"Trajectory schema"), with one change for the chat view, which renders Markdown: each environment
state is in a code fence (``rendering.fence_states``), so a grid keeps its lines and underscores.
The turn's parsed actions, environment reply (the next user message, verbatim), reward, format
penalty, validity and effectiveness are its ``ragen.*`` attributes. With ``agent.max_context_window``
shorter than an episode, the table keeps only the last window, numbered from its first turn: only the
last turn's prompt is then the one the model saw, so earlier turns show their output only
(``ragen.prompt`` says why). Span times only order the turns (1 ms each); they are not measured
durations.

The list view: the trace's name says the tag, iteration, split, group, env id, the outcome
(``success``/``failed``) and for train episodes the filter's decision; a failed episode's state is
``ERROR`` (MLflow's red badge; its root span says why), a successful one's ``OK``; the request
preview is the episode's first state rather than the instructions every episode shares; request
times follow the sample's order within a step.

Metadata (immutable, searchable): ``ragen.run_id``, ``ragen.iteration``, ``ragen.split``,
``ragen.env_tag``, ``ragen.seed``, ``ragen.group_id``, ``ragen.env_id``, ``ragen.success``; the
session (``mlflow.trace.session``) is the group, so a group's members sit together; the source run
(``mlflow.sourceRun``) is the training run, so the traces are on its Traces tab. Tags (the list's
Tags column and filters): ``ragen.iteration``, ``ragen.split``, ``ragen.env_tag``, ``ragen.outcome``
and for train episodes ``ragen.filter`` (``kept``/``dropped``). Feedback from source
``CODE``/``ragen-flow``, the same four names on every trace so no column of the list is empty:
``score``, ``success``, ``group_reward_std`` (the unbiased std of the group's scores, the filter's
statistic) and ``filter_kept`` (validation episodes are not filtered: every one counts, True).

Traces are written straight to the store of a ``TracingClient`` made for the run's tracking URI
(``start_trace`` with metadata, tags and feedback, then one ``log_spans`` for all spans), never
through MLflow's global tracer, active experiment or active run: runs and sweeps log from threads.
Trace ids are derived from (MLflow run, split, step, env id), so a step re-logged after a
resume skips the traces it already has instead of duplicating them.

Like ``tracking.py``, this module imports ``mlflow`` lazily; only the Tracker calls it.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ragen_core.filter_record import GroupDecision, group_decisions, in_turn
from ragen_core.text_safety import printable
from ragen_core.tracking.rendering import (
    Turn,
    fence_states,
    filter_decision,
    first_state,
    outcome,
    row_info,
    turns_of,
)
from ragen_core.trajectory import read_table

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.entities import Assessment, Span, TraceInfo
    from mlflow.tracing.client import TracingClient
    from opentelemetry.trace import Status

#: The source of the feedback this module logs (MLflow ``AssessmentSource``: type CODE).
SOURCE_ID = "ragen-flow"
#: Metadata keys (``metadata.`ragen.iteration` = '3'`` in a ``search_traces`` filter string).
RUN_KEY, ITERATION_KEY, SPLIT_KEY = "ragen.run_id", "ragen.iteration", "ragen.split"
TAG_KEY, SEED_KEY, GROUP_KEY, ENV_KEY, SUCCESS_KEY = (
    "ragen.env_tag",
    "ragen.seed",
    "ragen.group_id",
    "ragen.env_id",
    "ragen.success",
)
#: Tag keys of their own (iteration, split and env tag are tags under the metadata keys too).
OUTCOME_KEY, FILTER_KEY = "ragen.outcome", "ragen.filter"
#: Columns a trace needs (the token columns are dropped at once: they are most of a file's bytes).
COLUMNS = (
    "run_id",
    "iteration",
    "split",
    "env_tag",
    "group_id",
    "env_id",
    "seed",
    "turn_count",
    "success",
    "truncated",
    "reward",
    "format_penalty",
    "score",
    "messages",
    "actions",
    "turn_rewards",
    "info",
)
#: MLflow's limit on a trace's request/response preview is larger; the list view shows far less.
PREVIEW_CHARS = 1000
_NS_PER_MS = 1_000_000


# ---------------------------------------------------------------------------- choosing episodes
def choose_train(
    table: pa.Table, per_tag: int, cap: int, groups: Mapping[int, GroupDecision] | None
) -> list[int]:
    """Row numbers of the train sample: per env tag ``per_tag`` rows, half (rounded up) from the
    groups the filter kept and the rest from those it dropped, a side's unused share going to the
    other, so a sample shows both sides of the decision whenever both exist; on each side the groups
    with the largest score std first (then by group id) and a group's members side by side (by env
    id). ``groups``: the filter's record by group id (None: no filter ran, one side). At most ``cap``
    in all: tags in turn, and within a tag kept and dropped rows alternate, so a cut keeps both."""
    if per_tag <= 0 or cap <= 0:
        return []
    sides: dict[str, dict[bool, list[tuple[tuple[Any, ...], int]]]] = defaultdict(
        lambda: {True: [], False: []}
    )
    columns = (table.column(c).to_pylist() for c in ("env_tag", "group_id", "env_id"))
    for i, (tag, g, e) in enumerate(zip(*columns, strict=True)):
        decision = groups.get(g) if groups is not None else None
        kept = decision.kept if decision is not None else True
        std = decision.score_std if decision is not None else 0.0
        sides[tag][kept].append(((-std, g, e), i))
    picked: dict[str, list[int]] = {}
    for tag, rows in sides.items():
        kept_rows = [i for _, i in sorted(rows[True])]
        dropped_rows = [i for _, i in sorted(rows[False])]
        n_kept = min(len(kept_rows), max((per_tag + 1) // 2, per_tag - len(dropped_rows)))
        picked[tag] = in_turn(kept_rows[:n_kept], dropped_rows[: per_tag - n_kept])
    return _round_robin(picked, cap)


def choose_all(table: pa.Table, cap: int) -> list[int]:
    """Every row (validation), at most ``cap``: tags in turn, rows in file order within a tag, so a
    cut keeps every tag represented."""
    if cap <= 0:
        return []
    by_tag: dict[str, list[int]] = defaultdict(list)
    for i, tag in enumerate(table.column("env_tag").to_pylist()):
        by_tag[tag].append(i)
    return _round_robin(by_tag, cap)


def _round_robin(rows_by_tag: Mapping[str, Sequence[int]], cap: int) -> list[int]:
    out: list[int] = []
    depth = 0
    while len(out) < cap and any(depth < len(v) for v in rows_by_tag.values()):
        out.extend(v[depth] for v in rows_by_tag.values() if depth < len(v))
        depth += 1
    return sorted(out[:cap])


# ---------------------------------------------------------------------------- building a trace
def trace_id_for(mlflow_run_id: str, split: str, iteration: int, env_id: int) -> str:
    """A deterministic MLflow trace id (``tr-`` + 32 hex digits): a re-logged step finds its traces."""
    digest = hashlib.sha256(f"{mlflow_run_id}/{split}/{iteration}/{env_id}".encode()).hexdigest()
    return "tr-" + digest[:32]


def _span_id(trace_id: str, index: int) -> int:
    # 64 bits, never 0 (OpenTelemetry's invalid span id)
    return int(hashlib.sha256(f"{trace_id}/{index}".encode()).hexdigest()[:16], 16) or 1


def session_id(row: Mapping[str, Any], step: int) -> str:
    """The MLflow session of an episode: its group in its step (a group's members sit together)."""
    return f"{row['run_id']}/{row['split']}/iter_{step:04d}/group_{int(row['group_id'])}"


def build_trace(
    row: Mapping[str, Any],
    *,
    step: int,
    experiment_id: str,
    mlflow_run_id: str,
    start_ms: int,
    group: GroupDecision | None = None,
) -> tuple[TraceInfo, list[Span]]:
    """The trace of one trajectory row (``read_table(...).to_pylist()``) of MLflow step ``step``: its
    info (name, state, metadata, tags, feedback) and its spans (root + one per turn); nothing is sent.
    ``group``: the row's group as the filter saw it (for validation: all kept), None: no group
    feedback. The step is the caller's, not the row's ``iteration``: schema v1 files numbered that
    column differently."""
    from mlflow.entities import TraceInfo, TraceLocation, TraceState
    from mlflow.tracing.constant import TraceTagKey

    split, k = str(row["split"]), int(step)
    trace_id = trace_id_for(mlflow_run_id, split, k, int(row["env_id"]))
    info = row_info(row)
    turns = turns_of(row)
    messages = [dict(m) for m in row["messages"] or []]
    start_ns = start_ms * _NS_PER_MS
    end_ns = start_ns + max(1, len(turns)) * _NS_PER_MS
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    root_output = messages[last_assistant]["content"] if last_assistant is not None else None
    root = _root_span(row, trace_id, info, messages, last_assistant, (start_ns, end_ns))
    spans = [root, *(_turn_span(trace_id, _span_id(trace_id, -1), turn, start_ns) for turn in turns)]
    first_user = next((m["content"] for m in messages if m.get("role") == "user"), "")
    tags = _trace_tags(row, k, group)
    trace_info = TraceInfo(
        trace_id=trace_id,
        trace_location=TraceLocation.from_experiment_id(experiment_id),
        request_time=start_ms,
        execution_duration=(end_ns - start_ns) // _NS_PER_MS,
        state=TraceState.OK if row["success"] else TraceState.ERROR,
        request_preview=_preview(_first_state_line(row, first_user)),
        response_preview=_preview(root_output or ""),
        trace_metadata=_trace_metadata(row, k, mlflow_run_id),
        tags={TraceTagKey.TRACE_NAME: trace_name(row, k, group), **tags},
        assessments=_feedback(row, info, group),
    )
    return trace_info, spans


def trace_name(row: Mapping[str, Any], step: int, group: GroupDecision | None) -> str:
    """``TAG iter K SPLIT group G #E: success|failed[, kept|dropped]``: what the list shows first."""
    decision = f", {filter_decision(group.kept)}" if group is not None and row["split"] == "train" else ""
    return (
        f"{row['env_tag']} iter {step} {row['split']} group {int(row['group_id'])} #{int(row['env_id'])}: "
        f"{outcome(bool(row['success']))}{decision}"
    )


def _trace_tags(row: Mapping[str, Any], step: int, group: GroupDecision | None) -> dict[str, str]:
    """Tags, which MLflow's trace list shows and filters on (``tags.`ragen.split` = 'val'``); metadata
    it does not show."""
    tags = {
        ITERATION_KEY: str(step),
        SPLIT_KEY: str(row["split"]),
        TAG_KEY: str(row["env_tag"]),
        OUTCOME_KEY: outcome(bool(row["success"])),
    }
    if group is not None and row["split"] == "train":
        tags[FILTER_KEY] = filter_decision(group.kept)
    return tags


def _first_state_line(row: Mapping[str, Any], first_user: str) -> str:
    """The request preview: the episode's first state on one line (``P_G_ / _O__``), not the
    instructions every episode of a tag shares; the first user message where it shows no state."""
    state = first_state(first_user)
    if state is None:
        return first_user
    return f"{row['env_tag']} seed {int(row['seed'])}: {' / '.join(state.splitlines())}"


def _preview(text: str) -> str:
    """A preview column's text, control characters shown escaped (:func:`printable`): the previews
    are shown raw in MLflow's trace list, and PostgreSQL's text columns refuse NUL (MLflow's server on
    PostgreSQL rejected a whole batch of traces for one). The spans keep the text as JSON, where
    control characters are already escaped."""
    return printable(text[:PREVIEW_CHARS])


def _root_span(
    row: Mapping[str, Any],
    trace_id: str,
    info: Mapping[str, Any],
    messages: list[dict[str, Any]],
    last_assistant: int | None,
    times_ns: tuple[int, int],
) -> Span:
    """The episode's span: the conversation up to the last answer in, that answer out, the outcome
    as attributes; an error status for a failed episode, saying how it ended."""
    from mlflow.entities import SpanType
    from opentelemetry.trace import Status, StatusCode

    shown = chat_messages(messages)
    root_inputs = {"messages": shown[:last_assistant] if last_assistant is not None else shown}
    root_output = messages[last_assistant]["content"] if last_assistant is not None else None
    result = {
        "score": float(row["score"]),
        "reward": float(row["reward"]),
        "format_penalty": float(row["format_penalty"]),
        "success": bool(row["success"]),
        "truncated": bool(row["truncated"]),
        "turns": int(row["turn_count"]),
        "end_reason": info.get("end_reason"),
        "num_actions": info.get("num_actions"),
    }
    return _span(
        trace_id,
        _span_id(trace_id, -1),
        None,
        f"episode {row['env_tag']} #{int(row['env_id'])}",
        SpanType.AGENT,
        *times_ns,
        root_inputs,
        root_output,
        {f"ragen.{key}": value for key, value in result.items()},
        Status(StatusCode.OK)
        if row["success"]
        else Status(StatusCode.ERROR, f"episode failed (end: {info.get('end_reason')})"),
    )


def _turn_span(trace_id: str, root_id: int, turn: Turn, start_ns: int) -> Span:
    """One turn's span under the root: its prompt in, its response out, the env's reply as attributes."""
    from mlflow.entities import SpanType
    from opentelemetry.trace import Status, StatusCode

    attrs: dict[str, Any] = {
        "ragen.turn": turn.index + 1,
        "ragen.actions": turn.actions,
        "ragen.env_reply": turn.env_reply,
        "ragen.reward": turn.reward,
        "ragen.format_penalty": turn.format_penalty,
        "ragen.format_ok": turn.format_penalty == 0.0,
        "ragen.action_is_valid": turn.info.get("action_is_valid"),
        "ragen.action_is_effective": turn.info.get("action_is_effective"),
        "ragen.env_info": turn.info,
        "ragen.decoding": turn.decoding or "free",
    }
    if turn.prompt is None:
        attrs["ragen.prompt"] = (
            "not stored: the context window (agent.max_context_window) cut this turn's prompt"
        )
    t0 = start_ns + turn.index * _NS_PER_MS
    return _span(
        trace_id,
        _span_id(trace_id, turn.index),
        root_id,
        f"turn {turn.index + 1}",
        SpanType.CHAT_MODEL,
        t0,
        t0 + _NS_PER_MS,
        {"messages": chat_messages(turn.prompt)} if turn.prompt is not None else None,
        turn.response,
        attrs,
        Status(StatusCode.OK),
    )


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as the chat view shows them: user messages with their states fenced
    (:func:`~ragen_core.tracking.rendering.fence_states`), everything else as stored."""
    return [
        dict(m, content=fence_states(m["content"])) if m.get("role") == "user" else dict(m) for m in messages
    ]


def _feedback(
    row: Mapping[str, Any], info: Mapping[str, Any], group: GroupDecision | None
) -> list[Assessment]:
    """The episode's assessments: score and success, and with its group the group's score std and
    the filter's verdict (validation is not filtered: its groups come as kept, and say so)."""
    from mlflow.entities import AssessmentSource, Feedback

    source = AssessmentSource(source_type="CODE", source_id=SOURCE_ID)
    feedback: list[Assessment] = [
        Feedback(
            name="score",
            value=float(row["score"]),
            source=source,
            rationale=f"reward {float(row['reward']):+.4g}, format penalty {float(row['format_penalty']):+.4g}",
        ),
        Feedback(
            name="success",
            value=bool(row["success"]),
            source=source,
            rationale=f"end: {info.get('end_reason')}",
        ),
    ]
    if group is not None:
        stats = f"group {group.group_id} of {group.size}: score mean {group.score_mean:.4g}, std {group.score_std:.4g}"
        if row["split"] == "train":
            value = "" if group.filter_value is None else f", filter value {group.filter_value:.4g}"
            why = f"{stats}{value}: {filter_decision(group.kept)}"
        else:
            why = f"{row['split']} episodes are not filtered: every one counts ({stats})"
        feedback += [
            Feedback(
                name="filter_kept",
                value=group.kept,
                source=source,
                rationale=why,
                metadata={"group_reward_std": repr(group.score_std)},
            ),
            Feedback(name="group_reward_std", value=group.score_std, source=source, rationale=stats),
        ]
    return feedback


def _trace_metadata(row: Mapping[str, Any], step: int, mlflow_run_id: str) -> dict[str, str]:
    """The trace's metadata: MLflow's schema, source run and session, and ours (searchable keys)."""
    from mlflow.tracing.constant import TRACE_SCHEMA_VERSION, TRACE_SCHEMA_VERSION_KEY, TraceMetadataKey

    return {
        TRACE_SCHEMA_VERSION_KEY: str(TRACE_SCHEMA_VERSION),
        TraceMetadataKey.SOURCE_RUN: mlflow_run_id,
        TraceMetadataKey.TRACE_SESSION: session_id(row, step),
        RUN_KEY: str(row["run_id"]),
        ITERATION_KEY: str(step),
        SPLIT_KEY: str(row["split"]),
        TAG_KEY: str(row["env_tag"]),
        SEED_KEY: str(int(row["seed"])),
        GROUP_KEY: str(int(row["group_id"])),
        ENV_KEY: str(int(row["env_id"])),
        SUCCESS_KEY: "true" if bool(row["success"]) else "false",
    }


def _span(
    trace_id: str,
    span_id: int,
    parent_id: int | None,
    name: str,
    span_type: str,
    start_ns: int,
    end_ns: int,
    inputs: Any,
    outputs: Any,
    attributes: Mapping[str, Any],
    status: Status,
) -> Span:
    """An ended MLflow span built directly (no tracer provider: nothing global is touched)."""
    from mlflow.entities import Span
    from mlflow.tracing.constant import SpanAttributeKey
    from mlflow.tracing.utils import build_otel_context, dump_span_attribute_value
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

    otel_trace_id = int(trace_id.removeprefix("tr-"), 16)
    attrs = {
        SpanAttributeKey.REQUEST_ID: trace_id,
        SpanAttributeKey.SPAN_TYPE: span_type,
        SpanAttributeKey.INPUTS: inputs,
        SpanAttributeKey.OUTPUTS: outputs,
        **attributes,
    }
    return Span(
        ReadableSpan(
            name=name,
            context=build_otel_context(otel_trace_id, span_id),
            parent=build_otel_context(otel_trace_id, parent_id) if parent_id is not None else None,
            start_time=start_ns,
            end_time=end_ns,
            # MLflow keeps every attribute as a JSON string (what its own spans and readers expect)
            attributes={k: dump_span_attribute_value(v) for k, v in attrs.items() if v is not None},
            status=status,
            resource=Resource.get_empty(),
        )
    )


# ---------------------------------------------------------------------------- logging
Trace = tuple["TraceInfo", list["Span"]]


def traces_of_file(
    path: str | os.PathLike[str],
    step: int,
    *,
    experiment_id: str,
    mlflow_run_id: str,
    per_tag: int,
    cap: int,
    groups: Sequence[GroupDecision] | None = None,
) -> list[Trace]:
    """The traces of one trajectory file of MLflow step ``step``, built but not sent: a train file's
    sample (``per_tag`` per env tag; ``groups``: the filter's record of its groups, None: no filter
    feedback), or every row of a validation file; at most ``cap``. A damaged file raises
    ``TrajectoryFileError``."""
    if cap <= 0:
        return []
    table = read_table(path).select(list(COLUMNS))
    if table.num_rows == 0:
        return []
    train = table.column("split")[0].as_py() == "train"
    if train and per_tag <= 0:
        return []
    if not train:  # not filtered: every group is what the validation counts
        groups = group_decisions(table, range(table.num_rows))
    by_id = {g.group_id: g for g in groups} if groups is not None else None
    rows = choose_train(table, per_tag, cap, by_id) if train else choose_all(table, cap)
    # when the episodes were stored; a millisecond apart, so MLflow's list keeps the sample's order
    start_ms = int(Path(path).stat().st_mtime * 1000)
    return [
        build_trace(
            row,
            step=step,
            experiment_id=experiment_id,
            mlflow_run_id=mlflow_run_id,
            start_ms=start_ms + n,
            group=by_id.get(row["group_id"]) if by_id is not None else None,
        )
        for n, row in enumerate(table.take(pa.array(rows, type=pa.int64())).to_pylist())
    ]


def send_traces(
    client: TracingClient | str, experiment_id: str, traces: Sequence[Trace], skip_existing: bool = False
) -> list[str]:
    """Write ``traces`` to the store of ``client`` (a ``TracingClient`` or a tracking URI): each trace's
    info (metadata, tags and feedback) in one call, then every span in one call. ``skip_existing``
    leaves out the traces the store already has (a step re-logged after a resume). Returns the ids
    sent; store errors are raised (the Tracker decides what they mean)."""
    from mlflow.entities import TraceData
    from mlflow.tracing.client import TracingClient
    from mlflow.tracing.constant import SpansLocation, TraceTagKey

    if not traces:
        return []
    tracing = client if isinstance(client, TracingClient) else TracingClient(client)
    if skip_existing:
        have = _existing(tracing, [info.trace_id for info, _ in traces])
        traces = [(info, spans) for info, spans in traces if info.trace_id not in have]
    stored = [tracing.start_trace(info) for info, _ in traces]
    try:
        tracing.log_spans(experiment_id, [s for _, spans in traces for s in spans])
    except NotImplementedError:  # a store without span logging keeps the spans as trace artifacts
        for info, (_, spans) in zip(stored, traces, strict=True):
            if info.tags.get(TraceTagKey.SPANS_LOCATION) != SpansLocation.TRACKING_STORE.value:
                tracing._upload_trace_data(info, TraceData(spans=spans))
    return [info.trace_id for info, _ in traces]


def log_episode_traces(
    client: TracingClient | str,
    experiment_id: str,
    mlflow_run_id: str,
    path: str | Path,
    step: int,
    *,
    per_tag: int,
    cap: int,
    groups: Sequence[GroupDecision] | None = None,
    skip_existing: bool = False,
) -> list[str]:
    """:func:`traces_of_file` then :func:`send_traces`: log one trajectory file's episodes as traces
    of the MLflow run ``mlflow_run_id`` in ``experiment_id``; returns the trace ids."""
    traces = traces_of_file(
        path,
        step,
        experiment_id=experiment_id,
        mlflow_run_id=mlflow_run_id,
        per_tag=per_tag,
        cap=cap,
        groups=groups,
    )
    return send_traces(client, experiment_id, traces, skip_existing)


def _existing(tracing: TracingClient, trace_ids: Sequence[str]) -> set[str]:
    """The ids among ``trace_ids`` that the store already has."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

    have = set()
    for trace_id in trace_ids:
        try:
            tracing.get_trace_info(trace_id)
        except MlflowException as e:
            if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            continue
        have.add(trace_id)
    return have
