"""Pipeline overhead: N training iterations through the Prefect flows against a plain Python loop.

- ragen-flow: ``flows.train.train`` (the Prefect flow a user runs) resuming a prepared run
  directory: per iteration the ``ragen-iteration`` subflow or parent task run (the config's
  ``trainer.iteration_as``; ``--iteration-as`` overrides) with its rollout / filter / learn (and, at
  the last iteration, evaluate) tasks (cache keys, result persistence), the trajectories written to
  and read back from Parquet, the checkpoint (policy + critic + optimiser) written, ``metrics.json``
  and the DONE mark written, then the Echo-Trap monitor and the MLflow logging (one ``log_batch``,
  the Parquet artifact, sample transcripts appended to the run's table).
- plain: the same library calls in a plain loop, in memory: ``RolloutWorker.rollout`` (the
  trajectories table), the StarPO-S filter (``ragen_core.run.stages.select_rollouts``),
  ``learner.step(to_token_batch(kept rows))``, the weight sync; the same validation rollout at the
  last iteration. No Prefect, no MLflow, no Parquet, no checkpoints.

Both sides run in this process with the same config (``configs/bandit-tiny.yaml`` with
``trainer.iterations=N``, validation only after the last iteration, 1 torch thread), the same
backend (``local`` for the headline; ``--ray`` adds the Ray variant) and the same starting policy:
the SFT warm start is run once (cached in ``~/.cache/ragen-flow/bench-pipeline/``; ``--fresh`` redoes
it) and copied into both run directories, so neither side trains it. Each side has its own live
``Session`` (rollout worker + learner), built before its first iteration (untimed there, reported
as start-up). The two sides do the same work: same seeds, same weights, so the same trajectories
(checked: per-iteration mean score and kept rows must match).

Measurement on a shared machine: the iterations are interleaved pairwise, in ABBA order (plain 1,
flow 1, flow 2, plain 2, plain 3, flow 3, ...): the flow's iteration subflow is wrapped, and the
plain iteration runs in the wrapper, outside the flow's clock. A flow iteration's time runs from
its subflow call to the next subflow call (or the end of the loop), so it includes the monitor and
the MLflow logging of that iteration. Iteration 1 of each side (first calls: imports, first MLflow
write, allocator warm-up) is reported apart; the headline is the median over iterations 2..N of
the per-iteration ratio flow / plain; the fixed overhead is the median of flow - plain.
CPU seconds per iteration are printed too (this process, all threads, plus the Prefect server and
the MLflow logging process, read from /proc; local backend only): they move much less with the
machine's load. So is where the flow's main thread was when it was not running (waiting for a core,
or asleep), and what the process's other threads (Prefect's event loop, the progress artifact's
worker) used: on a 2-core machine those are what background work costs the loop.

One-time costs (reported, not in the ratio): the warm start, Session construction, Prefect's
ephemeral server start and the flow-run creation, the MLflow run start, and the end of the flow
(plots, final-model artifacts).

Breakdown: during the flow's iterations the parts that are not Prefect's own engine are timed by
wrapping them (outermost wrapper only, so nothing is counted twice): the library work both sides
share, Parquet writes and reads, checkpoint writes, JSON / DONE writes, config reloads, Prefect's
stage-record digests, result persistence and cache lookups, MLflow log_batch, artifact uploads and
transcripts. The rest is Prefect's task / subflow engine (state changes, events, API calls to the
ephemeral server) and small glue. ``--profile`` adds a cProfile of the flow's iterations (main
thread) with the top entries by cumulative time.

Usage: ``python benchmarks/pipeline.py [--quick] [--iterations N] [--ray] [--profile]``. The last
line reads ``BENCH pipeline_overhead ratio=<flow/plain> target=<=1.15 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_core.state_folder import cache_dir  # noqa: E402 - after the path: the benchmark runs from a checkout

TARGET = 1.15
CACHE = cache_dir() / "bench-pipeline"


# ------------------------------------------------------------------------------------ timing
class Clock:
    """Accumulates wall time of wrapped calls while ``active`` (main thread, outermost call only)."""

    def __init__(self) -> None:
        self.active = False
        self.depth = 0
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, label: str, when: Callable[..., bool] | None = None) -> None:
        orig = getattr(owner, attr)

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if (
                not self.active
                or self.depth
                or threading.current_thread() is not threading.main_thread()
                or (when is not None and not when(*args, **kwargs))
            ):
                return orig(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.depth -= 1
                self.totals[label] += time.perf_counter() - t0
                self.counts[label] += 1

        setattr(owner, attr, wrapper)

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


# Labels, grouped for the report: (group, label)
SHARED = "library work (both sides)"
PIPE = "pipeline storage (flow only)"
PREFECT = "Prefect (flow only)"
MLFLOW = "MLflow (flow only)"
LOOP = "loop bookkeeping (flow only)"
LABELS = [
    (SHARED, "worker rollout"),
    (SHARED, "learner step"),
    (SHARED, "weight sync"),
    (SHARED, "token batch"),
    (SHARED, "collapse probe"),
    (PIPE, "Parquet write"),
    (PIPE, "Parquet read"),
    (PIPE, "checkpoint save + tokenizer copy"),
    (PIPE, "JSON / DONE writes (fsync)"),
    (PIPE, "response metrics from table"),
    (PIPE, "run.config() / run.info()"),
    (PIPE, "stage records (digests)"),
    (PREFECT, "result persistence"),
    (PREFECT, "cache lookups"),
    (MLFLOW, "log_iteration (log_batch)"),
    (MLFLOW, "artifact upload (rollouts/eval Parquet)"),
    (MLFLOW, "transcripts (read Parquet + json + log_table)"),
    (LOOP, "finish_iteration (metrics.json, sums, DONE)"),
    (LOOP, "Echo-Trap monitor"),
    (LOOP, "run-logger INFO lines (console + Prefect API handler)"),
    (LOOP, "Prefect progress artifact"),
    (LOOP, "background queue submit"),
]


def instrument(clock: Clock) -> None:
    import prefect.results

    from ragen_core.learner import actors
    from ragen_core.run import log_process, run_dir, session, stage_record, stages, step_log, training
    from ragen_core.tracking import tracker

    clock.wrap(
        session.Session, "call_worker", "worker rollout", when=lambda self, method, *a: method == "rollout"
    )
    for cls in (actors.LearnerWorker, actors.LearnerGroup):
        clock.wrap(cls, "step", "learner step")
        clock.wrap(cls, "save_checkpoint", "checkpoint save + tokenizer copy")
    clock.wrap(session.Session, "sync_weights", "weight sync")
    clock.wrap(stages, "to_token_batch", "token batch")
    clock.wrap(stages, "collapse_metrics", "collapse probe")
    clock.wrap(stages, "write_table", "Parquet write")
    clock.wrap(stages, "read_table", "Parquet read")
    clock.wrap(stages, "copy_tokenizer", "checkpoint save + tokenizer copy")
    clock.wrap(stages, "atomic_write_text", "JSON / DONE writes (fsync)")
    clock.wrap(run_dir, "atomic_write_text", "JSON / DONE writes (fsync)")
    clock.wrap(stages, "_response_metrics", "response metrics from table")
    clock.wrap(run_dir.RunDir, "config", "run.config() / run.info()")
    clock.wrap(run_dir.RunDir, "info", "run.config() / run.info()")
    clock.wrap(stage_record, "load", "stage records (digests)")
    clock.wrap(stage_record, "save", "stage records (digests)")
    clock.wrap(prefect.results.ResultStore, "persist_result_record", "result persistence")
    clock.wrap(prefect.results.ResultStore, "exists", "cache lookups")
    clock.wrap(prefect.results.ResultStore, "read", "cache lookups")
    clock.wrap(tracker.Tracker, "log_iteration", "log_iteration (log_batch)")
    clock.wrap(tracker.Tracker, "log_artifact", "artifact upload (rollouts/eval Parquet)")
    clock.wrap(tracker.Tracker, "log_transcripts", "transcripts (read Parquet, HTML page, log_table)")
    clock.wrap(tracker.Tracker, "log_text", "transcripts (read Parquet, HTML page, log_table)")
    clock.wrap(step_log, "transcript_rows", "transcripts (read Parquet, HTML page, log_table)")
    clock.wrap(tracker.Tracker, "log_episode_traces", "episode traces")
    clock.wrap(training, "log_kept_models", "logged models (once, at the end)")
    import flows.reporting
    import flows.train

    clock.wrap(flows.train, "finish_iteration", "finish_iteration (metrics.json, sums, DONE)")
    clock.wrap(training.EchoTrapMonitor, "update", "Echo-Trap monitor")
    clock.wrap(logging.LoggerAdapter, "info", "run-logger INFO lines (console + Prefect API handler)")
    clock.wrap(flows.reporting.PrefectObserver, "iteration_done", "Prefect progress artifact")
    clock.wrap(step_log.LocalStepLog, "submit", "background queue submit")
    clock.wrap(log_process.ProcessStepLog, "submit", "background queue submit")


class ChildCPU:
    """CPU seconds used so far by this process's child processes whose command line holds ``marker``
    (the Prefect server: uvicorn; the MLflow logging process), from /proc."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.pids: list[int] = []
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _find(self) -> list[int]:
        me, pids = os.getpid(), []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                if (
                    int(stat.rsplit(")", 1)[1].split()[1]) == me
                    and self.marker in (d / "cmdline").read_bytes()
                ):
                    pids.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
        return pids

    def __call__(self) -> float:
        if not Path("/proc").is_dir():
            return float("nan")
        if not self.pids:  # until it has started
            self.pids = self._find()
        total = 0.0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self.tick
            except (OSError, ValueError, IndexError):
                continue
        return total


