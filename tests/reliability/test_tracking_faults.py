"""MLflow faults against real parts (issue 18).

* Two processes opening one fresh SQLite store at once both work (MLflow itself races on the schema).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.test_e2e import INHERITED_DROP_PREFIXES

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- concurrent first runs
RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ragen_core.tracking import Tracker, TrackingConfig

    state, go = Path(sys.argv[1]), Path(sys.argv[2])
    (state.parent / (state.name + "." + sys.argv[3] + ".ready")).touch()
    while not go.exists():  # start together: the imports above take seconds, unevenly
        time.sleep(0.002)
    tracker = Tracker(TrackingConfig(experiment="race"), state)
    run_id = tracker.start("racer-" + sys.argv[3], {"who": sys.argv[3]})
    assert tracker.log_iteration(0, {"x": 1.0})
    tracker.end()
    print("RUN", run_id)
""")


def test_two_first_runs_on_one_fresh_sqlite_store_both_work(tmp_path: Path) -> None:
    """Without the lock, MLflow's schema creation races: 'table ... already exists', 'duplicate
    column name', alembic revision errors; two processes per store, two fresh stores at once."""
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_DROP_PREFIXES)}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs: list[tuple[Path, subprocess.Popen[str]]] = []
    stores = [tmp_path / f"state{i}" for i in range(2)]
    try:
        for store in stores:
            for who in ("a", "b"):
                procs.append((store, subprocess.Popen([sys.executable, "-c", RACER, str(store), str(go), who],
                                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True)))
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.ready"))) < len(procs):
            assert time.monotonic() < deadline, "racers did not start"
            assert all(p.poll() is None for _, p in procs), [p.communicate()[0][-2000:] for _, p in procs]
            time.sleep(0.05)
        go.touch()
        outputs = [(store, p.communicate(timeout=180)[0], p.returncode) for store, p in procs]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"{store.name}: rc {rc}\n{out[-1500:]}" for store, out, rc in outputs if rc != 0]
    assert not failed, "\n".join(failed)
    for store in stores:
        c = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
        exp = c.get_experiment_by_name("race")
        assert exp is not None
        assert sorted(r.info.run_name for r in c.search_runs([exp.experiment_id])) == ["racer-a", "racer-b"]
        assert (store / "mlflow.db.lock").exists()
