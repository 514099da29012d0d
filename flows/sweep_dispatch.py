"""Sweep members on Prefect's scheduler: each member as a flow run of a deployment, picked up by the
workers of its work pool (``ragen sweep run --deployment ...``; see :mod:`flows.sweep`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from flows.train import TrainRequest
from ragen_core.sweep.spec import Member, SweepConfig, SweepError
from ragen_core.sweep.state import MemberState


class DispatchedSweep(Protocol):
    """What the dispatcher needs of the sweep it runs members for (``flows.sweep``'s run of a file)."""

    sweep: SweepConfig
    hash: str
    log: Any

    def entry(self, key: str) -> MemberState: ...

    def save(self) -> None: ...

    def prepare(self, m: Member) -> TrainRequest: ...

    def finish(self, m: Member, result: Mapping[str, Any] | None, exc: BaseException | None) -> None: ...


class WorkerDispatch:
    """Members as flow runs of a deployment (``run_deployment``), picked up by its work pool's workers:
    N workers, on this machine or others, train N members at once; a Prefect global concurrency limit,
    when given, caps how many train at a time whatever the number of workers.

    Every member is dispatched at once and then watched: its flow run's id is kept in the sweep's
    state, so a sweep run again waits for a member still in flight instead of dispatching it twice.
    Members that wait (no worker online, every slot of the limit taken) are reported every
    ``report_every_s`` seconds, saying for what; no worker online also on the first poll.

    A worker that dies mid-member (its machine or its process killed) leaves the member's flow run
    RUNNING on the server for good. A member whose training process has ended while its flow run is
    still not final after ``lost_after_s`` is lost: its flow run is set Crashed. A Crashed member
    (so set, or reported so by Prefect) is dispatched again, up to ``lost_retries`` times, to resume
    from its last completed iteration (nothing it logged is logged twice: resuming is exact); beyond
    that it is reported failed, with the fix. A Failed member (an error of the run) is not retried."""

    def __init__(
        self,
        sweep: DispatchedSweep,
        deployment: str,
        limit: str | None,
        poll_s: float = 2.0,
        report_every_s: float = 30.0,
        lost_after_s: float = 20.0,
        lost_retries: int = 1,
    ) -> None:
        self.sweep, self.deployment, self.limit = sweep, deployment, limit
        self.poll_s, self.report_every_s = poll_s, report_every_s
        self.lost_after_s, self.lost_retries = lost_after_s, lost_retries
        self._lost_since: dict[Any, float] = {}
        self._redispatched: dict[str, int] = {}
        self.pool = self.check()

    @staticmethod
    def client() -> Any:
        from prefect.client.orchestration import get_client

        return get_client(sync_client=True)

    def check(self) -> str:
        """The deployment's work pool; a missing deployment or limit is named with its fix, before any work."""
        from prefect.exceptions import ObjectNotFound

        with self.client() as client:
            try:
                pool = client.read_deployment_by_name(self.deployment).work_pool_name
            except ObjectNotFound:
                raise SweepError(
                    f"deployment {self.deployment!r} not found on the Prefect server; deploy it first "
                    "(`prefect --no-prompt deploy --all` from the repo root, see docs/deployments.md)"
                ) from None
            if self.limit:
                try:
                    client.read_global_concurrency_limit_by_name(self.limit)
                except ObjectNotFound:
                    raise SweepError(
                        f"concurrency limit {self.limit!r} does not exist; create it with "
                        f"`prefect gcl create {self.limit} --limit N` (N: members to train at once)"
                    ) from None
        return str(pool)

    def run(self, members: list[Member]) -> None:
        with self.client() as client:
            in_flight: dict[Any, Member] = {}
            for m in members:
                flow_run_id = self._dispatch(client, m)
                if flow_run_id is not None:
                    in_flight[flow_run_id] = m
            last_report, first_pass = time.monotonic(), True
            while in_flight:
                time.sleep(self.poll_s)
                runs = {fid: client.read_flow_run(fid) for fid in in_flight}
                states = {fid: r.state for fid, r in runs.items()}
                for fid, state in states.items():
                    crashed = state is not None and state.is_crashed()
                    if crashed or self._is_lost(fid, runs[fid], in_flight[fid]):
                        m = in_flight.pop(fid)
                        again = self._lost(client, m, fid, None if crashed else state)
                        if again is not None:
                            in_flight[again] = m
                    elif state is not None and state.is_final():
                        self._finish(in_flight.pop(fid), fid, state)
                # no worker online is said on the first pass (nothing will start until one is); the rest,
                # busy workers or taken slots, only once they have lasted report_every_s
                due = time.monotonic() - last_report >= self.report_every_s
                if in_flight and (due or (first_pass and not self._online_workers(client))):
                    last_report = time.monotonic()
                    # a member dispatched again in this pass has no state read yet (None: waiting)
                    self._report_waiting(client, {fid: states.get(fid) for fid in in_flight})
                first_pass = False

    def _dispatch(self, client: Any, m: Member) -> Any:
        """The member's flow run: the one still in flight from an earlier sweep run, else a new one."""
        from uuid import UUID

        from prefect.deployments import run_deployment

        e = self.sweep.entry(m.key)
        if e.flow_run_id and e.status == "running":
            state = client.read_flow_run(UUID(e.flow_run_id)).state
            if state is not None and not state.is_final():
                # worth a warning: an earlier sweep process of this sweep died with its members in flight
                self.sweep.log.warning(
                    "sweep: member %s is still in flight (flow run %s): waiting for it", m.key, e.flow_run_id
                )
                return UUID(e.flow_run_id)
        try:
            request = self.sweep.prepare(m).model_copy(update={"concurrency_limit": self.limit})
        except Exception as exc:
            self.sweep.finish(m, None, exc)
            return None
        # From sync code Prefect's sync-compatible run_deployment returns the FlowRun, not a coroutine.
        flow_run: Any = run_deployment(
            self.deployment,
            parameters={"request": request.model_dump()},
            timeout=0,
            tags=["ragen-sweep", self.sweep.sweep.name],
            idempotency_key=f"{self.sweep.hash}-{m.key}-{e.attempts}",
        )
        e.flow_run_id = str(flow_run.id)
        self.sweep.save()
        self.sweep.log.info(
            "sweep: member %s dispatched to %s (flow run %s)", m.key, self.deployment, flow_run.id
        )
        return flow_run.id

    def _is_lost(self, fid: Any, flow_run: Any, m: Member) -> bool:
        """The member's training process has ended (on this host) while its flow run is still not
        final, for ``lost_after_s`` in a row: a process that ends normally has reported its final
        state by then."""
        from ragen_core.run.run_lock import dead_holder

        run_dir, start = self.sweep.entry(m.key).run_path(), flow_run.start_time
        gone = run_dir and start is not None and dead_holder(run_dir, start.timestamp()) is not None
        if not gone:
            self._lost_since.pop(fid, None)
            return False
        first = self._lost_since.setdefault(fid, time.monotonic())
        return time.monotonic() - first >= self.lost_after_s

    def _lost(self, client: Any, m: Member, fid: Any, state: Any) -> Any:
        """A member whose infrastructure failed: its flow run Crashed (Prefect's state for a process
        that died, as opposed to Failed, an error of the run itself), or is lost (``state`` not
        final: crash it first). Dispatched again to resume, or reported failed with the fix."""
        from prefect.states import Crashed

        from ragen_core.run.run_dir import RunDir

        e = self.sweep.entry(m.key)
        done = RunDir(e.run_path() or "").last_complete()
        if state is None:
            why = f"flow run {fid} crashed (its process died)"
        else:
            why = f"its training process ended while flow run {fid} was still running (its worker or machine died)"
            client.set_flow_run_state(fid, Crashed(message=f"ragen sweep: {why}"), force=True)
        self._lost_since.pop(fid, None)
        tries = self._redispatched.get(m.key, 0)
        if tries < self.lost_retries:
            self._redispatched[m.key] = tries + 1
            self.sweep.log.warning(
                "sweep: member %s lost: %s; dispatching it again, to resume after iteration %s",
                m.key,
                why,
                done,
            )
            return self._dispatch(client, m)
        self.sweep.finish(
            m,
            None,
            RuntimeError(
                f"{why}, after {tries} dispatch(es) again; its run keeps iterations 1-{done}: run the "
                "sweep again with --retry-failed to resume it"
            ),
        )
        return None

    def _finish(self, m: Member, flow_run_id: Any, state: Any) -> None:
        from ragen_core.run.run_dir import RunDir

        if state.is_completed():
            run = RunDir(self.sweep.entry(m.key).run_path() or "")
            self.sweep.finish(m, {"last_iteration": run.last_complete()}, None)
        else:
            reason = f"flow run {flow_run_id} of {self.deployment} ended {state.name}: {state.message or ''}"
            self.sweep.finish(m, None, RuntimeError(reason.strip()))

    def _online_workers(self, client: Any) -> list[Any]:
        return [w for w in client.read_workers_for_work_pool(self.pool) if w.status == "ONLINE"]

    def _report_waiting(self, client: Any, states: Mapping[Any, Any]) -> None:
        """Say which members wait, and for what: a worker of the pool, or a slot of the limit."""
        from prefect.client.schemas.objects import StateType

        waiting = [
            fid
            for fid, s in states.items()
            if s is None or s.type in (StateType.SCHEDULED, StateType.PENDING)
        ]
        if waiting:
            online = self._online_workers(client)
            why = (
                f"no worker of work pool {self.pool!r} is online: start one with `prefect worker start --pool {self.pool}`"
                if not online
                else f"the {len(online)} online workers of work pool {self.pool!r} are busy"
            )
            self.sweep.log.warning("sweep: %d members waiting to start: %s", len(waiting), why)
        if self.limit and len(states) > len(waiting):
            gcl = client.read_global_concurrency_limit_by_name(self.limit)
            if gcl.active_slots >= gcl.limit:
                self.sweep.log.warning(
                    "sweep: started members may be waiting for a slot of concurrency limit %r (%d of %d taken)",
                    self.limit,
                    gcl.active_slots,
                    gcl.limit,
                )
