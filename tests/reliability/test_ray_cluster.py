"""The ray backend's own cluster: never another process's cluster; learner groups placed all at once or not at all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from ragen_core.learner.actors import LearnerGroup, LearnerPlacementError, init_ray
from tests.ragen_core.learner.test_learner import make_cfg
from tests.reliability import procs

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


RAY_BIN = Path(sys.executable).parent / "ray"


@pytest.fixture
def no_ray():
    """This test starts Ray itself: none may run in this process before, none is left after."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture
def other_cluster(tmp_path: Path):
    """A cluster started by someone else in a shell (``ray start --head``), registered in /tmp/ray as
    the machine's current cluster, stopped afterwards by killing its processes (not ``ray stop``,
    which would stop every Ray on the machine)."""
    from ray._common.utils import get_ray_address_file

    marker = procs.new_marker()
    port = procs.free_port()
    env = {**os.environ, **marker, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with procs.ray_current_cluster_kept():
        try:
            subprocess.run(
                [
                    str(RAY_BIN),
                    "start",
                    "--head",
                    "--port",
                    str(port),
                    "--node-ip-address",
                    "127.0.0.1",
                    "--num-cpus",
                    "1",
                    "--include-dashboard",
                    "false",
                    "--disable-usage-stats",
                ],
                env=env,
                check=True,
                capture_output=True,
                timeout=180,
            )
            current = Path(get_ray_address_file(None)).read_text().strip()
            assert current.endswith(f":{port}")  # the failing case: it is the machine's "current" one
            yield port, marker
        finally:
            procs.kill_tree(marker)


def test_starts_its_own_cluster_next_to_another(
    no_ray, other_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix ray.init() joined the other cluster and failed: "When connecting to an existing
    cluster, num_cpus and num_gpus must not be provided"."""
    other_port, other_marker = other_cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    resources = init_ray(num_cpus=2, object_store_memory=128 * 1024**2)
    gcs = ray.get_runtime_context().gcs_address
    assert not gcs.endswith(f":{other_port}"), f"joined the other cluster at {gcs}"
    assert resources["CPU"] == 2 and len(ray.nodes()) == 1
    assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
    ray.shutdown()
    assert procs.tree(other_marker), "stopping our cluster stopped the other one"


def test_learner_group_the_cluster_cannot_hold_fails_at_once(no_ray) -> None:
    init_ray(num_cpus=2, object_store_memory=128 * 1024**2)
    t0 = time.monotonic()
    with pytest.raises(LearnerPlacementError) as info:
        LearnerGroup(make_cfg(), "no-model-needed", world_size=3)
    message = str(info.value)
    print(message)
    assert time.monotonic() - t0 < 10
    for part in ("trainer.learners=3", "learner.num_cpus=1", "need 3 CPUs", "has 2 CPUs"):
        assert part in message, part
    assert ray.available_resources().get("CPU") == 2  # nothing was left reserved


def test_learner_group_waits_briefly_for_busy_cpus_then_fails(no_ray) -> None:
    """The cluster has the CPUs, but another actor (the rollout worker) holds one,
    so one of two learners can never start; it used to wait 300 s at the rendezvous."""
    init_ray(num_cpus=2, object_store_memory=128 * 1024**2)
    holder = ray.remote(num_cpus=1)(type("Holder", (), {"ping": lambda self: 1})).remote()
    assert ray.get(holder.ping.remote()) == 1
    t0 = time.monotonic()
    with pytest.raises(LearnerPlacementError, match=r"trainer\.learners=2 .* not free within 2 s.*\(1 free"):
        LearnerGroup(make_cfg(), "no-model-needed", world_size=2, placement_timeout_s=2)
    assert time.monotonic() - t0 < 15
    ray.kill(holder)


def test_an_unreachable_ray_address_fails_at_once_naming_it(no_ray, monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init keeps retrying an address where nothing answers (measured: over 5 minutes); the run
    refuses it in preflight, before any work, and init_ray does too, each naming the address and the fix."""
    from ragen_core.config import load_config
    from ragen_core.learner.actors import RayAddressError
    from ragen_core.run.preflight import PreflightError, preflight

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    t0 = time.monotonic()
    with pytest.raises(
        RayAddressError, match=rf"RAY_ADDRESS={address}: no Ray cluster answers there .*unset RAY_ADDRESS"
    ):
        init_ray()
    with pytest.raises(PreflightError, match=rf"RAY_ADDRESS={address}: no Ray cluster answers"):
        preflight(load_config(None, ["trainer.backend=ray"]))
    preflight(load_config(None, ["trainer.backend=local"]))  # the in-process backend does not use it
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()


def test_a_local_cluster_that_does_not_start_in_time_is_one_line_with_the_fix(
    no_ray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray waits a fixed 30 s for its node and raises a bare Exception; `make run` at low priority beside
    a 2-thread training run hit it ("internal error: Exception: The current node timed out during
    startup"). The timeout is Ray's own text (checked in its source), raised here without the 30 s wait."""
    import inspect

    import ray._private.node

    from ragen_core.errors import is_user_error
    from ragen_core.learner.ray_sessions import RayStartError

    ray_text = "The current node timed out during startup. This could happen because some of the raylet"
    assert "The current node timed out during startup" in inspect.getsource(ray._private.node)

    def starved(*args: object, **kwargs: object) -> None:
        raise Exception(ray_text)  # what ray.init raises, as Ray raises it

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", starved)
    with pytest.raises(
        RayStartError, match=r"did not register within Ray's 30 s .*trainer\.backend=local"
    ) as err:
        init_ray()
    assert is_user_error(err.value) and "ragen train --resume" in str(err.value)

    def other(*args: object, **kwargs: object) -> None:
        raise Exception("something else")

    monkeypatch.setattr(ray, "init", other)
    with pytest.raises(Exception, match="something else") as err2:  # other failures pass through as they are
        init_ray()
    assert not isinstance(err2.value, RayStartError)


def test_the_callers_sigterm_handler_outlives_ray_init(no_ray) -> None:
    """ray.init() makes a driver's SIGTERM ``sys.exit``: a SIGTERM to `ragen train` on the ray backend
    then ended in Prefect's "Crash detected" and no line saying how to resume. The CLI's handler (which
    unwinds the run as Ctrl-C does) must still be the one after the cluster starts."""
    import signal

    def ours(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        init_ray(num_cpus=1, object_store_memory=128 * 1024**2)
        assert signal.getsignal(signal.SIGTERM) is ours
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