SERVER_CPU = ChildCPU(b"prefect")
LOGGING_CPU = ChildCPU(b"ragen_core.run.log_process")


def cpu_now() -> tuple[float, float]:
    """(this process's CPU seconds, all threads; the Prefect server's and the logging process's)."""
    return time.process_time(), SERVER_CPU() + LOGGING_CPU()


def main_runqueue_wait() -> float:
    """Seconds the calling thread has been runnable but waiting for a core (Linux schedstat; 0
    elsewhere): what other processes and threads took from it, as against its own sleeping."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def threads_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id (Linux; empty elsewhere)."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
    return out


def other_threads_cpu(before: dict[int, float]) -> dict[str, float]:
    """CPU seconds each thread other than this one used since ``before`` (by thread name)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    out: dict[str, float] = defaultdict(float)
    for tid, seconds in threads_cpu().items():
        if tid != me:
            out[names.get(tid, f"thread {tid}")] += seconds - before.get(tid, 0.0)
    return dict(out)


# ------------------------------------------------------------------------------------ set-up
def bench_config(
    config: str,
    iterations: int,
    backend: str,
    threads: int,
    run_root: Path,
    iteration_as: str | None = None,
    extra: list[str] | None = None,
) -> Any:
    from ragen_core.config import load_config

    return load_config(
        config,
        [
            *([f"trainer.iteration_as={iteration_as}"] if iteration_as else []),
            f"trainer.backend={backend}",
            f"trainer.iterations={iterations}",
            "trainer.val_before_train=false",
            "trainer.eval_every=0",
            f"trainer.rollout_threads={threads}",
            f"trainer.run_root={run_root}",
            *(extra or []),
        ],
    )


