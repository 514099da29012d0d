"""The run config: YAML + dotted overrides, clear errors, stable hash."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

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
    assert cfg.rollout.filter.value == 0.25 and cfg.rollout.filter.strategy == "top_k"
    assert cfg.learner.algorithm.clip_low == 0.2 and cfg.learner.algorithm.clip_high == 0.28
    assert cfg.learner.algorithm.adv_estimator == "gae" and not cfg.learner.algorithm.use_kl_loss
    assert cfg.agent.max_turn == 5 and cfg.agent.format_penalty == -0.1


def test_the_mini_batch_check_counts_kept_groups_as_the_filter_does() -> None:
    # 0.58 x 25 groups keeps 15 groups (the filter's count), so a mini-batch of 15 x 4 fits and 61 does not
    base = ["train.n_groups=[25]", "train.group_size=4", "rollout.filter.value=0.58"]
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
        # a key of another section, given at the wrong level: every section that has it is named
        ("iterations=3", r"iterations: unknown key; it is a key of another section: trainer\.iterations$"),
        ("seed=1", r"seed: unknown key; it is a key of another section: .*sft\.seed or .*trainer\.seed"),
        ("rollout.temperature=hot", r"rollout\.temperature: .*valid number"),
        (
            "train.group_size=1",
            r"train\.group_size=1 has no in-group reward variance.*rollout\.filter\.value=1",
        ),
        ("rollout.filter.value=0.1", r"learner\.optim\.mini_batch_size=32 is larger than the filtered batch"),
        ("rollout.engine=vlm", r"rollout\.engine"),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_grpo_needs_groups() -> None:
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo needs train\.group_size>=2"):
        load_config(
            overrides=["learner.algorithm.adv_estimator=grpo", "train.group_size=1", "rollout.filter.value=1"]
        )


#: one trajectory per group (8 groups of 1, all kept), or a single trajectory per tag too
SINGLES = ["train.group_size=1", "rollout.filter.value=1", "learner.optim.mini_batch_size=1"]
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
    from ragen_core.run.resume import resume_config
    from ragen_core.run.run_dir import RunDir

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
    """These once failed only after the warm start had run (39-76 s) and left a run directory."""
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
    from ragen_core.run.resume import resume_config
    from ragen_core.run.run_dir import RunDir

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


# ----------------------------------------------------------------------------- rollout.filter

_SMALL = [
    "train.tags=[Bandit]",
    "train.n_groups=[8]",
    "train.group_size=4",
    "learner.optim.mini_batch_size=4",
]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.filter_ratio=0.5", r"rollout\.filter\.value"),
        ("rollout.filter_type=std_rev", r"rollout\.filter\.keep .*std_rev is smallest"),
        ("rollout.filter_ratio=null", r"rollout\.filter\.value"),  # set at all, even to null
    ],
)
def test_the_old_filter_keys_are_refused_naming_the_new_key(old: str, new: str) -> None:
    """``rollout.filter_ratio`` / ``filter_type`` were renamed into ``rollout.filter``: a config that
    writes one gets one error, naming the key to write instead."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*_SMALL, old])
    lines = str(err.value).splitlines()[1:]
    key = old.partition("=")[0]
    assert len(lines) == 1 and re.match(rf"\s*{re.escape(key)}: renamed: write {new}", lines[0]), lines


def test_every_renamed_key_names_its_new_key() -> None:
    from ragen_core.config import REMOVED_KEYS, RENAMED_KEYS

    for old, (new, _) in RENAMED_KEYS.items():
        assert f"write {'.'.join(new)}" in REMOVED_KEYS[old], old


def test_every_shipped_config_and_sweep_spells_the_filter_one_way() -> None:
    """configs/ and sweeps/ write the filter as rollout.filter.*: the old keys would be refused."""
    for path in sorted([*Path("configs").rglob("*.yaml"), *Path("sweeps").rglob("*.yaml")]):
        text = "\n".join(line.partition("#")[0] for line in path.read_text().splitlines())
        assert "filter_ratio" not in text and "filter_type" not in text, path
    for path in sorted(Path("configs").rglob("*.yaml")):
        f = load_config(path).rollout.filter
        assert (f.strategy, f.metric, f.include_zero) == ("top_k", "reward_variance", True), path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.filter.strategy=top_k_abs", "rollout.filter.value=2.5"],
            r"rollout\.filter\.value=2\.5 .*top_k_abs must be a whole number",
        ),
        (["rollout.filter.strategy=top_k_abs", "rollout.filter.value=0.5"], r"whole number of groups >= 1"),
        (
            ["rollout.filter.strategy=min_p", "rollout.filter.value=2"],
            r"rollout\.filter\.value=2\.0 .*strategy=min_p must be in \(0, 1\]",
        ),
        (["rollout.filter.strategy=top_pp"], r"rollout\.filter\.strategy"),
        (["rollout.filter.metric=variance"], r"rollout\.filter\.metric"),
        (["rollout.filter.loss_scaling=log"], r"rollout\.filter\.loss_scaling"),
        (["rollout.filter.keeep=largest"], r"did you mean rollout\.filter\.keep\?"),
        (
            ["train.group_size=1", "rollout.filter.metric=entropy_variance"],
            r"train\.group_size=1 has no in-group entropy variance .*rollout\.filter\.metric=entropy_variance",
        ),
        (
            [
                "rollout.filter.strategy=top_k_abs",
                "rollout.filter.value=1",
                "learner.optim.mini_batch_size=8",
            ],
            r"mini_batch_size=8 is larger than the filtered batch \(4 = 1 kept groups x 4\)",
        ),
    ],
)
def test_bad_filter_configs_name_the_key_and_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*_SMALL, *overrides])


