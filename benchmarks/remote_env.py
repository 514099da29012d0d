"""Remote environments' speed: FrozenLake steps per second locally, over our WebSocket client on loopback
and through openenv-core's own client, then one iteration of the tiny FrozenLake config, local vs
remote, all in one run.

- **Steps per second**: the same random action sequence (``random.Random(0)`` over the four moves), a
  reset (next seed) whenever an episode ends or reaches 100 steps, best of 3 runs: ``envs.make`` in
  this process; :class:`envs.wire.client.RemoteEnv` (one session: one request in flight at a time, so
  this is the round trip's rate); openenv-core's ``GenericEnvClient(...).sync()`` run in its own venv
  (``make openenv``) as a child process that times itself the same way. Both clients play one server,
  ``ragen env serve FrozenLake`` in a process of its own (so the server does not share this process's
  interpreter lock with the client), with configs/frozenlake-tiny.yaml's settings.
- **One iteration**: ``ragen train configs/frozenlake-tiny.yaml`` for 3 iterations, once with the
  environments local and once with ``train.remote`` / ``val.remote`` pointing at that server (256
  sessions), passes alternating; an iteration's time is the gap between the ``DONE`` markers of
  iterations 1-2 and 2-3 (so the warm start, start-up and the final validation are not counted); the
  ratio is the median remote iteration over the median local one. The config's own shapes (32 groups
  of 8, 5 turns, 2 actions a turn) with a 2-step warm start, the local backend, and the answers
  constrained to the actions (``agent.action_decoding=constrained``): an untrained policy's free answers
  rarely spell an action, and then no environment is ever stepped, which would hide the remote cost.

Usage: ``python benchmarks/remote_env.py [--quick]`` (``--quick``: a quarter of the steps, one pass
of each training run). The last lines read ``BENCH remote_env_ws_vs_openenv_client ratio=<ours/openenv
steps/s> target=>=1 PASS|MISS`` and ``BENCH remote_env_iteration ratio=<remote/local> target=<=1.3
PASS|MISS``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402
from envs.base import Env  # noqa: E402
from envs.wire.client import RemoteEnv  # noqa: E402

SETTINGS = {"is_slippery": False, "think_holes": True}  # configs/frozenlake-tiny.yaml's
MOVES = ["Left", "Down", "Right", "Up"]
MAX_EPISODE_STEPS = 100
ITERATION_TARGET = 1.3
OPENENV_PYTHON = Path(
    os.environ.get("RAGEN_OPENENV_PYTHON")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "ragen-flow/openenv-core-0.3.0/bin/python"
)

#: openenv-core's side: the same workload through its own client, timed in its own process
OPENENV_SIDE = """
import json, random, sys, time
from openenv.core import GenericEnvClient
url, steps, max_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
moves = [rng.choice(json.loads(sys.argv[4])) for _ in range(steps)]
with GenericEnvClient(base_url=url).sync() as env:
    env.reset(seed=0)
    start = time.perf_counter()
    seed, in_episode = 0, 0
    for move in moves:
        r = env.step({"message": move})
        in_episode += 1
        if r.done or in_episode >= max_steps:
            seed, in_episode = seed + 1, 0
            env.reset(seed=seed)
    print(json.dumps({"steps": steps, "seconds": time.perf_counter() - start}))
