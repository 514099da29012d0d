"""The sweep flow: every member of a sweep file as a training run nested under one MLflow parent run.

``sweep(SweepRequest(path=...))``:

1. loads the sweep file, expands its members (``ragen_core.sweep.spec.expand``) and validates every
   member's config before anything runs; a member whose config cannot load (an impossible override)
   is recorded as failed (an MLflow child run with status FAILED and the error in the tag
   ``ragen.sweep_error``), and the others still run;
2. starts (or resumes) the parent run, tagged ``ragen.sweep`` = name;
3. trains the members: each gets its run directory and its MLflow child run up front (tags
   ``ragen.sweep``, ``ragen.sweep_member``, ``ragen.sweep_group``, ``ragen.seed``; the id goes into the
   run's ``run.json``), then runs as the training flow (``flows.train.train``) with
   ``TrainRequest(resume=<run dir>, parent_run_id=<parent>)``, which continues that child run;
4. writes the comparison report (``ragen_core.sweep.report.build_report``, from MLflow alone) into the
   state folder and logs it to the parent run (``report/``), tags the parent with each member's
   status, and ends it FINISHED (FAILED when a member failed).

State: ``<state>/sweeps/<name>-<hash>/state.json`` (``SweepState``) maps each member key to its run
and status, saved after every change. Running the same sweep again resumes it: finished members
are skipped, a member that was killed mid-way (status ``running``) resumes from its last completed
iteration in the same run directory and MLflow run, and failed members are retried only with
``retry_failed`` (in their run directory, from their last completed iteration). A member whose run
directory already holds every iteration but whose state is not ``finished`` (the sweep was killed
between the two) is resumed too: that only redoes the run's finalisation. ``resume=False`` starts
a new parent run and new run directories (the old state file is kept as ``state.<time>.json``).

Concurrency: ``concurrency: 1`` (the default, and what a 2-core machine wants) trains the members
one after the other inside this process, each as a Prefect subflow of the sweep. With
``concurrency: N > 1`` each member runs in its own process (``python -m flows.cli train --resume
<run dir>``, log in ``<state folder>/logs/<member>.log``), at most N at once: torch and Ray keep
process-global state (RNG, thread pools, the Ray session), so members never share a process. Those
member flows are separate flow runs in Prefect (their MLflow runs are still nested). With more than
one member at once, point MLflow at a server (``MLFLOW_TRACKING_URI=http://...``) and Prefect at a
server (``PREFECT_API_URL``): a local SQLite store locks under concurrent writers.

On Prefect's scheduler (``deployment``, ``ragen sweep run --deployment ragen-train/ragen-train``):
every member is dispatched at once as a flow run of that deployment onto its work pool
(:class:`flows.sweep_dispatch.WorkerDispatch`), so as many workers as there are, on this machine or others, train that
many members at once; ``concurrency_limit`` names a Prefect global concurrency limit whose slot each
member holds while it trains (``TrainRequest.concurrency_limit``), in place of ``concurrency``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import BaseModel, Field

from flows.reporting import name_flow_run, progress_logger, report_artifact
from flows.settings import configure_environment
from flows.sweep_dispatch import WorkerDispatch
from flows.train import TrainRequest
from ragen_core.config.tracking import TrackingConfig
from ragen_core.progress import line_prefix
from ragen_core.state_folder import index_entry
from ragen_core.sweep.report import build_report, publish_report
from ragen_core.sweep.spec import (
    Member,
    SweepConfig,
    expand,
    load_sweep,
    sweep_hash,
    validate_members,
)
from ragen_core.sweep.state import MemberState, SweepState, sweep_lock
from ragen_core.sweep.tags import (
    COMPARE_TAG,
    DESCRIPTION_TAG,
    ERROR_TAG,
    GROUP_TAG,
    INDEX_TAG,
    MEMBER_TAG,
    OVERRIDES_TAG,
    ROLE_TAG,
    SEED_TAG,
    SWEEP_HASH_TAG,
    SWEEP_TAG,
)
from ragen_core.tracking.tracker import Tracker

TrainFn = Callable[[TrainRequest], Mapping[str, Any]]


class SweepRequest(BaseModel):
    """Which sweep to run (the Prefect UI shows this as a form)."""

    path: str = Field(description="sweep file (YAML), e.g. sweeps/tiny/filter-ratio.yaml")
    resume: bool = Field(default=True, description="continue this sweep's state (False: a new parent run)")
    retry_failed: bool = Field(default=False, description="run failed members again")
    concurrency: int | None = Field(default=None, ge=1, description="overrides the file's concurrency")
    report_dir: str | None = Field(default=None, description="default: <state>/sweeps/<name>-<hash>/report")
    deployment: str | None = Field(
        default=None,
        description="run the members as flow runs of this deployment (e.g. ragen-train/ragen-train) on its "
        "work pool's workers, all dispatched at once, instead of in processes of this machine",
    )
    concurrency_limit: str | None = Field(
        default=None,
        description="with deployment: each member holds a slot of this Prefect global concurrency limit while "
        "it trains (e.g. gpu; create it with `prefect gcl create gpu --limit N`)",
    )


def _log() -> Any:
    """The sweep's lines, at INFO, in the terminal and the flow run's logs (Prefect's run logger alone
    shows only warnings in the terminal: the member headers and the sweep's start line went unseen)."""
    return progress_logger()


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 4000 else text[:3997] + "..."


# ------------------------------------------------------------------------------------ runners
def subprocess_train(request: TrainRequest, log_file: Path) -> dict[str, Any]:
    """Train one member in its own process (``ragen train --resume <run dir>``); the run directory
    and its ``run.json`` (with the MLflow child run id) must exist already."""
    from ragen_core.run.run_dir import RunDir

    assert request.resume, "subprocess members resume a prepared run directory"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flows.cli", "train", "--resume", request.resume]
    if request.backend:
        cmd += ["--backend", request.backend]
    with open(log_file, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            cwd=Path(__file__).resolve().parents[1],
        ).returncode
    if code != 0:
        tail = log_file.read_text()[-2000:]
        raise RuntimeError(f"member process exited with {code} (log {log_file}):\n{tail}")
    run = RunDir(request.resume)
    info = run.info()
    return {
        "run_id": info.get("run_id"),
        "run_dir": str(run.root),
        "mlflow_run_id": info.get("mlflow_run_id"),
        "last_iteration": run.last_complete(),
    }


def in_process_train(request: TrainRequest) -> dict[str, Any]:
    """The training flow in this process (a subflow when called from the sweep flow)."""
    from flows.train import train

    return dict(train(request))


# ------------------------------------------------------------------------------------ the sweep
class _Sweep:
    """One execution of a sweep (state, trackers); ``run_sweep`` is its entry point."""

    def __init__(self, request: SweepRequest, train_fn: TrainFn | None, state_dir: Path) -> None:
        self.request = request
        self.state_dir = state_dir
        self.sweep: SweepConfig = load_sweep(request.path)
        self.hash = sweep_hash(self.sweep)
        self.members: list[Member] = expand(self.sweep)
        self.configs, self.errors = validate_members(self.sweep, self.members)
        self.concurrency = request.concurrency or self.sweep.concurrency
        self.train_fn = train_fn
        self.folder = SweepState.folder(state_dir, self.sweep)
        self.state_path = self.folder / "state.json"
        self.lock = threading.Lock()
        self.log = _log()
        self.folder.mkdir(parents=True, exist_ok=True)
        # One `ragen sweep run` of a sweep at a time (two trained every member twice, and the last
        # to save state.json orphaned the other's runs); released at the end of run_sweep.
        self.sweep_lock = sweep_lock(self.folder).acquire()
        try:
            self._open(request, state_dir)
        except BaseException:
            self.sweep_lock.release()
            raise

    def _open(self, request: SweepRequest, state_dir: Path) -> None:
        old = SweepState.load(self.state_path)
        if old is not None and not request.resume:
            os.replace(self.state_path, self.folder / f"state.{time.strftime('%Y%m%d-%H%M%S')}.json")
            old = None
        self.state = old or SweepState(name=self.sweep.name, hash=self.hash, sweep_file=str(request.path))
        self.tracking = self._tracking_config()
        self.parent = Tracker(self.tracking, state_dir)
        self.dispatch = (
            WorkerDispatch(self, request.deployment, request.concurrency_limit)
            if request.deployment
            else None
        )

    def _tracking_config(self) -> TrackingConfig:
        from ragen_core.config import load_config

        if self.configs:
            return next(iter(self.configs.values())).tracking
        try:
            return load_config(self.sweep.base, self.sweep.overrides).tracking
        except Exception:
            return TrackingConfig()

    def save(self) -> None:
        with self.lock:
            self.state.save(self.state_path)

    def entry(self, key: str) -> MemberState:
        return self.state.members.setdefault(key, MemberState())

    # ---------------------------------------------------------------- MLflow
    def start_parent(self) -> str:
        s = self.sweep
        params = {
            "sweep.name": s.name,
            "sweep.base": s.base,
            "sweep.overrides": s.overrides,
            "sweep.grid": s.grid,
            "sweep.members": [m.model_dump() for m in s.members],
            "sweep.seeds": s.seeds,
            "sweep.seed_keys": s.seed_keys,
            "sweep.n_members": len(self.members),
        }
        tags = {
            SWEEP_TAG: s.name,
            SWEEP_HASH_TAG: self.hash,
            ROLE_TAG: "parent",
            "ragen.sweep.file": str(self.request.path),
            COMPARE_TAG: json.dumps(s.compare),
            DESCRIPTION_TAG: s.description,
            "ragen.sweep.state": str(self.state_path.resolve()),
        }
        try:
            from prefect.context import get_run_context

            tags["prefect.flow_run_id"] = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
        except Exception:
            pass
        run_id = self.parent.start(f"sweep-{s.name}", params, tags=tags, run_id=self.state.parent_run_id)
        self.state.parent_run_id = run_id
        self.save()
        if self.tracking.log_artifacts:
            self.parent.log_artifact(self.request.path, "sweep")
        return run_id

    def _child_tags(self, m: Member) -> dict[str, str]:
        return {
            SWEEP_TAG: self.sweep.name,
            SWEEP_HASH_TAG: self.hash,
            ROLE_TAG: "member",
            MEMBER_TAG: m.key,
            GROUP_TAG: m.group,
            SEED_TAG: str(m.seed),
            INDEX_TAG: str(m.index),
            OVERRIDES_TAG: json.dumps(list(m.own_overrides)),
        }

    def _child_exists(self, run_id: str | None) -> bool:
        if not run_id:
            return False
        try:
            self.parent.client.get_run(run_id)
            return True
        except Exception:
            return False

    def new_child(self, m: Member, tracking: TrackingConfig) -> str:
        """Create the member's child run (RUNNING; the training flow continues and ends it), named by
        its member key (``no-filter-s0``: the parent says which sweep; a ragen run id such as
        ``ab.no-filter-s0-330cc256-fa7af7`` was cut short everywhere in the UI). The training flow
        tags it with the ragen run id when it takes the run over."""
        child = Tracker(tracking, self.state_dir)
        return child.start(m.key, {}, tags=self._child_tags(m), parent_run_id=self.state.parent_run_id)

    def fail_child(self, run_id: str, error: str) -> None:
        client = self.parent.client
        client.set_tag(run_id, ERROR_TAG, error[:7900])
        if client.get_run(run_id).info.status != "FAILED":
            client.set_terminated(run_id, status="FAILED")

    # ---------------------------------------------------------------- members
    def record_invalid(self, m: Member) -> None:
        """A member whose config cannot load: a FAILED child run holding the error."""
        e = self.entry(m.key)
        error = self.errors[m.key]
        error = error if error.startswith("invalid config") else f"invalid config: {error}"
        if not self._child_exists(e.mlflow_run_id):
            e.mlflow_run_id = self.new_child(m, self.tracking)
        self.fail_child(e.mlflow_run_id, error)  # type: ignore[arg-type]
        e.status, e.error, e.attempts, e.updated = "failed", error, e.attempts + 1, time.time()
        self.save()
        self.log.warning("sweep %s: member %s is invalid: %s", self.sweep.name, m.key, self.errors[m.key])

    def prepare(self, m: Member) -> TrainRequest:
        """The member's run directory and child run (created once; reused when resuming)."""
        from ragen_core.run.run_dir import RunDir, create_run
        from ragen_core.run.stages import SHARED_WARM_STARTS_KEY

        cfg = self.configs[m.key]
        e = self.entry(m.key)
        path = e.run_path()
        run = RunDir(path) if path is not None else None
        if run is None or not run.config_path.exists():
            run = create_run(cfg, m.run_name(self.sweep))
            e.run_dir, e.run_id = index_entry(run.root), run.info()["run_id"]
            e.mlflow_run_id = None
        info = run.info()
        if not self._child_exists(info.get("mlflow_run_id")):
            e.mlflow_run_id = self.new_child(m, cfg.tracking)
            run.update_info(mlflow_run_id=e.mlflow_run_id)
        else:
            e.mlflow_run_id = info["mlflow_run_id"]
        run.update_info(
            sweep=self.sweep.name,
            sweep_member=m.key,
            sweep_group=m.group,  # its policies register as versions of the group's model
            sweep_parent_run_id=self.state.parent_run_id,
            # members of the same config and seed share one warm start (ragen_core.run.stages)
            **{SHARED_WARM_STARTS_KEY: index_entry(self.folder / "warm_starts")},
        )
        e.status, e.error, e.attempts, e.updated = "running", None, e.attempts + 1, time.time()
        self.save()
        return TrainRequest(
            config=self.sweep.base,
            overrides=list(m.overrides),
            resume=str(run.root.resolve()),
            run_name=m.run_name(self.sweep),
            parent_run_id=self.state.parent_run_id,
        )

    def finish(self, m: Member, result: Mapping[str, Any] | None, exc: BaseException | None) -> None:
        e = self.entry(m.key)
        if exc is None:
            e.status, e.error = "finished", None
            e.last_iteration = (result or {}).get("last_iteration")
            self.log.info(
                "sweep %s: member %s finished (%s iterations)", self.sweep.name, m.key, e.last_iteration
            )
        else:
            e.status, e.error = "failed", _error_text(exc)
            self.log.warning("sweep %s: member %s failed: %s", self.sweep.name, m.key, e.error)
            if e.mlflow_run_id:
                try:
                    self.fail_child(e.mlflow_run_id, e.error)
                except Exception as tag_exc:  # the store itself may be what failed
                    self.log.warning("could not mark child run %s failed: %s", e.mlflow_run_id, tag_exc)
        e.updated = time.time()
        self.save()

    def todo(self) -> list[Member]:
        """Members to train now (invalid ones are recorded as failed on the way)."""
        out = []
        for m in self.members:
            e = self.state.members.get(m.key)
            if e is not None and e.status == "finished":
                continue
            if e is not None and e.status == "failed" and not self.request.retry_failed:
                continue
            if m.key in self.errors:
                self.record_invalid(m)
                continue
            out.append(m)
        return out

    def run_members(self, members: list[Member]) -> None:
        if not members:
            return
        if self.dispatch is not None:
            self.dispatch.run(members)
            return
        if self.concurrency <= 1:
            fn = self.train_fn or in_process_train
            for i, m in enumerate(members, 1):
                self.log.info("sweep %s: member %d/%d, %s", self.sweep.name, i, len(members), m.key)
                try:
                    with line_prefix(f"{m.key} {i}/{len(members)}"):
                        result = fn(self.prepare(m))
                except Exception as exc:
                    self.log.debug("%s", traceback.format_exc())
                    self.finish(m, None, exc)
                else:
                    self.finish(m, result, None)
            return
        logs = self.folder / "logs"

        def call(request: TrainRequest, key: str) -> Mapping[str, Any]:
            if self.train_fn is not None:
                return self.train_fn(request)
            return subprocess_train(request, logs / f"{key}.log")

        pending = list(members)
        running: dict[Future[Mapping[str, Any]], Member] = {}
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="sweep-member") as pool:
            while pending or running:
                while pending and len(running) < self.concurrency:
                    m = pending.pop(0)
                    try:
                        request = self.prepare(m)  # MLflow and state writes stay in this thread
                    except Exception as exc:
                        self.finish(m, None, exc)
                        continue
                    running[pool.submit(call, request, m.key)] = m
                    self.log.info(
                        "sweep %s: member %s started (%d running); its lines go to %s",
                        self.sweep.name,
                        m.key,
                        len(running),
                        logs / f"{m.key}.log",
                    )
                if not running:
                    continue
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    m = running.pop(fut)
                    error = fut.exception()
                    self.finish(m, None if error else fut.result(), error)

    # ---------------------------------------------------------------- the end
    def summarize_parent(self) -> dict[str, list[str]]:
        by_status: dict[str, list[str]] = {}
        tags: dict[str, str] = {}
        for m in self.members:
            e = self.state.members.get(m.key, MemberState())
            by_status.setdefault(e.status, []).append(m.key)
            tags[f"ragen.sweep.member.{m.key}"] = e.status + (f": {e.error}" if e.error else "")
        tags["ragen.sweep.finished"] = ",".join(by_status.get("finished", [])) or "-"
        tags["ragen.sweep.failed"] = ",".join(by_status.get("failed", [])) or "-"
        tags["ragen.sweep.summary"] = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_status.items()))
        self.parent.set_tags(tags)
        return by_status

    def report(self) -> Path:
        out = Path(self.request.report_dir) if self.request.report_dir else self.folder / "report"
        rep = build_report(self.parent, self.state.parent_run_id)  # type: ignore[arg-type]
        markdown = publish_report(rep, self.parent, out, self.tracking.log_artifacts)
        # The same report on the sweep's flow run, its curves served by MLflow's UI.
        report_artifact(markdown, self.folder.name, f"sweep report, also in {out}")
        return out