def test_filters_that_fit_one_member_groups_and_adaptive_counts() -> None:
    one = [*_SMALL, "train.group_size=1", "learner.optim.mini_batch_size=2"]
    # no variance metric, or a filter that keeps everything: a group of one is fine
    assert load_config(overrides=[*one, "rollout.filter.metric=reward"]).rollout.filter.metric == "reward"
    assert load_config(overrides=[*one, "rollout.filter.strategy=top_p", "rollout.filter.value=1"])
    # top_p / min_p keep an unknown number of groups, at least one: a mini-batch of one group fits
    cfg = load_config(
        overrides=[
            *_SMALL,
            "rollout.filter.strategy=min_p",
            "rollout.filter.value=0.5",
            "learner.optim.mini_batch_size=4",
            "learner.optim.micro_batch_size=4",
        ]
    )
    assert cfg.rollout.filter.fixed_group_count(8) is None
    assert (
        load_config(
            overrides=[*_SMALL, "rollout.filter.strategy=top_k_abs", "rollout.filter.value=3"]
        ).rollout.filter.fixed_group_count(8)
        == 3
    )


def test_a_stored_config_with_the_old_filter_keys_loads_and_resumes(tmp_path: Path) -> None:
    """A run's config.yaml written before rollout.filter existed (filter_ratio / filter_type, no
    section) loads to the same filter and resumes without a refused change."""
    from ragen_core.integrity import record
    from ragen_core.run.resume import resume_config
    from ragen_core.run.run_dir import RunDir

    cfg = load_config(overrides=[*_SMALL, "rollout.filter.value=0.5"])
    data = cfg.model_dump(mode="json")
    data["rollout"].pop("filter")
    data["rollout"].update(filter_ratio=0.5, filter_type="std")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    record(path)
    stored = RunDir(tmp_path).config()
    assert stored == cfg and config_hash(stored) == config_hash(cfg)
    given, changes = resume_config(tmp_path, stored, 0, overrides=["trainer.iterations=9"])
    assert (
        changes == {"trainer.iterations": (str(cfg.trainer.iterations), "9")}
        and given.rollout.filter == cfg.rollout.filter
    )
    again = load_config(dump_config(cfg, tmp_path / "new.yaml"))
    assert again == cfg and "filter_ratio" not in (tmp_path / "new.yaml").read_text()


def test_an_adaptive_filter_with_a_mini_batch_larger_than_one_group_fails_before_any_work() -> None:
    """top_p / min_p may keep a single group in some iteration: a larger mini-batch would stop the run
    there (after the warm start), so the config is refused, naming the keys and the fix."""
    base = ["train.group_size=8"]
    for strategy, value in (("min_p", 0.5), ("top_p", 0.9)):
        with pytest.raises(
            ValueError, match=r"mini_batch_size=32 is larger than one group \(8 trajectories\)"
        ):
            load_config(
                overrides=[
                    *base,
                    f"rollout.filter.strategy={strategy}",
                    f"rollout.filter.value={value}",
                    "learner.optim.mini_batch_size=32",
                ]
            )
        cfg = load_config(
            overrides=[
                *base,
                f"rollout.filter.strategy={strategy}",
                f"rollout.filter.value={value}",
                "learner.optim.mini_batch_size=8",
                "learner.optim.micro_batch_size=8",
            ]
        )
        assert cfg.learner.optim.mini_batch_size == 8
    # top_p 1 keeps everything: any mini-batch up to the whole batch
    load_config(
        overrides=[
            *base,
            "rollout.filter.strategy=top_p",
            "rollout.filter.value=1.0",
            "learner.optim.mini_batch_size=32",
        ]
    )


def test_a_resume_may_change_the_number_of_learners(tmp_path: Path) -> None:
    """Elastic resume: trainer.learners changes only the all-reduce's summation order (each iteration
    records its own count for reruns); a change of what the iterations compute is still refused."""
    from ragen_core.config import dump_config
    from ragen_core.run.resume import ResumeError, resume_config

    stored = load_config(overrides=["trainer.learners=2"])
    dump_config(stored, tmp_path / "config.yaml")  # the run's own config, as a resume reads it
    given, changes = resume_config(tmp_path, stored, 3, overrides=["trainer.learners=1"])
    assert given.trainer.learners == 1 and changes == {"trainer.learners": ("2", "1")}
    with pytest.raises(ResumeError, match=r"learner\.optim\.actor_lr: stored .*, given 0\.5"):
        resume_config(tmp_path, stored, 3, overrides=["trainer.learners=1", "learner.optim.actor_lr=0.5"])


def test_the_config_loads_no_runtime() -> None:
    """The config's models are plain pydantic (``ragen_core/config/``): reading and checking a config
    (``ragen --help``, ``ragen show``, a config error) loads neither torch, transformers nor MLflow."""
    import subprocess
    import sys

    heavy = ("torch", "transformers", "mlflow")
    code = (
        "import sys, ragen_core.config as c; c.load_config('configs/bandit-tiny.yaml'); "
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing ragen_core.config loaded {out.stdout.strip()}"


def test_model_dtype_names_are_the_loaders() -> None:
    """``model.dtype``'s accepted spellings (config) are exactly those the loader maps to torch."""
    from ragen_core.config.model import DTYPE_NAMES
    from ragen_core.models.policies import _DTYPES

    assert set(DTYPE_NAMES) == set(_DTYPES)
