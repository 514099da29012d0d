"""A remote environment (``train.remote``) plays exactly what the local one plays: the same seeds give
the same episodes, action by action, and the same Parquet bytes from a rollout of the tiny FrozenLake
setup."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import envs
from envs.wire.client import RemoteEnv, SettingsMismatchError
from envs.wire.server import ServerThread, create_app, running
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig, RemoteEnvConfig
from ragen_core.protocol import ProtocolConfig

#: configs/frozenlake-tiny.yaml's environment settings and agent
NO_SLIP = {"is_slippery": False, "think_holes": True}
AGENT = ProtocolConfig(max_turn=5, max_actions_per_turn=2, enable_think=True)
#: the untrained policy of the rollout test spells actions only when its answer is constrained to them
#: (and answers at once: with a think part first it rarely reaches the answer in 48 tokens)
CONSTRAINED = ProtocolConfig(
    max_turn=5, max_actions_per_turn=2, enable_think=False, action_decoding="constrained"
)


@pytest.fixture(scope="module")
def lake() -> Iterator[ServerThread]:
    with running(create_app("FrozenLake", NO_SLIP)) as server:
        yield server


@pytest.fixture(scope="module")
def slippery() -> Iterator[ServerThread]:
    with running(create_app("FrozenLake")) as server:
        yield server


@pytest.mark.parametrize("overrides", [NO_SLIP, {}], ids=["no-slip", "slippery"])
def test_remote_env_steps_exactly_as_the_local_one(
    overrides: dict[str, Any], lake: ServerThread, slippery: ServerThread
) -> None:
    url = (lake if overrides else slippery).url
    remote = RemoteEnv(url, tag="FrozenLake", env_config=envs.spec("FrozenLake", **overrides).env_config)
    local = envs.make("FrozenLake", **overrides)
    rng = random.Random(0)
    try:
        assert remote.spec == local.spec  # type: ignore[attr-defined]
        for seed in range(20):
            assert remote.reset(seed) == local.reset(seed)
            assert (remote.actions, remote.grid_vocab) == (local.actions, local.grid_vocab)
            for _ in range(12):
                move = rng.choice([*local.actions, "Jump"])  # type: ignore[misc]
                assert remote.step(move) == local.step(move)
                assert remote.render() == local.render()
    finally:
        remote.close()


def test_a_server_with_other_settings_is_refused_before_any_episode(slippery: ServerThread) -> None:
    cfg = EnvGroupsConfig(
        tags=["FrozenLake"],
        n_groups=[1],
        group_size=1,
        env_overrides={"FrozenLake": NO_SLIP},
        remote={"FrozenLake": RemoteEnvConfig(url=slippery.url)},
    )
    with pytest.raises(SettingsMismatchError) as refused:
        EnvGroups(cfg, AGENT)
    text = str(refused.value)
    assert slippery.http_url in text and "is_slippery=True (config: False)" in text
    assert "ragen env serve FrozenLake --set is_slippery=false --set think_holes=true" in text


def _rollout_parquet(remote: dict[str, RemoteEnvConfig], path: Path, policy: Any) -> bytes:
    from ragen_core.rollout.engine import SamplingParams
    from ragen_core.rollout.hf_engine import HFEngine
    from ragen_core.rollout.runner import run_rollouts
    from ragen_core.trajectory import write_trajectories

    model, tok = policy
    cfg = EnvGroupsConfig(
        tags=["FrozenLake"], n_groups=[8], group_size=4, env_overrides={"FrozenLake": NO_SLIP}, remote=remote
    )
    groups = EnvGroups(cfg, CONSTRAINED)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    trajs = run_rollouts(
        groups, HFEngine(model, tok), tok, params, seed=3, seed_round=1, iteration=2, run_id="r"
    )
    for st in groups.env_ids:
        groups.env(st).close()
    assert sum(s.num_actions for s in groups.trajectories()) > 0, "no action was played: nothing compared"
    return write_trajectories(trajs, path).read_bytes()


def test_rollouts_of_the_tiny_frozenlake_setup_give_the_same_parquet_bytes(
    lake: ServerThread, tmp_path: Path, one_thread: None
) -> None:
    from tests.tiny_policy import smallest_policy

    policy = smallest_policy()
    local = _rollout_parquet({}, tmp_path / "local.parquet", policy)
    remote = _rollout_parquet(
        {"FrozenLake": RemoteEnvConfig(url=lake.url)}, tmp_path / "remote.parquet", policy
    )
    assert remote == local
