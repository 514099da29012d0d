"""``ragen env serve FrozenLake`` in one process and a config pointing at it in another train the same as
the local config: same seeds, same trajectories. And ``ragen rerun --stage rollout`` of such a run
reproduces it against the same (deterministic) server, and says "non-deterministic server" where the
server answers the same seed differently."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from envs.base import Env, StepResult
from envs.wire.server import ServerThread, create_app
from tests.flows.test_train import Result
from tests.flows.test_train import ragen as run_cli
from tests.process_env import child_env

#: end-to-end runs (a server process, training runs): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "frozenlake-tiny.yaml"
#: configs/frozenlake-tiny.yaml's environment settings, which the server must play
NO_SLIP = ["--set", "is_slippery=false", "--set", "think_holes=true"]
#: one iteration of 4 groups of 4, a 2-step warm start, 4 validation episodes. The untrained policy's
#: answers are constrained to the actions (and no think part), so that episodes play actions and the
#: environment's answers reach the trajectories.
TINY = [
    "trainer.iterations=1",
    "trainer.eval_every=1",
    "trainer.val_before_train=false",
    "trainer.backend=local",
    "sft.steps=2",
    "sft.episodes_per_tag=8",
    "train.n_groups=[4]",
    "train.group_size=4",
    "val.n_groups=[4]",
    "agent.enable_think=false",
    "agent.action_decoding=constrained",
    "rollout.max_new_tokens=16",
    "learner.optim.mini_batch_size=4",
    "learner.optim.micro_batch_size=4",
    "tracking.system_metrics=false",
    "tracking.background=off",
]
#: every column but the run's id, which names the run
COMPARED = (
    "seed",
    "env_tag",
    "input_ids",
    "rollout_logprobs",
    "messages",
    "actions",
    "turn_rewards",
    "reward",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError):
            assert proc is None or proc.poll() is None, "the environment server exited"
            assert time.monotonic() < deadline, f"nothing answered at {url} in {timeout_s:g} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """`ragen env serve FrozenLake --port N` with the config's settings, as a user starts it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "env", "serve", "FrozenLake", "--port", str(port), *NO_SLIP],
            cwd=ROOT,
            env=child_env(PYTHONPATH=str(ROOT)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield port, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def ragen(args: list[str], state: Path) -> Result:
    """The CLI as every end-to-end test runs it (its own process group, killed afterwards), one torch
    thread: the server process shares the cores."""
    return run_cli(args, state, extra_env={"OMP_NUM_THREADS": "1"})


def train(state: Path, extra: list[str]) -> Path:
    sets = [x for o in [*TINY, *extra, f"trainer.run_root={state / 'runs'}"] for x in ("--set", o)]
    out = ragen(["train", str(CONFIG), *sets], state)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = [p for p in (state / "runs").iterdir() if p.is_dir()]
    return run


def rows(path: Path) -> dict[str, list[Any]]:
    table = pq.read_table(path).to_pydict()
    return {c: table[c] for c in COMPARED}


def remote_sets(port: int) -> list[str]:
    url = f"ws://127.0.0.1:{port}"
    return [f"train.remote={{FrozenLake: {{url: '{url}'}}}}", f"val.remote={{FrozenLake: {{url: '{url}'}}}}"]


@pytest.fixture(scope="module")
def runs(
    served: tuple[int, subprocess.Popen[bytes]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The tiny FrozenLake config trained locally, then against the served FrozenLake."""
    port, _ = served
    local = train(tmp_path_factory.mktemp("local"), [])
    remote = train(tmp_path_factory.mktemp("remote"), remote_sets(port))
    return local, remote


def test_a_config_pointing_at_ragen_env_serve_trains_the_same_trajectories(runs: tuple[Path, Path]) -> None:
    local, remote = runs
    info = json.loads((remote / "run.json").read_text())
    assert info["run_id"] != json.loads((local / "run.json").read_text())["run_id"]
    for name in ("iter_0001/rollouts.parquet", "eval/step_0001.parquet"):
        a, b = rows(local / name), rows(remote / name)
        assert sum(len(turns) for episode in a["actions"] for turns in episode) > 0, "no action played"
        assert b == a, name


class _Shifted(Env):
    """FrozenLake that plays another board than the seed's at every second reset: a server that is not
    deterministic (as one whose environment draws from a clock or a global random state)."""

    resets = 0

    def __init__(self, inner: Env) -> None:
        self.inner = inner

    def reset(self, seed: int) -> str:
        _Shifted.resets += 1
        text = self.inner.reset(seed + _Shifted.resets % 2 * 7919)
        self.actions, self.grid_vocab = self.inner.actions, self.inner.grid_vocab
        return text

    def step(self, action: str) -> StepResult:
        return self.inner.step(action)

    def render(self) -> str:
        return self.inner.render()


def test_a_rerun_of_the_remote_rollout_reproduces_it_and_names_a_non_deterministic_server(
    runs: tuple[Path, Path], served: tuple[int, subprocess.Popen[bytes]]
) -> None:
    _, run = runs
    port, proc = served
    state = run.parents[1]
    same = ragen(["rerun", str(run), "--iteration", "1", "--stage", "rollout"], state)
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    assert "rollout of iteration 1: identical" in same.stdout
    assert f"FrozenLake at ws://127.0.0.1:{port}" in same.stdout and "deterministic" in same.stdout

    # the same port now answers with a server whose resets do not follow the seed
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    app = create_app("FrozenLake", {"is_slippery": False, "think_holes": True})
    make = app.state.ragen.make
    app.state.ragen.make = lambda: _Shifted(make())
    with running_on(app, port):
        other = ragen(["rerun", str(run), "--iteration", "1", "--stage", "rollout"], state)
    text = other.stdout + other.stderr
    assert other.returncode == 2, text[-3000:]
    assert "rollout of iteration 1: non-deterministic server" in other.stdout, text[-3000:]
    assert "DIFFERENT" not in text
    assert f"FrozenLake at ws://127.0.0.1:{port}" in other.stdout and "seed" in other.stdout


@contextlib.contextmanager
def running_on(app: Any, port: int) -> Iterator[None]:
    server = ServerThread(app, port=port).start()
    try:
        yield
    finally:
        server.stop()
