"""A Ray cluster that already exists, of two nodes on this machine: `ragen doctor` lists its nodes and
a training run joins it through RAY_ADDRESS, its two learners one on each node."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability import procs
from tests.tiny_run import TINY_RUN

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY_BIN = Path(sys.executable).parent / "ray"
#: each node has 2 logical CPUs and a learner asks for 1.5: two learners cannot share a node
NODE_CPUS, LEARNER_CPUS = 2, 1.5


@contextlib.contextmanager
def ray_cluster(folder: Path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """`ray start --head` and a second `ray start --address ...` node, with token auth (the token in a
    file of this test); yields what a driver needs to join (RAY_ADDRESS and the token) and the marker
    of the second node's processes. Stopped by killing their processes (not `ray stop`, which stops
    every Ray on the machine), and the machine's current-cluster entry put back as it was."""
    token = folder / "auth_token"
    token.write_text("0123456789abcdef" * 4)
    head_marker, node_marker = procs.new_marker(), procs.new_marker()
    port = procs.free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    common = [
        "--num-cpus",
        str(NODE_CPUS),
        "--object-store-memory",
        str(128 * 1024**2),
        "--disable-usage-stats",
    ]
    joined = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_ADDRESS": f"127.0.0.1:{port}"}
    head = ["--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--include-dashboard", "false"]
    second = ["--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1"]
    with procs.ray_current_cluster_kept():
        try:
            for args, marker in ((head, head_marker), (second, node_marker)):
                subprocess.run(
                    [str(RAY_BIN), "start", *args, *common],
                    env={**env, **marker},
                    check=True,
                    capture_output=True,
                    timeout=180,
                )
            yield joined, node_marker
        finally:
            procs.kill_tree(node_marker)
            procs.kill_tree(head_marker)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A two-node cluster shared by the tests that leave it whole."""
    with ray_cluster(tmp_path_factory.mktemp("ray-nodes")) as (joined, _):
        yield joined


def ragen(args: list[str], state: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    from tests.process_env import child_env

    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=child_env(RAGEN_STATE_DIR=str(state), **env),
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_doctor_lists_the_nodes_of_the_cluster_it_joins(two_nodes, tmp_path: Path) -> None:
    out = ragen(["doctor"], tmp_path, two_nodes)
    text = " ".join(out.stdout.split())
    assert "on 2 node(s)" in text and f"{2 * NODE_CPUS} CPUs" in text, out.stdout + out.stderr
    assert text.count(f"{NODE_CPUS} CPUs, 0 GPUs") == 2 and text.count("(head)") == 1, out.stdout


def test_a_run_trains_on_a_cluster_of_two_nodes_one_learner_on_each(two_nodes, tmp_path: Path) -> None:
    """trainer.learners=2 with learner.num_cpus=1.5 on two nodes of 2 CPUs: the run can only place its
    learners one per node, so it trains only if data parallelism over gloo works across the nodes."""
    sets = [
        "trainer.iterations=2",
        "trainer.eval_every=2",
        *TINY_RUN,
        "learner.optim.micro_batch_size=4",
        "trainer.backend=ray",
        "trainer.learners=2",
        f"learner.num_cpus={LEARNER_CPUS}",
        "trainer.rollout_cpus=0.5",
        f"trainer.run_root={tmp_path / 'runs'}",
    ]
    out = ragen(
        ["train", str(ROOT / "configs" / "bandit-tiny.yaml"), *[x for s in sets for x in ("--set", s)]],
        tmp_path,
        two_nodes,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "iter_0002" / "DONE").exists()
    # the learn stages recorded the two learners they ran with
    for k in (1, 2):
        assert '"learners": 2' in (run / f"iter_{k:04d}" / "stages" / "learn.json").read_text()


PLACED_NODES = """
import sys
from ray.util.placement_group import placement_group_table
from ragen_core.learner.actors import init_ray, reserve_learners
from ragen_core.config.learner import LearnerConfig
init_ray()
group = reserve_learners(LearnerConfig(num_cpus=1, placement=sys.argv[1]), 2, timeout_s=30)
print("nodes", len(set(placement_group_table(group)["bundles_to_node_id"].values())))
"""


@pytest.mark.parametrize(("placement", "nodes"), [("spread", 2), ("pack", 1)])
def test_learner_placement_spreads_the_ranks_over_the_nodes_or_packs_them(
    two_nodes, placement: str, nodes: int, tmp_path: Path
) -> None:
    """learner.placement: two 1-CPU learner bundles on two nodes of 2 CPUs lie one per node (spread)
    or both on one node (pack), as Ray's placement group records them (a driver of its own, which
    joins through RAY_ADDRESS with the cluster's token, as a run does)."""
    from tests.process_env import child_env

    out = subprocess.run(
        [sys.executable, "-c", PLACED_NODES, placement],
        cwd=ROOT,
        env=child_env(RAGEN_STATE_DIR=str(tmp_path), **two_nodes),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"nodes {nodes}" in out.stdout.splitlines(), out.stdout


def test_a_lost_node_rebuilds_the_actors_and_the_run_goes_on_from_its_last_iteration(tmp_path: Path) -> None:
    """The second node is killed (SIGKILL to its raylet and workers) once iteration 1 is done: the
    run rebuilds its actors on the node that is left, with the learners it can hold (1 of 2), runs
    the interrupted iteration again from the last completed one, and finishes; MLflow has every step
    once, and each learn stage recorded the learner count it ran with."""
    from mlflow.tracking import MlflowClient

    from ragen_core.tracking.keys import parse_steps
    from ragen_core.tracking.tracker import LOGGED_STEPS_TAG
    from tests.process_env import child_env

    sets = [
        "trainer.iterations=4",
        "trainer.eval_every=4",
        *TINY_RUN,
        "learner.optim.micro_batch_size=4",
        "trainer.backend=ray",
        "trainer.learners=2",
        "learner.num_cpus=1",
        "learner.placement=spread",
        "trainer.rollout_cpus=1",
        f"trainer.run_root={tmp_path / 'runs'}",
    ]
    state = tmp_path / "state"
    with ray_cluster(tmp_path) as (joined, second_node):
        cmd = [sys.executable, "-m", "flows.cli", "train", str(ROOT / "configs" / "bandit-tiny.yaml")]
        cmd += [x for s in sets for x in ("--set", s)]
        log = tmp_path / "train.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=child_env(RAGEN_STATE_DIR=str(state), **joined), stdout=out, stderr=out
            )
            try:
                deadline = time.monotonic() + 600
                while not list((tmp_path / "runs").glob("*/iter_0001/DONE")):
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.2)
                procs.kill_tree(second_node)
                code = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "a Ray actor was lost" in text and "learner(s)" in text, text[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    learners = [
        json.loads((run / f"iter_{k:04d}" / "stages" / "learn.json").read_text())["extra"]["learners"]
        for k in (1, 2, 3, 4)
    ]
    assert learners[0] == 2 and learners[-1] == 1, learners
    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    mlflow_run = client.get_run(json.loads((run / "run.json").read_text())["mlflow_run_id"])
    assert sorted(parse_steps(mlflow_run.data.tags[LOGGED_STEPS_TAG])) == [0, 1, 2, 3, 4]
    assert mlflow_run.info.status == "FINISHED"
