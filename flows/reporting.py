"""Where a user watching a run sees its progress: the line per iteration and the closing lines
(``ragen_core.progress`` writes them) go to the terminal and to the flow run's Prefect logs; the flow
run also gets a link artifact to its MLflow run, a progress artifact, and an event per Echo-Trap signal.

The CLI keeps Prefect's own INFO chatter off the terminal (``PREFECT_LOGGING_LEVEL=WARNING``, set by
``flows.settings``); these lines go through a child of the run logger whose own level is INFO. Python
logging hands a propagated record to every ancestor's handlers whatever the ancestors' levels, so
they reach Prefect's API handler (the flow run's logs in the UI) and the console handler alike.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from ragen_core.monitor import Signal

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from ragen_core.config import RagenConfig

#: The prefix of the Prefect events an Echo-Trap signal emits: ``ragen.echo-trap.entropy-collapse`` ...
ECHO_TRAP_EVENT = "ragen.echo-trap"


def progress_logger() -> logging.LoggerAdapter[logging.Logger]:
    """The current flow or task run's logger, one level below it and at INFO; outside a run (a flow's
    ``.fn`` called directly) the ``ragen.flows`` logger."""
    return _run_child_logger("ragen", to_console=True)


def prefect_only_logger() -> logging.LoggerAdapter[logging.Logger]:
    """Like :func:`progress_logger`, for lines the CLI prints itself in its own words: they go to the
    flow run's logs in Prefect and not to the terminal a second time (the child logger does not
    propagate to the console handler; it has Prefect's API handler of its own)."""
    return _run_child_logger("ragen-api", to_console=False)


def _run_child_logger(name: str, to_console: bool) -> logging.LoggerAdapter[logging.Logger]:
    from prefect.exceptions import MissingContextError
    from prefect.logging.handlers import APILogHandler

    try:
        base = get_run_logger()
    except MissingContextError:
        return logging.LoggerAdapter(logging.getLogger("ragen.flows"), {})
    if isinstance(base, logging.Logger):  # Prefect's stand-in while its run loggers are disabled
        return logging.LoggerAdapter(base, {})
    child = base.logger.getChild(name)
    child.setLevel(logging.INFO)
    if not to_console:
        child.propagate = False
        if not any(isinstance(h, APILogHandler) for h in child.handlers):
            child.addHandler(APILogHandler())
    return type(base)(child, base.extra)


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from ``parts``: Prefect wants lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")


def _in_flow_run() -> FlowRun | None:
    """The current flow run, or None outside one (a flow's ``.fn`` called directly, a plain test)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx.flow_run if ctx is not None and ctx.flow_run is not None else None


def name_flow_run(name: str | None, log: Any, tags: Iterable[str] = ()) -> None:
    """Rename this flow run once what it runs is known (``train/<run id>``, ``sweep/<sweep folder>``;
    before that Prefect shows the flow's plain name) and add ``tags`` to the ones it started with, in
    one API call. Tags a flow run is created with must be known before it starts; these come from
    the run's config, read inside the flow. A name or a tag is a convenience: an API that refuses it
    costs a warning, not the run."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    flow_run = _in_flow_run()
    if flow_run is None:
        return
    merged = sorted({*flow_run.tags, *tags})
    new_tags = merged if set(merged) != set(flow_run.tags) else None
    if name is None and new_tags is None:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name, tags=new_tags)
        flow_run.tags = merged  # the engine's copy: what later updates start from
    except (httpx.HTTPError, PrefectHTTPStatusError, OSError) as exc:
        log.warning("could not name or tag the Prefect flow run %r: %s", name, exc)


def env_tags(tags: Iterable[str]) -> list[str]:
    """Prefect tags ``env:<tag>`` for environment tags, each once, in their order."""
    return [f"env:{t}" for t in dict.fromkeys(tags)]


def train_tags(cfg: RagenConfig, info: Mapping[str, Any]) -> list[str]:
    """The Prefect tags of a training run (its flow run and every task run in it), to filter the flow
    runs page by: ``ragen``, ``env:<tag>`` per train and validation tag, ``adv_estimator:<name>``, and
    for a sweep member (``run.json``'s ``sweep`` / ``sweep_member``, written by the sweep before the
    member trains, whether in the sweep's process, a process of its own or on a worker)
    ``sweep:<name>`` and ``sweep-member:<key>``."""
    out = ["ragen", *env_tags([*cfg.train.tags, *cfg.val.tags])]
    out.append(f"adv_estimator:{cfg.learner.algorithm.adv_estimator}")
    if info.get("sweep"):
        out.append(f"sweep:{info['sweep']}")
    if info.get("sweep_member"):
        out.append(f"sweep-member:{info['sweep_member']}")
    return out


