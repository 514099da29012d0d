"""The run config: YAML + dotted overrides, clear errors, stable hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.config import ConfigError, config_hash, dump_config, flatten, load_config, parse_overrides


def test_defaults_are_ragens_base_yaml() -> None:
    cfg = load_config(overrides=["learner.optim.mini_batch_size=32"])
    assert cfg.train.num_envs == 128 and cfg.val.num_envs == 256
    assert cfg.rollout.filter_ratio == 0.25 and cfg.filtered_batch_size == 32
    assert cfg.learner.algorithm.clip_low == 0.2 and cfg.learner.algorithm.clip_high == 0.28
    assert cfg.learner.algorithm.adv_estimator == "gae" and not cfg.learner.algorithm.use_kl_loss
    assert cfg.agent.max_turn == 5 and cfg.agent.format_penalty == -0.1


def test_overrides_parse_yaml_values() -> None:
    assert parse_overrides(["a.b=1", "a.c=[x, y]", "d=null", "e=0.28"]) == {
        "a": {"b": 1, "c": ["x", "y"]}, "d": None, "e": 0.28}
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_overrides(["learner.algorithm.clip_high"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.group_sise=3", r"train\.group_sise: unknown key; did you mean train\.group_size\?"),
        ("learner.algorithm.clip_hgh=0.3", r"did you mean learner\.algorithm\.clip_high\?"),
        ("rollout.temperature=hot", r"rollout\.temperature: .*valid number"),
        ("train.group_size=1", r"train\.group_size=1 has no in-group reward variance.*rollout\.filter_ratio=1"),
        ("rollout.filter_ratio=0.1", r"learner\.optim\.mini_batch_size=32 is larger than the filtered batch"),
        ("rollout.engine=vlm", r"rollout\.engine"),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_grpo_needs_groups() -> None:
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo needs train\.group_size>=2"):
        load_config(overrides=["learner.algorithm.adv_estimator=grpo", "train.group_size=1",
                               "rollout.filter_ratio=1"])


def test_yaml_round_trip_and_hash(tmp_path: Path) -> None:
    cfg = load_config(overrides=["trainer.iterations=3", "train.tags=[Bandit]", "train.n_groups=[4]",
                                 "train.group_size=4", "learner.optim.mini_batch_size=4"])
    path = dump_config(cfg, tmp_path / "run.yaml")
    again = load_config(path)
    assert again == cfg and config_hash(again) == config_hash(cfg)
    assert config_hash(load_config(path, ["trainer.seed=1"])) != config_hash(cfg)
    flat = flatten(cfg)
    assert flat["train.tags"] == '["Bandit"]' and flat["trainer.iterations"] == "3"
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
