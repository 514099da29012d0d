"""The session folders of the Ray clusters a run starts (``/tmp/ray/session_...``) go when it ends, and
those of a killed run at the next start; another user's or process's sessions stay. Before, every
cluster left its folder (29 after a day of runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragen_core.learner.ray_sessions import OWNER_FILE, remove_stale_sessions
from tests.process_env import child_env
from tests.reliability.procs import ray_current_cluster_kept

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A short temporary folder for Ray (its socket paths must stay under 107 characters)."""
    with tempfile.TemporaryDirectory(prefix="rs-", dir="/tmp") as d:
        yield Path(d)


def _session(temp: Path, name: str, owner: dict[str, object] | None) -> Path:
    s = temp / f"session_{name}"
    (s / "logs").mkdir(parents=True)
    if owner is not None:
        (s / OWNER_FILE).write_text(json.dumps(owner))
    return s


def test_only_our_sessions_of_dead_processes_are_removed(ray_tmp: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = _session(ray_tmp, "stale", {"pid": int(dead.stdout), "start": "1"})
    foreign = _session(ray_tmp, "foreign", None)
    live = _session(
        ray_tmp,
        "live",
        {
            "pid": os.getpid(),
            "start": Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19],
        },
    )
    reused = _session(ray_tmp, "reused", {"pid": os.getpid(), "start": "0"})  # this pid, another process
    (ray_tmp / "session_latest").symlink_to(stale)
    assert remove_stale_sessions(ray_tmp) == [reused, stale]
    assert foreign.is_dir() and live.is_dir() and not stale.exists() and not reused.exists()
    assert not (ray_tmp / "session_latest").is_symlink()


@pytest.mark.slow
def test_a_runs_cluster_leaves_no_session_folder(ray_tmp: Path) -> None:
    foreign = _session(ray_tmp / "ray", "foreign", None)
    killed = _session(ray_tmp / "ray", "killed", {"pid": 2**22 + 1, "start": "1"})  # no such process
    script = textwrap.dedent("""
        import ray
        from ragen_core.learner.actors import init_ray
        init_ray(num_cpus=1)
        print(ray._private.worker._global_node.get_session_dir_path())
    """)
    with ray_current_cluster_kept():
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=child_env(RAY_TMPDIR=str(ray_tmp), OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    session = Path(out.stdout.strip().splitlines()[-1])
    assert session.parent == ray_tmp / "ray", session
    assert not session.exists(), sorted(p.name for p in session.parent.iterdir())
    assert foreign.is_dir() and not killed.exists()