def warm_start_once(cfg: Any, fresh: bool) -> tuple[Path, float, bool]:
    """The SFT warm start of ``cfg``, cached by (model, sft, agent) config; (path, seconds, cached)."""
    from ragen_core.run.run_dir import RunDir
    from ragen_core.run.stages import init_policy_stage

    key = hashlib.sha256(
        json.dumps(
            [
                cfg.model.model_dump(mode="json"),
                cfg.sft.model_dump(mode="json") if cfg.sft else None,
                cfg.agent.model_dump(mode="json"),
            ],
            sort_keys=True,
        ).encode()
    )
    path = CACHE / f"init_policy-{key.hexdigest()[:16]}"
    if (path / "config.json").exists() and not fresh:
        seconds = json.loads((path / "bench_seconds.json").read_text())["seconds"]
        return path, seconds, True
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    run = RunDir(tmp)
    t0 = time.perf_counter()
    init_policy_stage(cfg, run)
    seconds = time.perf_counter() - t0
    (run.init_policy / "bench_seconds.json").write_text(json.dumps({"seconds": seconds}))
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run.init_policy, path)
    shutil.rmtree(tmp, ignore_errors=True)
    return path, seconds, False


def new_run(cfg: Any, name: str, init_policy: Path) -> Any:
    from ragen_core.run.run_dir import create_run

    run = create_run(cfg, name)
    shutil.copytree(init_policy, run.init_policy)
    return run