def run_sweep(
    request: SweepRequest, train_fn: TrainFn | None = None, state_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The sweep as a plain function (the flow's body). ``train_fn`` replaces the training call
    (tests); by default members train in this process (concurrency 1) or in their own processes."""
    state = configure_environment(state_dir)
    s = _Sweep(request, train_fn, state)
    try:
        return _run(s)
    finally:
        s.sweep_lock.release()


def _run(s: _Sweep) -> dict[str, Any]:
    name_flow_run(f"sweep/{s.folder.name}", s.log, tags=["ragen", f"sweep:{s.sweep.name}"])
    parent = s.start_parent()
    log = s.log
    log.info(
        "sweep %s: %d members (%d invalid), parent run %s, state %s",
        s.sweep.name,
        len(s.members),
        len(s.errors),
        parent,
        s.state_path,
    )
    status = "FAILED"
    try:
        s.run_members(s.todo())
        by_status = s.summarize_parent()
        report_dir = s.report()
        status = "FINISHED" if not by_status.get("failed") and not by_status.get("running") else "FAILED"
        return {
            "name": s.sweep.name,
            "parent_run_id": parent,
            "state_file": str(s.state_path),
            "report_dir": str(report_dir),
            "members": {k: v.model_dump() for k, v in s.state.members.items()},
            "finished": by_status.get("finished", []),
            "failed": by_status.get("failed", []),
        }
    finally:
        s.parent.end(status)  # type: ignore[arg-type]


@flow(name="ragen-sweep", flow_run_name="sweep")
def sweep(request: SweepRequest) -> dict[str, Any]:
    """Train every member of a sweep file under one MLflow parent run and write the comparison report."""
    return run_sweep(request)
