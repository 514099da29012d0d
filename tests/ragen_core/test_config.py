"""The run config: YAML + dotted overrides, clear errors, stable hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.config import (
    ConfigError,
    RagenConfig,
    config_hash,
    dump_config,
    flatten,
    load_config,
    parse_overrides,
)


def test_defaults_are_ragens_base_yaml() -> None:
    cfg = load_config(overrides=["learner.optim.mini_batch_size=32"])
    assert cfg.train.num_envs == 128 and cfg.val.num_envs == 256
    assert cfg.rollout.filter_ratio == 0.25
    assert cfg.learner.algorithm.clip_low == 0.2 and cfg.learner.algorithm.clip_high == 0.28
    assert cfg.learner.algorithm.adv_estimator == "gae" and not cfg.learner.algorithm.use_kl_loss
    assert cfg.agent.max_turn == 5 and cfg.agent.format_penalty == -0.1


def test_the_mini_batch_check_counts_kept_groups_as_the_filter_does() -> None:
    # 0.58 x 25 groups keeps 15 groups (the filter's count), so a mini-batch of 15 x 4 fits and 61 does not
    base = ["train.n_groups=[25]", "train.group_size=4", "rollout.filter_ratio=0.58"]
    assert (
        load_config(overrides=[*base, "learner.optim.mini_batch_size=60"]).learner.optim.mini_batch_size == 60
    )
    with pytest.raises(ConfigError, match=r"filtered batch \(60 = 15 kept groups x 4\)"):
        load_config(overrides=[*base, "learner.optim.mini_batch_size=61"])


def test_overrides_parse_yaml_values() -> None:
    assert parse_overrides(["a.b=1", "a.c=[x, y]", "d=null", "e=0.28"]) == {
        "a": {"b": 1, "c": ["x", "y"]},
        "d": None,
        "e": 0.28,
    }
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_overrides(["learner.algorithm.clip_high"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.group_sise=3", r"train\.group_sise: unknown key; did you mean train\.group_size\?"),
        ("learner.algorithm.clip_hgh=0.3", r"did you mean learner\.algorithm\.clip_high\?"),
        ("rollout.temperature=hot", r"rollout\.temperature: .*valid number"),
        (
            "train.group_size=1",
            r"train\.group_size=1 has no in-group reward variance.*rollout\.filter_ratio=1",
        ),
        ("rollout.filter_ratio=0.1", r"learner\.optim\.mini_batch_size=32 is larger than the filtered batch"),
        ("rollout.engine=vlm", r"rollout\.engine"),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_grpo_needs_groups() -> None:
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo needs train\.group_size>=2"):
        load_config(
            overrides=["learner.algorithm.adv_estimator=grpo", "train.group_size=1", "rollout.filter_ratio=1"]
        )


#: one trajectory per group (8 groups of 1, all kept), or a single trajectory per tag too
SINGLES = ["train.group_size=1", "rollout.filter_ratio=1", "learner.optim.mini_batch_size=1"]
ONE_ROW = [*SINGLES, "train.n_groups=[1]"]
NORM = "learner.algorithm.reward_normalization"


@pytest.mark.parametrize(
    ("overrides", "grouping"),
    [(SINGLES, "state"), (SINGLES, "inductive"), (ONE_ROW, "inductive"), (ONE_ROW, "batch")],
)
def test_normalisation_without_groups_to_normalise_is_refused(overrides: list[str], grouping: str) -> None:
    asked = [*overrides, f"{NORM}.method=mean_std", f"{NORM}.grouping={grouping}"]
    if grouping == "inductive" and overrides is SINGLES:  # 8 trajectories of one tag: a group of 8
        assert load_config(overrides=asked).learner.algorithm.reward_normalization.active
        return
    fix = rf"grouping '{grouping}' only sees groups of one trajectory.*set train\.group_size>=2"
    with pytest.raises(ConfigError, match=fix):
        load_config(overrides=asked)
    load_config(overrides=[*overrides, f"{NORM}.grouping={grouping}"])  # identity needs no groups


def test_a_stored_config_from_before_the_ragen2_options_loads_and_resumes(tmp_path: Path) -> None:
    import yaml

    from ragen_core.integrity import record
    from ragen_core.resume import resume_config
    from ragen_core.run_dir import RunDir

    cfg = load_config()
    data = cfg.model_dump(mode="json")
    for key in (
        "reward_normalization",
        "use_turn_scores",
        "soft_advantage_reweight",
        "grpo_advantage_length_weight",
        "zero_task_advantage",
    ):
        del data["learner"]["algorithm"][key]  # as the version before these keys wrote it
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    record(path)
    stored = RunDir(tmp_path).config()
    assert stored == cfg
    _, changes = resume_config(tmp_path, stored, 0, overrides=["trainer.iterations=9"])
    assert changes == {"trainer.iterations": (str(cfg.trainer.iterations), "9")}


def test_yaml_round_trip_and_hash(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            "trainer.iterations=3",
            "train.tags=[Bandit]",
            "train.n_groups=[4]",
            "train.group_size=4",
            "learner.optim.mini_batch_size=4",
        ]
    )
    path = dump_config(cfg, tmp_path / "run.yaml")
    again = load_config(path)
    assert again == cfg and config_hash(again) == config_hash(cfg)
    assert config_hash(load_config(path, ["trainer.seed=1"])) != config_hash(cfg)
    flat = flatten(cfg)
    assert flat["train.tags"] == '["Bandit"]' and flat["trainer.iterations"] == "3"
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.tags=[Banditt]", r"train\.tags: unknown environment tag 'Banditt'; did you mean Bandit"),
        (
            "val.tags=[SimpleSokoba]",
            r"val\.tags: unknown environment tag 'SimpleSokoba'; did you mean SimpleSokoban",
        ),
        ("sft.tags=[FrozenLak]", r"sft\.tags: unknown environment tag 'FrozenLak'; did you mean FrozenLake"),
        ("train.tags=[Zzzz]", r"train\.tags: unknown environment tag 'Zzzz'; known tags: .*Bandit"),
        (
            "model.hidden_size=65",
            r"model\.hidden_size=65 is not divisible by model\.num_heads=4.*model\.hidden_size=64",
        ),
        ("model.hidden_size=60", r"model\.hidden_size / model\.num_heads = 15 is odd.*rotary"),
        ("model.num_kv_heads=3", r"model\.num_heads=4 is not divisible by model\.num_kv_heads=3"),
    ],
)
def test_tags_and_model_shapes_are_checked_at_load(override: str, message: str) -> None:
    """Issue 18 (9): these failed only once the warm start had run (39-76 s) and left a run directory."""
    overrides = [override, "learner.optim.mini_batch_size=32"]
    if override.startswith("sft."):
        overrides.append("sft.steps=1")  # the defaults have no warm start: this creates the section
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_a_saved_model_brings_its_own_shape_and_registered_tags_are_known() -> None:
    import envs
    from envs.registry import EnvSpec

    cfg = load_config(
        overrides=["model.path=/models/qwen", "model.hidden_size=65", "learner.optim.mini_batch_size=32"]
    )
    assert cfg.model.hidden_size == 65  # ignored when model.path is set: nothing to check
    envs.register_tag(EnvSpec(tag="ConfigProbeSokoban", env_type="sokoban", env_config={"dim_room": [5, 5]}))
    assert load_config(
        overrides=["train.tags=[ConfigProbeSokoban]", "learner.optim.mini_batch_size=32"]
    ).train.tags == ["ConfigProbeSokoban"]


def test_yaml_errors_name_the_file_the_line_and_the_override(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  iterations: 3\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"config file {bad}: YAML syntax error at line \d+, column \d+"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"--set trainer\.iterations=\[1,: the value is not valid YAML"):
        parse_overrides(["trainer.iterations=[1,"])


def test_config_error_is_a_user_error() -> None:
    from ragen_core.errors import RagenError, is_user_error

    err = ConfigError("x")
    assert isinstance(err, RagenError) and isinstance(err, ValueError) and is_user_error(err)


def _with_sft_protocol(tmp_path: Path) -> tuple[RagenConfig, Path]:
    """A config with a warm start, and its dump as versions before ``sft.protocol`` was removed wrote a
    run's config.yaml: every field, so ``sft.protocol`` in full."""
    import yaml

    from ragen_core.protocol import ProtocolConfig

    cfg = load_config(
        overrides=["train.tags=[Bandit]", "sft.tags=[Bandit]", "learner.optim.mini_batch_size=32"]
    )
    data = cfg.model_dump(mode="json")
    data["sft"]["protocol"] = ProtocolConfig(enable_think=False).model_dump(mode="json")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return cfg, path


def test_a_stored_config_with_a_removed_key_still_loads_and_resumes(tmp_path: Path) -> None:
    from ragen_core.integrity import record
    from ragen_core.resume import resume_config
    from ragen_core.run_dir import RunDir

    cfg, path = _with_sft_protocol(tmp_path)
    record(path)  # as create_run does: RunDir.config checks the digest
    stored = RunDir(tmp_path).config()
    assert stored == cfg and config_hash(stored) == config_hash(cfg)
    given, changes = resume_config(tmp_path, stored, 0, overrides=["trainer.iterations=9"])
    assert (
        changes == {"trainer.iterations": (str(cfg.trainer.iterations), "9")}
        and given.trainer.iterations == 9
    )


def test_a_written_config_with_a_removed_key_is_refused_with_the_fix(tmp_path: Path) -> None:
    _, path = _with_sft_protocol(tmp_path)
    fix = r"sft\.protocol: removed: .*agent protocol; set agent\.\* instead"
    with pytest.raises(ConfigError, match=fix):
        load_config(path)
    with pytest.raises(ConfigError, match=fix):  # in an override, also over a stored config
        load_config(path, ["sft.protocol.enable_think=false"], stored=True)