# ------------------------------------------------------------------------------------ plain loop
class Plain:
    """The plain loop's iterations, one call per iteration, on its own live Session."""

    def __init__(self, cfg: Any, run: Any, backend: str) -> None:
        from ragen_core.run.session import Session

        t0 = time.perf_counter()
        self.session = Session(cfg, run, backend=backend)
        self.start_s = time.perf_counter() - t0
        self.cfg, self.run_id = cfg, run.info()["run_id"]
        self.times: dict[int, float] = {}
        self.cpu: dict[int, tuple[float, float]] = {}
        self.main_cpu: dict[int, float] = {}
        self.parts: dict[str, float] = defaultdict(float)
        self.checks: dict[int, tuple[float, int]] = {}

    def iteration(self, k: int) -> None:
        import pyarrow as pa
        import torch

        from ragen_core.learner.batch import to_token_batch
        from ragen_core.run.collapse_probe import collapse_due, collapse_metrics
        from ragen_core.run.stages import eval_due, sampling_params, select_rollouts

        cfg, s = self.cfg, self.session
        c0 = cpu_now()
        m0 = time.thread_time()
        t0 = time.perf_counter()
        table, _env_metrics = s.call_worker(
            "rollout", "train", k - 1, k, sampling_params(cfg, "train"), cfg.trainer.seed, self.run_id
        )
        t1 = time.perf_counter()
        scores = torch.tensor(table.column("score").to_pylist(), dtype=torch.float64)
        keep = select_rollouts(cfg.rollout.filter, table).keep
        kept = torch.nonzero(keep).flatten().tolist()
        batch = to_token_batch(table.take(pa.array(kept, type=pa.int64())))
        t2 = time.perf_counter()
        if collapse_due(cfg.monitor, k):  # the learn stage's collapse metrics, same sample
            collapse_metrics(table, s.learner.cross_logprobs, cfg.monitor)
        t_probe = time.perf_counter()
        s.learner.step(batch)
        t3 = time.perf_counter()
        s.advance(k)
        t4 = time.perf_counter()
        if eval_due(cfg, k):
            s.call_worker("rollout", "val", 0, k, sampling_params(cfg, "val"), cfg.trainer.seed, self.run_id)
        t5 = time.perf_counter()
        c1 = cpu_now()
        self.main_cpu[k] = time.thread_time() - m0
        self.times[k] = t5 - t0
        self.cpu[k] = (c1[0] - c0[0], c1[1] - c0[1])
        if k > 1:
            for name, dt in (
                ("worker rollout", t1 - t0 + t5 - t4),
                ("filter + token batch", t2 - t1),
                ("collapse probe", t_probe - t2),
                ("learner step", t3 - t_probe),
                ("weight sync", t4 - t3),
            ):
                self.parts[name] += dt
        self.checks[k] = (float(scores.mean()), len(kept))

    def close(self) -> None:
        self.session.close()


