"""``ragen evaluate``: each tag is played with its own budget (or a config's), on one loaded model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from flows.evaluate import evaluate
from ragen_core.protocol import ProtocolConfig
from ragen_core.run.evaluation import (
    EvaluateRequest,
    Policy,
    budgets,
    evaluation_markdown,
    resolve_policy,
    tag_rows,
)
from ragen_core.trajectory import read_trajectories

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]


def test_a_model_folder_plays_each_tag_with_its_catalogue_budget() -> None:
    plan = budgets(EvaluateRequest(policy="m", tags=["Bandit", "SimpleSokoban", "BanditTest"]), None, None)
    by_tags = {tuple(b.tags): (b.protocol.max_turn, b.max_new_tokens) for b in plan}
    # Bandit used to get the protocol default of 5 turns: an invalid answer was retried 4 times.
    assert by_tags == {("Bandit", "BanditTest"): (1, 100), ("SimpleSokoban",): (5, 100)}


def test_max_new_tokens_wins_and_a_run_or_config_protocol_applies_to_every_tag(tmp_path: Path) -> None:
    plan = budgets(
        EvaluateRequest(policy="m", tags=["Bandit", "SimpleSokoban"], max_new_tokens=24), None, None
    )
    assert sorted(b.max_new_tokens for b in plan) == [24, 24]
    run_protocol = ProtocolConfig(max_turn=3, enable_think=False)
    (only,) = budgets(EvaluateRequest(policy="r", tags=["Bandit", "SimpleSokoban"]), run_protocol, 48)
    assert (
        only.protocol == run_protocol
        and only.max_new_tokens == 48
        and only.tags == ["Bandit", "SimpleSokoban"]
    )
    cfg = yaml.safe_load((ROOT / "configs" / "bandit-tiny.yaml").read_text())
    cfg["agent"]["max_turn"] = 2
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (only,) = budgets(EvaluateRequest(policy="r", tags=["SimpleSokoban"], config=str(path)), run_protocol, 48)
    assert only.protocol.max_turn == 2 and only.max_new_tokens == cfg["rollout"]["max_new_tokens"]


def test_evaluate_plays_tags_with_different_budgets_on_one_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ragen_core.models.policies import save_policy
    from tests.tiny_policy import smallest_policy

    model, tok = smallest_policy()
    folder = save_policy(model, tok, tmp_path / "model")
    request = EvaluateRequest(
        policy=str(folder),
        tags=["Bandit", "SimpleSokoban"],
        n_per_tag=3,
        max_new_tokens=6,
        out_dir=str(tmp_path / "eval"),
        log_to_mlflow=False,
    )
    with caplog.at_level(logging.INFO, logger="ragen.flows"):
        result = evaluate.fn(request)  # the flow's body: no Prefect server for a unit test
    trajectories = read_trajectories(Path(result["out_dir"]) / "eval.parquet")
    turns = {
        tag: max(t.turn_count for t in trajectories if t.env_tag == tag)
        for tag in ("Bandit", "SimpleSokoban")
    }
    assert len(trajectories) == 6
    assert turns["Bandit"] == 1  # the untrained model answers badly: more turns would be played if allowed
    assert turns["SimpleSokoban"] > 1
    metrics = result["metrics"]
    # success per tag only: an average over tags would mix a trained-on tag with a held-out one
    assert {"val-env/Bandit/success", "val-env/SimpleSokoban/success"} <= set(metrics)
    assert "val-env/success" not in metrics
    assert [r["tag"] for r in result["tags"]] == ["Bandit", "SimpleSokoban"]
    assert all(r["held_out"] is None for r in result["tags"])  # a model folder: trained on nothing known
    assert "playing Bandit: 3 episodes each, 1 turn(s), 6 new tokens per turn" in caplog.text
    assert "SimpleSokoban: success" in caplog.text


def test_a_run_defaults_to_its_validation_tags_a_model_to_simple_sokoban(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evaluate --tags` once defaulted to SimpleSokoban whatever the run trained on."""
    from ragen_core.config import dump_config, load_config
    from ragen_core.run.run_dir import RunDir

    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))
    run = RunDir(tmp_path / "runs" / "bandit-0123abcd-ef4567")
    cfg = load_config(
        ROOT / "configs" / "bandit-tiny.yaml", ["val.tags=[Bandit,BanditTest]", "val.n_groups=[4,4]"]
    )
    dump_config(cfg, run.config_path)
    run.init_policy.mkdir()
    policy = resolve_policy(run.root.name)
    assert policy.label == f"{run.root.name}@0" and policy.path == run.init_policy
    assert policy.default_tags() == ["Bandit", "BanditTest"] and policy.train_tags == ["Bandit"]
    assert [policy.held_out(t) for t in ("Bandit", "BanditTest")] == [False, True]
    folder = tmp_path / "model"
    folder.mkdir()
    model = resolve_policy(str(folder))
    assert model.default_tags() == ["SimpleSokoban"] and model.held_out("Bandit") is None


def test_the_evaluation_report_keeps_held_out_tags_apart() -> None:
    policy = Policy("p", None, None, "run@3", train_tags=["Bandit"], val_tags=["Bandit", "BanditTest"])
    metrics = {"val-env/BanditTest/success": 0.25, "val-env/Bandit/success": 0.75}
    rows = tag_rows(policy, ["BanditTest", "Bandit"], metrics)
    assert [(r["tag"], r["held_out"], r["success"]) for r in rows] == [
        ("Bandit", False, 0.75),  # trained-on tags first
        ("BanditTest", True, 0.25),
    ]
    text = evaluation_markdown("run@3", rows, 64, "abc123")
    assert "| Bandit | 0.750 | yes |" in text and "| BanditTest | 0.250 | **held out** |" in text
    assert "MLflow run `abc123`" in text and "the pulled arm is the high-risk arm" in text
    assert "0.5" not in text  # no average of the two
    where = evaluation_markdown("run@3", rows, 64, None, "/s/evals/run-3", "/s/runs/run")
    assert (
        "Episodes and metrics in `/s/evals/run-3`" in where and "Evaluated run folder `/s/runs/run`" in where
    )
