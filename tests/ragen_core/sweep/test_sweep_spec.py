"""The sweep file and its expansion (``ragen_core.sweep.spec``): member keys and overrides, file
errors, per-member config validation, and the sweep files shipped in ``sweeps/``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ragen_core.sweep.spec import SweepConfig, SweepError, expand, load_sweep, validate_members

ROOT = Path(__file__).resolve().parents[3]
BANDIT = ROOT / "configs" / "bandit-tiny.yaml"
IMPOSSIBLE = "learner.optim.mini_batch_size=999"  # larger than any filtered batch of bandit-tiny


def write_sweep(path: Path, **fields: object) -> Path:
    data = {"name": "t", "base": str(BANDIT), "seeds": [0], **fields}
    path.write_text(yaml.safe_dump(data))
    return path


def test_expand_is_members_x_grid_x_seeds_with_stable_keys() -> None:
    sweep = SweepConfig(
        name="abl",
        base=str(BANDIT),
        overrides=["trainer.iterations=2"],
        members=[
            {"name": "ppo", "overrides": ["learner.algorithm.adv_estimator=gae"]},
            {"name": "grpo", "overrides": ["learner.algorithm.adv_estimator=grpo"]},
        ],
        grid={"rollout.filter.value": [0.25, 0.5], "agent.enable_think": [True, False]},
        seeds=[0, 1, 2],
        seed_keys=["trainer.seed", "learner.seed"],
    )
    members = expand(sweep)
    assert len(members) == 2 * 4 * 3
    assert len({m.key for m in members}) == len(members)
    assert [m.key for m in members] == [m.key for m in expand(sweep)]  # stable
    first = members[0]
    assert first.key == "ppo,value=0.25,enable_think=true-s0"
    assert first.group == "ppo,value=0.25,enable_think=true"
    # order: sweep overrides, member, grid, seed keys (later ones win)
    assert first.overrides == (
        "trainer.iterations=2",
        "learner.algorithm.adv_estimator=gae",
        "rollout.filter.value=0.25",
        "agent.enable_think=true",
        "trainer.seed=0",
        "learner.seed=0",
    )
    assert [m.seed for m in members[:3]] == [0, 1, 2] and len({m.group for m in members[:3]}) == 1
    assert members[-1].key == "grpo,value=0.5,enable_think=false-s2"
    assert [m.index for m in members] == list(range(len(members)))
    # grid only, members only, neither
    assert [m.key for m in expand(SweepConfig(name="g", base="x", grid={"a.b": [1, 2]}))] == [
        "b=1-s0",
        "b=2-s0",
    ]
    assert [m.key for m in expand(SweepConfig(name="m", base="x", members=[{"name": "v"}], seeds=[3]))] == [
        "v-s3"
    ]
    assert [m.key for m in expand(SweepConfig(name="n", base="x"))] == ["base-s0"]
    # two grid keys with the same last part keep their full names
    keys = [m.key for m in expand(SweepConfig(name="d", base="x", grid={"train.seed": [1], "val.seed": [2]}))]
    assert keys == ["train.seed=1,val.seed=2-s0"]


def test_sweep_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"base config .* not found"):
        load_sweep(write_sweep(tmp_path / "a.yaml", base="configs/nope.yaml"))
    with pytest.raises(SweepError, match="seeds must be distinct"):
        load_sweep(write_sweep(tmp_path / "b.yaml", seeds=[1, 1]))
    with pytest.raises(SweepError, match="gird"):
        load_sweep(write_sweep(tmp_path / "c.yaml", gird={"a": [1]}))
    with pytest.raises(SweepError, match="member names must be distinct"):
        load_sweep(write_sweep(tmp_path / "d.yaml", members=[{"name": "x"}, {"name": "x"}]))
    # base relative to the sweep file's folder (or a parent) when not relative to the working dir
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text(BANDIT.read_text())
    (tmp_path / "sweeps").mkdir()
    assert Path(load_sweep(write_sweep(tmp_path / "sweeps" / "e.yaml", base="configs/c.yaml")).base).is_file()


def test_validation_reports_the_impossible_member_and_keeps_the_others() -> None:
    sweep = SweepConfig(
        name="v",
        base=str(BANDIT),
        members=[
            {"name": "ok"},
            {"name": "bad", "overrides": [IMPOSSIBLE]},
            {"name": "typo", "overrides": ["learner.optim.mini_bach_size=4"]},
        ],
        seeds=[0, 1],
    )
    configs, errors = validate_members(sweep, expand(sweep))
    assert set(configs) == {"ok-s0", "ok-s1"}
    assert set(errors) == {"bad-s0", "bad-s1", "typo-s0", "typo-s1"}
    assert "mini_batch_size=999" in errors["bad-s0"]
    assert "did you mean learner.optim.mini_batch_size" in errors["typo-s0"]
    assert configs["ok-s1"].trainer.seed == 1


def test_a_compared_metric_that_members_do_not_send_names_the_fix() -> None:
    """The report reads MLflow: a compared metric outside the core set needs tracking.metrics=all."""
    sweep = SweepConfig(
        name="c",
        base=str(BANDIT),
        members=[{"name": "core"}, {"name": "all", "overrides": ["tracking.metrics=all"]}],
        compare=["val-env/*/success", "critic/vf_loss", "actor/entropy"],
        seeds=[0],
    )
    configs, errors = validate_members(sweep, expand(sweep))
    assert set(configs) == {"all-s0"} and set(errors) == {"core-s0"}
    assert errors["core-s0"].startswith("compare: critic/vf_loss not sent to MLflow")
    assert "tracking.metrics=all" in errors["core-s0"]


def test_every_shipped_sweep_file_expands_and_validates() -> None:
    files = sorted((ROOT / "sweeps").rglob("*.yaml"))
    assert any("tiny" in f.parts for f in files) and any("paper" in f.parts for f in files)
    for f in files:
        sweep = load_sweep(f)
        members = expand(sweep)
        _, errors = validate_members(sweep, members)
        assert not errors, (f, errors)
        if "tiny" in f.parts:
            assert len(sweep.seeds) == 3, f


def test_a_member_run_inside_the_state_folder_resolves_in_a_copy_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """state.json records a member's run inside the state folder relative to it (as the run index
    does), so a copied or moved state folder resumes its own member runs, never the original's."""
    from ragen_core.state_folder import index_entry
    from ragen_core.sweep.state import MemberState

    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "state"))
    entry = index_entry(tmp_path / "state" / "runs" / "s.a-s0-1")
    assert entry == "runs/s.a-s0-1"
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "copy"))
    assert MemberState(run_dir=entry).run_path() == tmp_path / "copy" / "runs" / "s.a-s0-1"
    assert MemberState().run_path() is None