# ------------------------------------------------------------------------------------ one comparison
def compare(cfg: Any, init_policy: Path, backend: str, clock: Clock, profile: bool) -> dict[str, Any]:  # noqa: C901 - the ABBA timing harness wraps every hook of the flow in one closure scope
    """Run the train flow on one run directory with the plain loop interleaved; returns all timings."""
    import flows.train as ft
    from ragen_core.run import step_log, training

    n = cfg.trainer.iterations
    flow_run = new_run(cfg, f"bench-flow-{backend}", init_policy)
    plain_run = new_run(cfg, f"bench-plain-{backend}", init_policy)
    plain = Plain(cfg, plain_run, backend)

    marks: dict[str, float] = {}
    flow_start: dict[int, float] = {}
    flow_times: dict[int, float] = {}
    flow_cpu0: dict[int, tuple[float, float]] = {}
    flow_cpu: dict[int, tuple[float, float]] = {}
    flow_main0: dict[int, float] = {}
    flow_main: dict[int, float] = {}
    flow_runq0: dict[int, float] = {}
    flow_runq: dict[int, float] = {}
    flow_threads0: dict[int, dict[int, float]] = {}
    flow_threads: dict[int, dict[str, float]] = {}
    per_iter_parts: dict[int, dict[str, float]] = {}
    session_s: list[float] = []
    state = {"open": 0, "deferred": 0, "counting": 0}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()

    backgrounds: list[Any] = []
    drains: dict[int, float] = {}
    logging_cpu = [0.0, 0.0]  # the logging process's CPU seconds at iteration 2's start and the loop's end
    background_cpu: dict[str, float] = defaultdict(float)

    real_open_step_log = training.open_step_log  # = log_process.open_step_log
    real_logger_calls = {name: getattr(step_log.StepLogger, name) for name in step_log.CALLS}

    def open_step_log(*args: Any, **kwargs: Any) -> Any:
        log = real_open_step_log(*args, **kwargs)
        backgrounds.append(log)
        return log

    nested = threading.local()  # per thread: thread mode runs the calls in the logging thread

    def timed_call(name: str) -> Any:
        """A StepLogger method that adds up the CPU time of the thread running it (thread / off modes;
        in the logging process the calls run unpatched, and that process's CPU is read from /proc)."""
        real = real_logger_calls[name]

        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            if getattr(nested, "depth", 0):  # log_step runs log_rollouts itself: counted once, outermost
                return real(self, *a, **kw)
            nested.depth = 1
            t0 = time.thread_time()
            try:
                return real(self, *a, **kw)
            finally:
                nested.depth = 0
                if state["counting"]:
                    background_cpu[name] += time.thread_time() - t0

        return timed

    def close_open(now: float, plain_next: bool = False) -> None:
        k = state["open"]
        if k:
            if plain_next or state["deferred"]:
                # The flow's MLflow logging runs in the background (the logging process); left
                # running, it would slow the plain iteration that comes next. Wait for it and charge the wait to this flow
                # iteration (conservative: no credit for overlapping; between two flow iterations
                # the overlap is real and any contention lands on the next flow iteration's clock).
                for b in backgrounds:
                    b.flush()
                drains[k] = time.perf_counter() - now
                now = time.perf_counter()
            flow_times[k] = now - flow_start[k]
            c = cpu_now()
            flow_main[k] = time.thread_time() - flow_main0[k]
            flow_runq[k] = main_runqueue_wait() - flow_runq0[k]
            flow_threads[k] = other_threads_cpu(flow_threads0[k])
            flow_cpu[k] = (c[0] - flow_cpu0[k][0], c[1] - flow_cpu0[k][1])
            if prof is not None and k > 1:
                prof.disable()
            clock.active = False
            per_iter_parts[k] = dict(clock.totals)
            clock.reset()
            state["open"] = 0
        if state["deferred"]:
            plain.iteration(state["deferred"])
            state["deferred"] = 0

    real_iteration_flow, real_iteration_task = ft.iteration_flow, ft.iteration_task
    real_session, real_best = training.Session, training.RunDir.best_step
    real_configure = ft.configure_environment
    real_iteration = ft.iteration_runner(cfg)

    def iteration_flow(run_root: str, k: int) -> dict[str, float]:
        close_open(time.perf_counter(), plain_next=bool(k % 2))
        if k == 1:
            # The logging process starts with the MLflow run (seconds of imports, in a real run during
            # the warm start, which this prepared run skips): a start-up cost, waited for here.
            marks["logging_ready"] = sum(b.wait_ready() for b in backgrounds if hasattr(b, "wait_ready"))
            marks["loop"] = time.perf_counter()
        if k == 2:
            logging_cpu[0] = LOGGING_CPU()
        if k % 2:  # ABBA: plain k before flow k for odd k, after it for even k
            plain.iteration(k)
        else:
            state["deferred"] = k
        state["open"] = k
        state["counting"] = int(k > 1)
        clock.reset()
        clock.active = True
        if prof is not None and k > 1:
            prof.enable()
        flow_cpu0[k] = cpu_now()
        flow_main0[k] = time.thread_time()
        flow_runq0[k] = main_runqueue_wait()
        flow_threads0[k] = threads_cpu()
        flow_start[k] = time.perf_counter()
        return real_iteration(run_root, k)

    def session(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = real_session(*args, **kwargs)
        session_s.append(time.perf_counter() - t0)
        return out

    def best_step(*args: Any, **kwargs: Any) -> Any:  # the flow's first call after its loop
        now = time.perf_counter()
        close_open(now)
        marks["loop_end"] = time.perf_counter()
        logging_cpu[1] = LOGGING_CPU()
        return real_best(*args, **kwargs)

    def configure(*args: Any, **kwargs: Any) -> Any:
        marks["flow_body"] = time.perf_counter()
        return real_configure(*args, **kwargs)

    ft.iteration_flow, ft.iteration_task, ft.configure_environment = iteration_flow, iteration_flow, configure
    training.Session, training.RunDir.best_step, training.open_step_log = session, best_step, open_step_log
    for name in step_log.CALLS:
        setattr(step_log.StepLogger, name, timed_call(name))
    try:
        marks["call"] = time.perf_counter()
        result = ft.train(ft.TrainRequest(resume=str(flow_run.root), backend=backend))
        marks["return"] = time.perf_counter()
    finally:
        ft.iteration_flow, ft.iteration_task, ft.configure_environment = (
            real_iteration_flow,
            real_iteration_task,
            real_configure,
        )
        training.Session, training.RunDir.best_step, training.open_step_log = (
            real_session,
            real_best,
            real_open_step_log,
        )
        for name, real in real_logger_calls.items():
            setattr(step_log.StepLogger, name, real)
        clock.active = False
        plain.close()
    if result["last_iteration"] != n or sorted(flow_times) != list(range(1, n + 1)):
        raise RuntimeError(f"the flow ran {result['last_iteration']} of {n} iterations")

    # same work on both sides: mean score and kept rows per iteration
    mismatches = []
    for k in range(1, n + 1):
        m = json.loads(flow_run.metrics_file(k).read_text())
        flow_check = (m["score/mean"], int(m["rollout/kept_trajectories"]))
        p_score, p_kept = plain.checks[k]
        if abs(flow_check[0] - p_score) > 1e-9 or flow_check[1] != p_kept:
            mismatches.append(f"iteration {k}: flow {flow_check}, plain {(p_score, p_kept)}")
    return {
        "backend": backend,
        "n": n,
        "flow": flow_times,
        "plain": dict(plain.times),
        "flow_cpu": flow_cpu,
        "plain_cpu": dict(plain.cpu),
        "flow_main_cpu": flow_main,
        "flow_runqueue": flow_runq,
        "flow_threads": flow_threads,
        "plain_main_cpu": dict(plain.main_cpu),
        "parts": per_iter_parts,
        "plain_parts": dict(plain.parts),
        "mismatches": mismatches,
        "drains": drains,
        "background_cpu": dict(background_cpu),
        "logging_process_cpu": logging_cpu[1] - logging_cpu[0],
        "startup": {
            "plain Session construction" + (" (starts Ray)" if backend == "ray" else ""): plain.start_s,
            "flow: Prefect start + flow run creation (call -> flow body)": marks["flow_body"] - marks["call"],
            "flow: MLflow run start + warm-start task + Session (flow body -> iteration 1)": marks["loop"]
            - marks["flow_body"],
            "  of which Session construction": session_s[0] if session_s else float("nan"),
            "  of which waiting for the MLflow logging process to start": marks.get("logging_ready", 0.0),
            "flow: end (plots, final-model artifacts, MLflow end, flow return)": marks["return"]
            - marks["loop_end"],
        },
        "profile": prof,
        "result": result,
    }


# ------------------------------------------------------------------------------------ report
def summarize(res: dict[str, Any]) -> tuple[float, float]:
    n, flow, plain = res["n"], res["flow"], res["plain"]
    fcpu, pcpu = res["flow_cpu"], res["plain_cpu"]
    local = res["backend"] == "local"
    steady = list(range(2, n + 1))
    print(f"\n== backend {res['backend']}: {n} iterations, interleaved (ABBA) ==")
    print(
        "        wall time (s)                              CPU time (s): this process + Prefect server + logging process"
        + ("" if local else " (Ray actors not counted)")
    )
    print("iter   plain    flow   flow-plain  ratio        plain          flow")
    for k in range(1, n + 1):
        note = "  (first: excluded)" if k == 1 else ("  (+ validation)" if k == n else "")
        print(
            f"{k:4d}  {plain[k]:6.3f}  {flow[k]:6.3f}  {1000 * (flow[k] - plain[k]):8.0f} ms  {flow[k] / plain[k]:5.2f}"
            f"    {pcpu[k][0]:5.2f} + {pcpu[k][1]:4.2f}   {fcpu[k][0]:5.2f} + {fcpu[k][1]:4.2f}{note}"
        )
    ratios = [flow[k] / plain[k] for k in steady]
    diffs = [flow[k] - plain[k] for k in steady]
    ratio = statistics.median(ratios)
    overhead = statistics.median(diffs)
    tot_f, tot_p = sum(flow[k] for k in steady), sum(plain[k] for k in steady)
    print(
        f"iterations 2..{n}: median plain {statistics.median(plain[k] for k in steady):.3f} s, median flow "
        f"{statistics.median(flow[k] for k in steady):.3f} s; median ratio {ratio:.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); totals ratio {tot_f / tot_p:.3f}; "
        f"median overhead {1000 * overhead:.0f} ms/iteration (mean {1000 * (tot_f - tot_p) / len(steady):.0f})"
    )
    cpu_f = sum(sum(fcpu[k]) for k in steady)
    cpu_p = sum(sum(pcpu[k]) for k in steady)
    cpu_ratios = [sum(fcpu[k]) / sum(pcpu[k]) for k in steady]
    if local:
        print(
            f"CPU time, iterations 2..{n}: flow {cpu_f / len(steady):.3f} s/iteration (of which Prefect server + logging process "
            f"{sum(fcpu[k][1] for k in steady) / len(steady):.3f}), plain {cpu_p / len(steady):.3f} s/iteration "
            f"(server {sum(pcpu[k][1] for k in steady) / len(steady):.3f}); median ratio "
            f"{statistics.median(cpu_ratios):.3f}, totals ratio {cpu_f / cpu_p:.3f}"
        )
    fm, pm = res["flow_main_cpu"], res["plain_main_cpu"]
    print(
        f"main-thread CPU time, iterations 2..{n} (moves least with the machine's load): flow "
        f"{statistics.median(fm[k] for k in steady):.3f} s, plain {statistics.median(pm[k] for k in steady):.3f} s "
        f"(medians); median ratio {statistics.median(fm[k] / pm[k] for k in steady):.3f}"
    )
    runq, drains = res["flow_runqueue"], res["drains"]
    asleep = [flow[k] - fm[k] - runq[k] - drains.get(k, 0.0) for k in steady]
    print(
        f"flow main thread off its core, iterations 2..{n} (medians): waiting for a core "
        f"{1000 * statistics.median(runq[k] for k in steady):.0f} ms, asleep {1000 * statistics.median(asleep):.0f} ms "
        "(the interpreter lock, file I/O; the charged wait below not counted)"
    )
    threads: dict[str, float] = defaultdict(float)
    for k in steady:
        for name, seconds in res["flow_threads"][k].items():
            threads[name] += seconds / len(steady)
    busy = sorted(((v, name) for name, v in threads.items() if v >= 0.0005), reverse=True)
    if busy:
        print(
            "other threads of this process during flow iterations, CPU ms per iteration: "
            + ", ".join(f"{name} {1000 * v:.0f}" for v, name in busy)
        )
    drained = [res["drains"][k] for k in steady if k in res["drains"]]
    if drained:
        print(
            f"background MLflow logging waited for before a plain iteration (charged to the flow): "
            f"{len(drained)} of {len(steady)} iterations, median {1000 * statistics.median(drained):.0f} ms"
        )
    print(
        f"all {n} iterations: totals ratio {sum(flow.values()) / sum(plain.values()):.3f}, "
        f"flow {sum(flow.values()):.2f} s, plain {sum(plain.values()):.2f} s"
    )
    print(
        "same work on both sides: "
        + (
            "yes (mean score and kept rows match every iteration)"
            if not res["mismatches"]
            else "NO: " + "; ".join(res["mismatches"])
        )
    )
    print("one-time start-up and shutdown (not in the ratio):")
    for name, s in res["startup"].items():
        print(f"  {name:<76} {s:7.2f} s")

    # breakdown over iterations 2..n (per iteration)
    m = len(steady)
    flow_mean = tot_f / m
    totals: dict[str, float] = defaultdict(float)
    for k in steady:
        for label, s in res["parts"][k].items():
            totals[label] += s / m
    print(
        f"where a flow iteration's time goes (mean over iterations 2..{n}, ms per iteration; "
        f"flow {1000 * flow_mean:.0f} ms, plain {1000 * tot_p / m:.0f} ms):"
    )
    attributed = 0.0
    for group in (SHARED, PIPE, PREFECT, MLFLOW, LOOP):
        labels = [lab for g, lab in LABELS if g == group]
        gsum = sum(totals.get(lab, 0.0) for lab in labels)
        attributed += gsum
        print(f"  {group:<58} {1000 * gsum:8.1f}")
        for lab in labels:
            if lab in totals:
                print(f"    {lab:<56} {1000 * totals[lab]:8.1f}")
    drain = sum(res["drains"].get(k, 0.0) for k in steady) / m
    attributed += drain
    print(f"  {'waiting for the background MLflow logging (charged, above)':<58} {1000 * drain:8.1f}")
    rest = flow_mean - attributed
    bg = res["background_cpu"]
    if bg:
        print(
            f"  (background logging in this process, CPU ms per iteration: {1000 * sum(bg.values()) / m:.1f}; "
            + ", ".join(f"{name} {1000 * v / m:.1f}" for name, v in sorted(bg.items(), key=lambda kv: -kv[1]))
            + ")"
        )
    if res["logging_process_cpu"]:
        print(
            f"  (the MLflow logging process, CPU ms per iteration, off this process: "
            f"{1000 * res['logging_process_cpu'] / m:.1f})"
        )
    print(f"  {'Prefect task/subflow engine + glue (the rest)':<58} {1000 * rest:8.1f}")
    pp = res["plain_parts"]
    print("  plain loop, same library work:  " + ", ".join(f"{k} {1000 * v / m:.1f}" for k, v in pp.items()))
    shared_flow = sum(totals.get(lab, 0.0) for g, lab in LABELS if g == SHARED)
    print(
        f"  flow-only time {1000 * (flow_mean - shared_flow):.0f} ms/iteration "
        f"(= flow minus its library work; the paired median overhead above is {1000 * overhead:.0f} ms)"
    )
    return ratio, overhead


def print_profile(prof: Any, top: int = 40, out_file: str | None = None) -> None:
    if out_file:
        prof.dump_stats(out_file)
        print(f"cProfile stats written to {out_file} (python -m pstats {out_file})")
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    print("\n== cProfile of the flow's iterations 2..N (main thread; cumulative) ==")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:20000])
    # Own time by package: which library the main thread's time is spent in (built-ins count as "C").
    by_package: dict[str, float] = defaultdict(float)
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        path = filename.replace("\\", "/")
        if "site-packages/" in path:
            package = path.split("site-packages/", 1)[1].split("/", 1)[0]
        elif path.startswith(str(ROOT)):
            package = path[len(str(ROOT)) + 1 :].split("/", 1)[0]
        elif filename == "~":
            package = "C (built-ins, torch ops)"
        else:
            package = "python stdlib"
        by_package[package] += tottime
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print("\n== cProfile, own time (tottime) ==")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-17:])
    print("\n== own time by package (main thread, s over the profiled iterations) ==")
    for package, seconds in sorted(by_package.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {package:<40} {seconds:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 iterations, local backend only")
    parser.add_argument(
        "--iterations", type=int, default=None, help="iterations per side (default 20; quick 5)"
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "bandit-tiny.yaml"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (trainer.rollout_threads)")
    parser.add_argument("--ray", action="store_true", help="also run the Ray backend (informative)")
    parser.add_argument("--profile", action="store_true", help="cProfile the flow's iterations")
    parser.add_argument(
        "--profile-out", default=None, metavar="FILE", help="with --profile: also write the stats to FILE"
    )
    parser.add_argument("--fresh", action="store_true", help="redo the cached SFT warm start")
    parser.add_argument("--keep", action="store_true", help="keep the temporary state folder")
    parser.add_argument(
        "--iteration-as",
        choices=["subflow", "task"],
        default=None,
        help="override trainer.iteration_as (default: the config's)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for both sides (e.g. tracking.traces_per_tag=0): what a part costs",
    )
    args = parser.parse_args()
    n = args.iterations or (5 if args.quick else 20)
    if n < 3:
        parser.error("--iterations must be at least 3")

    state = Path(tempfile.mkdtemp(prefix="ragen-bench-pipeline-"))
    os.environ["RAGEN_STATE_DIR"] = str(state)
    os.environ.setdefault("RAGEN_RAY_NUM_CPUS", "4")  # two sessions (flow + plain) at once, 2 actors each
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # log_table downloads the table
    from flows.settings import configure_environment

    configure_environment(state)
    import torch

    torch.set_num_threads(args.threads)
    clock = Clock()
    instrument(clock)
    try:
        cfg = bench_config(
            args.config, n, "local", args.threads, state / "runs", args.iteration_as, args.overrides
        )
        init_policy, warm_s, cached = warm_start_once(cfg, args.fresh)
        print(
            f"config {Path(args.config).name}: train {cfg.train.n_groups} groups x {cfg.train.group_size}, "
            f"iteration as a {cfg.trainer.iteration_as}, max_turn {cfg.agent.max_turn}, max_new_tokens {cfg.rollout.max_new_tokens}, validation "
            f"{cfg.val.n_groups} x {cfg.val.group_size} after iteration {n}; torch threads {args.threads}"
        )
        print(
            f"warm start (SFT, once, shared by both sides): {warm_s:.1f} s"
            + (f" (cached in {init_policy})" if cached else "")
        )
        results = [compare(cfg, init_policy, "local", clock, args.profile)]
        ratio, overhead = summarize(results[0])
        if args.profile and results[0]["profile"] is not None:
            print_profile(results[0]["profile"], out_file=args.profile_out)
        ray_line = None
        if args.ray and not args.quick:
            cfg_ray = bench_config(
                args.config, n, "ray", args.threads, state / "runs", args.iteration_as, args.overrides
            )
            res = compare(cfg_ray, init_policy, "ray", clock, False)
            r_ratio, r_overhead = summarize(res)
            ray_line = (r_ratio, r_overhead)
    finally:
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"state kept in {state}")
    print()
    print(f"fixed overhead per iteration (flow - plain, median): {1000 * overhead:.0f} ms (local backend)")
    if ray_line is not None:
        print(
            f"ray backend (informative): ratio {ray_line[0]:.2f}, overhead {1000 * ray_line[1]:.0f} ms/iteration"
        )
    print(
        f"BENCH pipeline_overhead ratio={ratio:.2f} target=<={TARGET:g} {'PASS' if ratio <= TARGET else 'MISS'}"
    )


if __name__ == "__main__":
    main()
