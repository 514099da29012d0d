"""What a training run sends to MLflow (``tracking.metrics``: the core set or all), the run's
description and its link, against a real local store (sqlite + artifact folder in tmp_path)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragen_core.config import ConfigError, RagenConfig, load_config
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.training import Training, run_description
from ragen_core.state_folder import remember_ui_ports
from ragen_core.tracking.keys import (
    CORE_METRICS,
    DESCRIPTION_TAG,
    FLOW_RUN_URL_TAG,
    MODEL_TRAINING_VIEW,
    tracked_metrics,
)
from ragen_core.tracking.plotting import _run_panels
from ragen_core.tracking.tracker import Tracker

ROOT = Path(__file__).resolve().parents[3]
#: The metric names of a Bandit iteration (bandit-tiny, trainer.backend=local, 2026-12-05): 80 besides the validation's.
BANDIT_ITERATION = [
    *(
        f"actor/{k}"
        for k in ("entropy", "entropy_loss", "grad_norm", "lr", "pg_clipfrac", "pg_loss", "ppo_kl")
    ),
    *("actor/pg_clipfrac_lower", "actor/skipped_steps", "critic/grad_norm", "critic/lr", "critic/vf_loss"),
    *(
        f"critic/{p}/{s}"
        for p in ("advantages", "returns", "rewards", "score", "values")
        for s in ("max", "mean", "min")
    ),
    *("critic/skipped_steps", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/vpred_mean"),
    *("perf/rollout_tokens_per_s", "perf/step_s", "perf/tokens_per_s", "perf/total_num_tokens"),
    *(f"response_length/{s}" for s in ("clip_ratio", "max", "mean", "min")),
    *(f"rollout/chosen_in_group_{s}" for s in ("max", "mean", "std", "std_max", "std_min")),
    *("rollout/chosen_filter_metric_mean", "rollout/filter_kept_count", "rollout/filter_kept_ratio"),
    *("rollout/filter_metric_mean", "rollout/filter_zero_count", "rollout/kept_trajectories"),
    *(f"rollout/in_group_{s}" for s in ("max", "mean", "std", "std_max", "std_min")),
    *(
        "rollout/old_log_prob",
        "rollout/old_vs_rollout_logprob_diff",
        "rollout/old_vs_rollout_logprob_max_diff",
    ),
    *("rollout/staleness", "score/mean"),
    *(f"timing_s/{s}" for s in ("adv", "checkpoint", "gen", "old_log_prob", "step", "testing", "update")),
    *("timing_s/update_actor", "timing_s/update_critic", "timing_s/values"),
    *(
        f"train/Bandit/{k}"
        for k in ("action_is_effective", "action_is_valid", "format_penalty", "num_actions")
    ),
    *(f"train/Bandit/{k}" for k in ("num_turns", "pass@8", "reward", "score", "success")),
    "train/success",
]
#: What a validation adds (``eval/step_SSSS.json``), for two tags, one of them held out.
VALIDATION = [
    *(
        f"val-env/{t}/{k}"
        for t in ("Bandit", "BanditTest")
        for k in ("success", "score", "pass@1", "num_turns")
    ),
    *("val-env/success", "val/response_length/mean", "val/score/mean"),
]
CORE_OF_BANDIT = {
    "val-env/success",
    "val-env/Bandit/success",
    "val-env/BanditTest/success",
    "train/success",
    "score/mean",
    "rollout/filter_kept_ratio",
    "rollout/in_group_std",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/grad_norm",
    "critic/grad_norm",
    "response_length/mean",
    "timing_s/step",
    "perf/total_num_tokens",
}


@pytest.fixture(autouse=True)
def _local_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local store for the module (creating the sqlite schema takes several seconds)."""
    return tmp_path_factory.mktemp("state")


def test_the_core_set_is_the_key_curves_and_all_is_everything() -> None:
    metrics = {k: 1.0 for k in [*BANDIT_ITERATION, *VALIDATION]}
    assert len(BANDIT_ITERATION) == 80 and len(metrics) == 91
    assert set(tracked_metrics(metrics, "core")) == CORE_OF_BANDIT
    assert tracked_metrics(metrics, "all") == metrics
    # a KL term is there when the algorithm has one; an Echo-Trap signal at the step it fired
    extra = {"actor/kl_loss": 0.1, "monitor/entropy_collapse": 1.0, "collapse/mi_estimate": 0.2}
    assert tracked_metrics({**metrics, **extra}, "core").keys() == CORE_OF_BANDIT | extra.keys()
    # the keys a run's own monitor reads (monitor.*_key) go with the core set
    assert "critic/vf_loss" in tracked_metrics(metrics, "core", ["critic/vf_loss"])
    assert len(CORE_METRICS) <= 20  # "about 15": the set stays short


def test_an_unknown_level_names_the_key_and_the_fix() -> None:
    assert load_config().tracking.metrics == "core"
    assert load_config(overrides=["tracking.metrics=all"]).tracking.metrics == "all"
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["tracking.metrics=everything"])
    assert "tracking.metrics" in str(e.value) and "--set tracking.metrics=all" in str(e.value)


def config(tmp_path: Path, *overrides: str) -> RagenConfig:
    return load_config(
        ROOT / "configs" / "bandit-tiny.yaml",
        overrides=[
            f"trainer.run_root={tmp_path / 'runs'}",
            "trainer.iterations=2",
            "val.tags=[Bandit,BanditTest]",
            "val.n_groups=[4,4]",
            "tracking.background=off",
            "tracking.system_metrics=false",
            "tracking.experiment=core-metrics",
            *overrides,
        ],
    )