def flow_run_url(flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI: on the server this process talks to (its UI address,
    Prefect's ``ui_url``), else on the UI that ``ragen ui`` serves for the state folder (a flow run of
    the ephemeral server a ``ragen`` command starts when no PREFECT_API_URL is set lands in the state
    folder's Prefect database, which that UI shows; the ephemeral server has no UI of its own)."""
    from prefect.utilities.urls import url_for

    from ragen_core.state_folder import prefect_ui_url

    local = prefect_ui_url()
    return url_for("flow-run", obj_id=flow_run_id, default_base_url=local) or (
        f"{local}/runs/flow-run/{flow_run_id}"
    )


def link_mlflow_run(run_id: str, url: str | None, mlflow_run_id: str) -> None:
    """A link artifact on the flow run pointing at its MLflow run (a run on a store without a UI
    address gets a markdown artifact naming the MLflow run id instead)."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    if _in_flow_run() is None:
        return
    key = artifact_key("mlflow", run_id)
    if url:
        create_link_artifact(url, link_text=f"MLflow run of {run_id}", key=key, description="MLflow run")
    else:
        create_markdown_artifact(f"MLflow run id: `{mlflow_run_id}`", key=key, description="MLflow run")


def report_artifact(markdown: str, name: str, description: str, prefix: str = "report") -> None:
    """A markdown artifact ``<prefix>-<name>`` on the current flow run (none outside a flow run)."""
    from prefect.artifacts import create_markdown_artifact

    if _in_flow_run() is not None:
        create_markdown_artifact(markdown, key=artifact_key(prefix, name), description=description)


class PrefectObserver:
    """Shows a training loop in Prefect: a progress artifact updated after every iteration (its
    description is the iteration line), and each Echo-Trap signal as an event
    ``ragen.echo-trap.<signal>`` about the run, related to the flow run, which an automation can
    react to (pause, cancel, notify: docs/runs.md, "What a run shows in Prefect").

    The artifact is created on the caller's thread (Prefect links it to the flow run from the run
    context), and later updates go to the server from a worker thread: an update is an API round trip
    (20-130 ms on a busy 2-core machine) that the next iteration should not wait for. Updates that
    pile up are coalesced, the newest wins; :meth:`close` sends the last one.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.flow_run = _in_flow_run()
        self.progress_id: Any = None
        self._newest: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._updates: ThreadPoolExecutor | None = None
        self._client: Any = None
        self._warned = False

    def iteration_done(self, k: int, total: int, line: str) -> None:
        from prefect.artifacts import create_progress_artifact

        if self.flow_run is None:
            return
        percent = 100.0 * min(k, total) / max(total, 1)
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(
                percent, key=artifact_key("progress", self.run_id), description=line
            )
            return
        with self._lock:
            self._newest = (percent, line)
        if self._updates is None:
            self._updates = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragen-prefect-progress")
        self._updates.submit(self._send_newest)

    def _send_newest(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        with self._lock:
            newest, self._newest = self._newest, None
        if newest is None:  # a later call already sent it
            return
        try:
            # One client for the run: prefect.artifacts.update_progress_artifact builds a new one per
            # call, which took ~30 ms of CPU (under the GIL the rollouts share) each iteration.
            if self._client is None:
                self._client = get_client(sync_client=True).__enter__()
            self._client.update_artifact(
                artifact_id=self.progress_id, artifact=ArtifactUpdate(data=newest[0], description=newest[1])
            )
        except Exception as exc:  # a progress bar is a convenience: the run goes on without it
            if not self._warned:
                self._warned = True
                logging.getLogger("ragen.flows").warning(
                    "could not update the Prefect progress artifact: %s", exc
                )

    def close(self) -> None:
        """Send the last update and stop the worker thread."""
        if self._updates is not None:
            self._updates.shutdown(wait=True)
            self._updates = None
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None

    def signalled(self, k: int, signals: Sequence[Signal], action: str) -> None:
        from prefect.events import emit_event

        related = []
        if self.flow_run is not None:
            related.append(
                {
                    "prefect.resource.id": f"prefect.flow-run.{self.flow_run.id}",
                    "prefect.resource.role": "flow-run",
                    "prefect.resource.name": self.flow_run.name,
                }
            )
        for s in signals:
            emit_event(
                event=f"{ECHO_TRAP_EVENT}.{s.name.replace('_', '-')}",
                resource={
                    "prefect.resource.id": f"ragen.run.{self.run_id}",
                    "prefect.resource.name": self.run_id,
                },
                related=related,
                payload={
                    "iteration": k,
                    "signal": s.name,
                    "message": s.message,
                    "monitor_action": action,
                },
            )