"""


def play(env: Env, steps: int) -> float:
    """Steps per second of ``env`` on the fixed workload (the first reset is not timed)."""
    rng = random.Random(0)
    moves = [rng.choice(MOVES) for _ in range(steps)]
    env.reset(0)
    start = time.perf_counter()
    seed, in_episode = 0, 0
    for move in moves:
        done = env.step(move).done
        in_episode += 1
        if done or in_episode >= MAX_EPISODE_STEPS:
            seed, in_episode = seed + 1, 0
            env.reset(seed)
    return steps / (time.perf_counter() - start)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served() -> Iterator[int]:
    """``ragen env serve FrozenLake`` with the tiny config's settings, in a process of its own."""
    port = free_port()
    sets = [x for k, v in SETTINGS.items() for x in ("--set", f"{k}={str(v).lower()}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "env", "serve", "FrozenLake", "--port", str(port), *sets],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise SystemExit(f"ragen env serve did not start: {err[-2000:]}") from None
                time.sleep(0.2)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def openenv_rate(port: int, steps: int) -> float | None:
    if not OPENENV_PYTHON.exists():
        return None
    out = subprocess.run(
        [
            str(OPENENV_PYTHON),
            "-c",
            OPENENV_SIDE,
            f"http://127.0.0.1:{port}",
            str(steps),
            str(MAX_EPISODE_STEPS),
            json.dumps(MOVES),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        print(f"  openenv-core's client failed: {out.stderr[-1500:]}")
        return None
    result = json.loads(out.stdout.splitlines()[-1])
    return float(result["steps"]) / float(result["seconds"])


def steps_per_second(port: int, quick: bool) -> tuple[float, float, float | None]:
    local_steps, remote_steps = (5000, 750) if quick else (20000, 3000)
    local = remote = 0.0
    theirs: float | None = None
    url = f"ws://127.0.0.1:{port}"
    for _ in range(3):
        lake = envs.make("FrozenLake", **SETTINGS)
        local = max(local, play(lake, local_steps))
        client = RemoteEnv(url, tag="FrozenLake")
        try:
            remote = max(remote, play(client, remote_steps))
        finally:
            client.close()
        rate = openenv_rate(port, remote_steps)
        if rate is not None:
            theirs = max(theirs or 0.0, rate)
    print(
        f"frozen_lake: random steps (best of 3 runs), reset at episode end or {MAX_EPISODE_STEPS} steps\n"
        f"  local envs.make('FrozenLake')               {local:9.0f} steps/s   ({local_steps} steps)\n"
        f"  our WebSocket client (RemoteEnv), loopback  {remote:9.0f} steps/s   ({remote_steps} steps)\n"
        + (
            f"  openenv-core GenericEnvClient, loopback     {theirs:9.0f} steps/s   ({remote_steps} steps)"
            if theirs is not None
            else f"  openenv-core's client: not measured (no venv at {OPENENV_PYTHON}; `make openenv`)"
        )
    )
    return local, remote, theirs


def iteration_times(port: int | None, state: Path) -> tuple[list[float], list[float]]:
    """Seconds of iterations 2 and 3 of a 3-iteration run (local envs, or the server on ``port``), and
    of their rollout stages (``timing_s/gen``: where a remote environment's round trips land)."""
    sets = [
        "trainer.iterations=3",
        "trainer.eval_every=0",
        "trainer.val_before_train=false",
        "trainer.backend=local",
        "sft.steps=2",
        "sft.episodes_per_tag=16",
        "val.n_groups=[8]",
        "agent.action_decoding=constrained",
        "tracking.system_metrics=false",
        "tracking.background=off",
        f"trainer.run_root={state / 'runs'}",
    ]
    if port is not None:
        remote = f"{{FrozenLake: {{url: 'ws://127.0.0.1:{port}'}}}}"
        sets += [f"train.remote={remote}", f"val.remote={remote}"]
    cmd = [sys.executable, "-m", "flows.cli", "train", str(ROOT / "configs/frozenlake-tiny.yaml")]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAGEN_STATE_DIR": str(state)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"ragen train failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    (run,) = [p for p in (state / "runs").iterdir() if p.is_dir()]
    done = [(run / f"iter_{k:04d}" / "DONE").stat().st_mtime for k in (1, 2, 3)]
    gen = [json.loads((run / f"iter_{k:04d}" / "metrics.json").read_text())["timing_s/gen"] for k in (2, 3)]
    return [b - a for a, b in itertools.pairwise(done)], gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the steps, one training pass each")
    args = parser.parse_args()
    with served() as port:
        _, remote, theirs = steps_per_second(port, args.quick)
        print()
        times: dict[str, list[float]] = {"local": [], "remote": []}
        gens: dict[str, list[float]] = {"local": [], "remote": []}
        for _ in range(1 if args.quick else 2):
            for side in ("local", "remote"):
                state = Path(tempfile.mkdtemp(prefix=f"ragen-bench-remote-{side}-"))
                try:
                    iters, gen = iteration_times(port if side == "remote" else None, state)
                    times[side] += iters
                    gens[side] += gen
                finally:
                    shutil.rmtree(state, ignore_errors=True)
    loc, rem = statistics.median(times["local"]), statistics.median(times["remote"])
    print(
        "one iteration of configs/frozenlake-tiny.yaml (32 groups x 8, 5 turns; 2-step warm start, local "
        "backend, constrained answers)\n"
        f"  local envs            median {loc:6.2f} s   ({', '.join(f'{t:.2f}' for t in times['local'])})\n"
        f"  remote (256 sessions) median {rem:6.2f} s   ({', '.join(f'{t:.2f}' for t in times['remote'])})\n"
        f"  its rollout stage (timing_s/gen): local median {statistics.median(gens['local']):.2f} s, remote "
        f"median {statistics.median(gens['remote']):.2f} s"
    )
    print()
    if theirs is not None:
        ratio = remote / theirs
        print(
            f"BENCH remote_env_ws_vs_openenv_client ratio={ratio:.2f} target=>=1 {'PASS' if ratio >= 1 else 'MISS'}"
        )
    ratio = rem / loc
    verdict = "PASS" if ratio <= ITERATION_TARGET else "MISS"
    print(f"BENCH remote_env_iteration ratio={ratio:.2f} target=<={ITERATION_TARGET:g} {verdict}")


if __name__ == "__main__":
    main()