def stored_run(cfg: RagenConfig, name: str) -> RunDir:
    """A run folder with two finished iterations (their full metrics.json) and validations at 0 and 2."""
    run = create_run(cfg, name)
    for k in (1, 2):
        run.iter_dir(k).mkdir(parents=True, exist_ok=True)
        run.metrics_file(k).write_text(json.dumps({key: 0.1 * k for key in BANDIT_ITERATION}))
        run.done_file(k).touch()
    run.eval_metrics_file(0).parent.mkdir(parents=True, exist_ok=True)
    for step, success in ((0, 0.25), (2, 0.75)):
        values = {key: 0.5 for key in VALIDATION} | {"val-env/Bandit/success": success}
        run.eval_metrics_file(step).write_text(json.dumps(values | {"val-env/BanditTest/success": 0.125}))
    return run


def train_and_log(cfg: RagenConfig, run: RunDir, state: Path) -> tuple[Tracker, str]:
    """Log the stored run as the training flow does: start the MLflow run (with its flow run's link),
    then log the finished steps (``Training.catch_up``)."""
    log = logging.getLogger("test-core-metrics")
    tracker = Tracker(cfg.tracking, state)
    with Training(run, cfg, tracker, log, log) as training:
        mlflow_run = training.start_tracking(
            None, {"prefect.flow_run_id": "0f1e"}, ("train/x", "http://127.0.0.1:4321/runs/flow-run/0f1e")
        )
        assert training.catch_up(evaluate=lambda step: {}) == 2
        training.status = "FINISHED"
    return tracker, mlflow_run


def test_a_run_sends_the_core_metrics_and_its_folder_keeps_all(tmp_path: Path, state_dir: Path) -> None:
    cfg = config(tmp_path)
    run = stored_run(cfg, "core-run")
    tracker, mlflow_run = train_and_log(cfg, run, state_dir)
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    logged = client.get_run(mlflow_run)
    iteration_keys = CORE_OF_BANDIT - {k for k in CORE_OF_BANDIT if k.startswith("val-env/")}
    assert set(logged.data.metrics) == CORE_OF_BANDIT, sorted(logged.data.metrics)
    assert {m.step for m in client.get_metric_history(mlflow_run, "val-env/Bandit/success")} == {0}
    for key in iteration_keys:
        assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run, key)] == [
            (1, pytest.approx(0.1)),
            (2, pytest.approx(0.2)),
        ], key
    assert set(json.loads(run.metrics_file(2).read_text())) == set(BANDIT_ITERATION)  # the folder: all
    # what reads these back from MLflow still finds its curves: the run's plots
    drawn = {p.name for p in _plots(tracker, mlflow_run, tmp_path)}
    assert {"in_group_std.png", "entropy.png", "grad_norm.png", "response_length.png"} <= drawn, drawn
    assert {"success.png", "overview.png"} <= drawn, drawn
    panels = {stem: ser for stem, _, ser in _run_panels(tracker.run_history(mlflow_run))}
    assert set(panels["success_val-env"]) == {"Bandit", "BanditTest"}
    assert set(panels["success_train"]) == {"all tags"}  # train/success: the tags' own are not sent

    # the run page's description: what ran, the Prefect flow run that ran it (also a tag)
    tags = logged.data.tags
    assert tags[FLOW_RUN_URL_TAG] == "http://127.0.0.1:4321/runs/flow-run/0f1e"
    assert "Prefect flow run: [train/x](http://127.0.0.1:4321/runs/flow-run/0f1e)" in tags[DESCRIPTION_TAG]

    # the printed link opens MLflow's model-training view of the run
    url = tracker.run_url(mlflow_run)
    assert url is not None and url.endswith(f"/runs/{mlflow_run}?{MODEL_TRAINING_VIEW}")
    assert MODEL_TRAINING_VIEW == "workflowType=machine_learning"
    # on the port `ragen ui` last served this state folder on (`ragen ui --mlflow-port 5123`)
    remember_ui_ports({"mlflow": 5123, "prefect": 4321}, tracker.state_dir)
    assert (tracker.run_url(mlflow_run) or "").startswith("http://127.0.0.1:5123/#/experiments/")


def _plots(tracker: Tracker, mlflow_run: str, out: Path) -> list[Path]:
    tracker.run_id = mlflow_run  # the plots are drawn for the tracker's own run
    try:
        return tracker.log_plots(out / "plots")
    finally:
        tracker.run_id = None


def test_all_sends_every_metric(tmp_path: Path, state_dir: Path) -> None:
    cfg = config(tmp_path, "tracking.metrics=all")
    run = stored_run(cfg, "all-run")
    tracker, mlflow_run = train_and_log(cfg, run, state_dir)
    logged = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(mlflow_run).data.metrics
    assert set(logged) == {k.replace("@", "_at_") for k in [*BANDIT_ITERATION, *VALIDATION]}


def test_the_description_holds_the_validation_table(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    run = stored_run(cfg, "described")
    text = run_description(cfg, run, "described", 2, 2, ("train/described", "http://ui/runs/flow-run/1"))
    lines = text.splitlines()
    assert lines[0].startswith("**described**: GAE") and "2 of 2 iterations" in lines[0]
    assert "Prefect flow run: [train/described](http://ui/runs/flow-run/1)" in lines
    table = lines[lines.index("| step | Bandit | BanditTest (held out) |") :]
    assert table[1:4] == ["|---:|---:|---:|", "| 0 | 0.250 | 0.125 |", "| **2** (best) | 0.750 | 0.125 |"]
    assert any(
        line.startswith("Best step: 2 (registered as `models:/described@best`: a version of")
        for line in lines
    )
    # before any validation (a run that starts): no table, the link still there
    bare = create_run(cfg, "bare")
    assert "step |" not in run_description(cfg, bare, "bare", 0, None, ("f", "http://u"))
