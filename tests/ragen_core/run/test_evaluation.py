"""``ragen_core.run.evaluation`` without a model: what a request plans, how the play drives one rollout
worker over the budgets, where its files go, and the MLflow tags that keep held-out tags apart."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pytest

from ragen_core.protocol import ProtocolConfig
from ragen_core.run.evaluation import (
    Budget,
    EvaluateError,
    EvaluateRequest,
    LoggedEvaluation,
    Policy,
    log_evaluation,
    plan_evaluation,
    play,
    run_tags,
    write_evaluation,
)


class FakeWorker:
    """A rollout worker that records how it is driven and plays nothing: one row per episode."""

    instances: ClassVar[list[FakeWorker]] = []

    def __init__(
        self, policy: str, protocol: dict[str, Any], train: dict[str, Any], val: dict[str, Any], engine: str
    ):
        self.calls: list[tuple[Any, ...]] = [
            ("open", policy, protocol["max_turn"], tuple(val["tags"]), engine)
        ]
        self.groups = val
        self.closed = False
        FakeWorker.instances.append(self)

    def set_groups(self, split: str, protocol: dict[str, Any], groups: dict[str, Any]) -> None:
        self.calls.append(("set_groups", split, protocol["max_turn"], tuple(groups["tags"])))
        self.groups = groups

    def rollout(
        self, split: str, seed_round: int, iteration: int, params: dict[str, Any], seed: int, run_id: str
    ) -> tuple[pa.Table, dict[str, float]]:
        self.calls.append(("rollout", split, params["max_new_tokens"], params["temperature"], seed, run_id))
        tags = self.groups["tags"]
        n = sum(self.groups["n_groups"])
        metrics = {f"{t}/success": 0.5 for t in tags} | {"success": 0.5}
        return pa.table({"env_tag": [t for t in tags for _ in range(n // len(tags))]}), metrics

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _no_instances() -> None:
    FakeWorker.instances.clear()


def two_budgets() -> list[Budget]:
    return [
        Budget(tags=["Bandit", "BanditTest"], protocol=ProtocolConfig(max_turn=1), max_new_tokens=100),
        Budget(tags=["SimpleSokoban"], protocol=ProtocolConfig(max_turn=5), max_new_tokens=100),
    ]


def test_a_model_folder_plans_the_default_tags_and_bad_tags_fail_before_any_work(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    request, policy, plan = plan_evaluation(EvaluateRequest(policy=str(folder)))
    assert request.tags == ["SimpleSokoban"] and policy.label == "model" and policy.train_tags is None
    assert [(b.tags, b.protocol.max_turn) for b in plan] == [(["SimpleSokoban"], 5)]
    with pytest.raises(EvaluateError, match="--tags is empty"):
        plan_evaluation(EvaluateRequest(policy=str(folder), tags=[]))
    with pytest.raises(EvaluateError, match="Sokobn"):
        plan_evaluation(EvaluateRequest(policy=str(folder), tags=["Sokobn"]))


def test_play_loads_the_policy_once_and_regroups_it_per_budget(caplog: pytest.LogCaptureFixture) -> None:
    request = EvaluateRequest(policy="m", n_per_tag=2, temperature=0.25, seed=7)
    policy = Policy("/models/m", None, None, "m")
    with caplog.at_level(logging.INFO, logger="test.evaluation"):
        table, metrics = play(
            request, policy, two_budgets(), logging.getLogger("test.evaluation"), FakeWorker
        )
    (worker,) = FakeWorker.instances
    assert worker.calls == [
        ("open", "/models/m", 1, ("Bandit", "BanditTest"), "hf"),
        ("rollout", "val", 100, 0.25, 7, "m"),
        ("set_groups", "val", 5, ("SimpleSokoban",)),
        ("rollout", "val", 100, 0.25, 7, "m"),
    ]
    assert worker.closed and table.num_rows == 6
    # success per tag only: no average over tags that mixes trained-on and held-out ones
    assert set(metrics) == {
        "val-env/Bandit/success",
        "val-env/BanditTest/success",
        "val-env/SimpleSokoban/success",
        "timing_s/testing",
    }
    assert "playing Bandit,BanditTest: 2 episodes each, 1 turn(s), 100 new tokens per turn" in caplog.text


def test_the_worker_is_closed_when_the_play_fails() -> None:
    class Failing(FakeWorker):
        def set_groups(self, split: str, protocol: dict[str, Any], groups: dict[str, Any]) -> None:
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        play(
            EvaluateRequest(policy="m"),
            Policy("m", None, None, "m"),
            two_budgets(),
            logging.getLogger(),
            Failing,
        )
    assert FakeWorker.instances[0].closed


def test_the_files_go_to_out_dir_or_a_new_folder_named_after_the_label(tmp_path: Path) -> None:
    from ragen_core.trajectory import read_table, to_table
    from tests.flows.test_cli import make

    table = to_table([make("Bandit", 0, True, 1.0, 1, 3, [0.0])])
    metrics = {"val-env/Bandit/success": 1.0}
    out, path = write_evaluation(
        EvaluateRequest(policy="p", out_dir=str(tmp_path / "o")), tmp_path, "x", table, metrics
    )
    assert out == tmp_path / "o" and path == out / "eval.parquet"
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert read_table(path).column("env_tag").to_pylist() == ["Bandit"]
    out, _ = write_evaluation(EvaluateRequest(policy="p"), tmp_path, "run/a@3", table, metrics)
    assert out.parent == tmp_path / "evals" and out.name.startswith("run_a@3-")


def test_mlflow_tags_name_the_held_out_tags_of_a_run_and_none_for_a_model() -> None:
    run = Policy(
        "p", None, None, "run@3", train_tags=["Bandit"], val_tags=["Bandit", "BanditTest"], model_id="m-1"
    )
    assert run_tags(run, ["Bandit", "BanditTest"]) == {
        "ragen.policy": "p",
        "ragen.tags": "Bandit,BanditTest",
        "ragen.evaluates": "run@3",
        "ragen.model_id": "m-1",
        "ragen.train_tags": "Bandit",
        "ragen.held_out_tags": "BanditTest",
    }
    assert set(run_tags(Policy("f", None, None, "f"), ["Bandit"])) == {
        "ragen.policy",
        "ragen.tags",
        "ragen.evaluates",
    }


def test_nothing_is_logged_without_log_to_mlflow(tmp_path: Path) -> None:
    request = EvaluateRequest(policy="p", tags=["Bandit"], log_to_mlflow=False)
    logged = log_evaluation(
        request, Policy("p", None, None, "p"), [], {}, tmp_path / "eval.parquet", tmp_path
    )
    assert logged == LoggedEvaluation(None, None, None) and not any(tmp_path.iterdir())


def test_a_run_is_evaluated_on_the_envs_it_validated_on_and_a_config_on_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ragen evaluate` once ignored ``val.env_overrides``: a FrozenLake run trained and validated without
    slips was evaluated on the slippery catalogue default, a directions run on the bare grid."""
    from ragen_core.config import dump_config, load_config
    from ragen_core.run.run_dir import RunDir

    root = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path))
    run = RunDir(tmp_path / "runs" / "fl-0123abcd-ef4567")
    cfg = load_config(root / "configs" / "frozenlake-tiny.yaml", ["val.seed=77"])
    dump_config(cfg, run.config_path)
    run.init_policy.mkdir()

    request, policy, plan = plan_evaluation(EvaluateRequest(policy=run.root.name, n_per_tag=2))
    (only,) = plan
    assert only.env_overrides == {"FrozenLake": {"is_slippery": False, "think_holes": True}}
    assert only.seed == 77
    # a held-out tag the run never set up plays its catalogue defaults
    _, _, plan = plan_evaluation(EvaluateRequest(policy=run.root.name, tags=["FrozenLake", "Bandit"]))
    assert [(b.tags, b.env_overrides) for b in plan] == [
        (["FrozenLake", "Bandit"], {"FrozenLake": {"is_slippery": False, "think_holes": True}})
    ]
    # --config plays that config's validation envs instead: RAGEN's grid for a directions policy
    _, _, plan = plan_evaluation(
        EvaluateRequest(policy=run.root.name, config=str(root / "configs" / "bandit-tiny.yaml"))
    )
    assert [(b.env_overrides, b.seed) for b in plan] == [({}, None)]

    # and the play makes the envs with them
    play(request, policy, [only], logging.getLogger("test.evaluation"), FakeWorker)
    (worker,) = FakeWorker.instances
    assert worker.groups["env_overrides"] == {"FrozenLake": {"is_slippery": False, "think_holes": True}}
    assert worker.groups["seed"] == 77 and worker.groups["n_groups"] == [2]
