"""A Ray cluster that already exists, of two nodes on this machine: `ragen doctor` lists its nodes and
a training run joins it through RAY_ADDRESS, its two learners one on each node."""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """`ray start --head` and a second `ray start --address ...` node, with token auth (the token in a
    file of this test); stopped by killing their processes (not `ray stop`, which stops every Ray on
    the machine), and the machine's current-cluster entry put back as it was."""
    folder = tmp_path_factory.mktemp("ray-nodes")
    token = folder / "auth_token"
    token.write_text("0123456789abcdef" * 4)
    marker = procs.new_marker()
    port = procs.free_port()
    env = {
        **os.environ,
        **marker,
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
    with procs.ray_current_cluster_kept():
        try:
            for args in (
                [
                    "--head",
                    "--port",
                    str(port),
                    "--node-ip-address",
                    "127.0.0.1",
                    "--include-dashboard",
                    "false",
                ],
                ["--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1"],
            ):
                subprocess.run(
                    [str(RAY_BIN), "start", *args, *common],
                    env=env,
                    check=True,
                    capture_output=True,
                    timeout=180,
                )
            yield joined
        finally:
            procs.kill_tree(marker)


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
from ragen_core.actors import init_ray, reserve_learners
from ragen_core.learner_config import LearnerConfig
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
