"""How many sweep members can log to one MLflow store at once: the SQLite default against PostgreSQL.

Each simulated member is its own process with its own MLflow client, as a member run on a worker is:
it creates a run, logs its params, then ``--steps`` iterations of ``--metrics`` metrics in one batch
each (about what an iteration of a real run logs), ``--pace`` seconds apart (0: as fast as it can,
the worst case). N members start together, for N in ``--members``. A member fails when any MLflow
call raises (SQLite: ``database is locked``, once a writer waits past the driver's busy timeout).

The same is run against a PostgreSQL store (Debian's server, a private throwaway cluster, as in the
team-setup test) in the same run. The headline is the largest N at which every SQLite member
succeeded, as a ratio to PostgreSQL's over the same N values:

    BENCH store_concurrency_sqlite_vs_postgres ratio=<sqlite N / postgres N> target=>=1 PASS|MISS

Usage: ``python benchmarks/store_concurrency.py [--members 1,2,4,8,16] [--steps 30] [--metrics 130]``.
PostgreSQL's server refuses to run as root, so as root the cluster is run as the ``postgres`` user.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def member(uri: str, index: int, steps: int, n_metrics: int, pace: float, out: Any) -> None:
    """One member's logging; puts (index, error or None, seconds) on ``out``."""
    t0 = time.perf_counter()
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("bench")
        run = client.create_run(exp.experiment_id, run_name=f"member-{index}")  # type: ignore[union-attr]
        params = [Param(f"p{i}", str(i)) for i in range(40)]
        client.log_batch(run.info.run_id, params=params)
        for step in range(1, steps + 1):
            ts = int(time.time() * 1000)
            metrics = [Metric(f"m/{i}", float(step * i), ts, step) for i in range(n_metrics)]
            client.log_batch(run.info.run_id, metrics=metrics)
            if pace:
                time.sleep(pace)
        client.set_terminated(run.info.run_id)
        out.put((index, None, time.perf_counter() - t0))
    except Exception as exc:  # the measurement: which members failed, and why
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        out.put((index, line or traceback.format_exc(limit=1), time.perf_counter() - t0))


def prepare(uri: str) -> None:
    """Create the schema and the experiment once, before members race for them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name("bench") is None:
        client.create_experiment("bench")


def trial(uri: str, n: int, args: argparse.Namespace) -> tuple[int, float, str]:
    """N members at once: (members that failed, wall seconds, the first error)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=member, args=(uri, i, args.steps, args.metrics, args.pace, out)) for i in range(n)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    errors = [e for _, e, _ in results if e]
    return len(errors), time.perf_counter() - t0, (errors[0] if errors else "")


def sweep_store(name: str, uri_for: Any, args: argparse.Namespace) -> int:
    """Try each N on a fresh store; the largest N before the first N with a failed member (0: none)."""
    best, failed_once = 0, False
    for n in args.members:
        uri = uri_for(n)
        prepare(uri)
        failed, wall, error = trial(uri, n, args)
        print(f"{name:10s} members={n:3d} failed={failed:3d} wall={wall:6.1f}s {error}", flush=True)
        failed_once = failed_once or failed > 0
        if not failed_once:
            best = n
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--metrics", type=int, default=130)
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args()
    args.members = [int(x) for x in args.members.split(",")]

    sys.path.insert(0, str(ROOT))
    from tests.postgres import postgres_server

    work = Path(tempfile.mkdtemp(prefix="ragen-store-bench-"))
    sqlite_best = sweep_store("sqlite", lambda n: f"sqlite:///{work / f'mlflow-{n}.db'}", args)
    dbs = [f"mlflow{n}" for n in args.members]
    with postgres_server(work / "postgres.log", dbs) as pg:
        pg_best = sweep_store("postgresql", lambda n: pg.url(f"mlflow{n}"), args)
    ratio = sqlite_best / pg_best if pg_best else 0.0
    print(f"largest N with no failed member: sqlite {sqlite_best}, postgresql {pg_best}")
    print(
        f"BENCH store_concurrency_sqlite_vs_postgres ratio={ratio:.2f} target=>=1 "
        f"{'PASS' if ratio >= 1 else 'MISS'}"
    )


if __name__ == "__main__":
    main()
