"""Nothing of the default setup listens beyond loopback (docs/runs.md promises 127.0.0.1: "Loopback only")."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.flows.test_train import ragen
from tests.reliability import procs

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


def test_default_setup_listens_on_loopback_only(tmp_path: Path) -> None:
    """``ragen train`` of bandit-tiny (tiny sizes) with trainer.backend=ray, its ephemeral Prefect
    server and the local SQLite MLflow store: every TCP listener and bound UDP socket of its process
    tree, sampled while it runs, is on 127.0.0.1 / ::1. Before the fix Ray's GCS, raylet, workers and
    agents listened on 0.0.0.0 / :: and the runtime-env agent on the machine's address."""
    marker = procs.new_marker()
    proc, out, err = procs.launch(procs.tiny_train_args(tmp_path, "trainer.backend=ray"), tmp_path, marker)
    seen: dict[tuple[str, str, int], procs.Listener] = {}
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            for listener in procs.listeners(procs.tree(marker)):
                seen.setdefault((listener.proto, listener.address, listener.port), listener)
            time.sleep(0.5)
        assert proc.wait(timeout=5) == 0, out.read_text()[-2000:] + err.read_text()[-3000:]
    finally:
        proc.kill()
        procs.kill_tree(marker)
    print("\n".join(sorted(str(x) for x in seen.values())))
    # the sampling saw the servers in question, so the check below is about them
    assert any("gcs_server" in x.cmdline for x in seen.values()), seen
    assert any("raylet" in x.cmdline for x in seen.values()), seen
    assert any("uvicorn" in x.cmdline for x in seen.values()), seen  # Prefect's ephemeral server
    outside = [str(x) for x in seen.values() if not x.loopback]
    assert not outside, "listening beyond loopback:\n" + "\n".join(outside)
    # Ray's token auth is on, with the token in the state folder (not in ~/.ray)
    token = tmp_path / "ray" / "auth_token"
    assert token.is_file() and token.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("taken", ["mlflow", "prefect"])
def test_ui_refuses_a_port_in_use(taken: str, tmp_path: Path) -> None:
    """Before the fix `ragen ui` printed its URLs, MLflow died with "address in use" and the command
    kept running, its MLflow URL showing whatever held the port."""
    ports = {"mlflow": procs.free_port(), "prefect": procs.free_port()}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[taken]))
        holder.listen()
        t0 = time.monotonic()
        out = ragen(
            ["ui", "--mlflow-port", str(ports["mlflow"]), "--prefect-port", str(ports["prefect"])],
            tmp_path,
            timeout=120,
        )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.monotonic() - t0 < 60  # no server was started and waited for
    error = " ".join(out.stderr.split())
    assert f"port {ports[taken]} on 127.0.0.1 is already in use" in error, error
    assert f"--{taken}-port" in error, error
    assert "http://" not in out.stdout  # no URL printed


def test_data_parallel_rendezvous_listens_on_loopback(tmp_path: Path) -> None:
    """trainer.learners=2: rank 0's torch TCPStore listened on every interface (:::port) before the
    store got a socket bound to the node's address."""
    import os

    import ray

    from ragen_core.learner.actors import LearnerGroup, init_ray
    from tests.ragen_core.learner.test_learner import make_cfg, tiny_policy

    if ray.is_initialized():
        ray.shutdown()
    marker = procs.new_marker()
    os.environ.update(marker)  # inherited by the Ray processes started below
    try:
        tiny_policy(seed=1).save_pretrained(tmp_path / "policy")
        init_ray(num_cpus=2, object_store_memory=128 * 1024**2)
        with LearnerGroup(make_cfg(), str(tmp_path / "policy"), world_size=2) as group:
            assert group.num_params > 0
            learners = {pid: cmd for pid, cmd in procs.tree(marker).items() if "LearnerWorker" in cmd}
            listening = procs.listeners(learners)
    finally:
        ray.shutdown()
        del os.environ[procs.MARKER]
        procs.kill_tree(marker)
    print("\n".join(map(str, listening)))
    assert len(learners) == 2 and listening
    outside = [str(x) for x in listening if not x.loopback]
    assert not outside, "listening beyond loopback:\n" + "\n".join(outside)
