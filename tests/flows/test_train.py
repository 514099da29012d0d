"""The training flow end to end at tiny scale: crash and resume, stage reruns, task caching."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from flows.reporting import artifact_key
from ragen_core.run.run_dir import RunDir
from tests.prefect_server import prefect_api, shared_server_env
from tests.process_env import child_env
from tests.tiny_run import TINY_RUN

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
# One Prefect home for every run of this module: its database is created once (~10 s), not per run.
PREFECT_HOME = Path(tempfile.mkdtemp(prefix="ragen-prefect-home-"))
atexit.register(shutil.rmtree, PREFECT_HOME, ignore_errors=True)  # every test process imports this module
CONFIG = ROOT / "configs" / "bandit-tiny.yaml"
TINY = [
    "trainer.iterations=3",
    "trainer.eval_every=3",
    *TINY_RUN,
    "learner.optim.micro_batch_size=4",
    "trainer.backend=local",
]


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def ragen(
    args: list[str],
    state: Path,
    crash: str | None = None,
    timeout: float = 600,
    extra_env: dict[str, str] | None = None,
) -> Result:
    """Run the CLI in its own process group against this test process's Prefect server
    (``tests.prefect_server``); afterwards kill what it left behind (a SIGKILLed run cannot stop its
    Ray cluster), and read its output from files, not pipes."""
    env = child_env(
        **{
            "RAGEN_STATE_DIR": str(state),
            "PYTHONUNBUFFERED": "1",
            "PREFECT_HOME": str(PREFECT_HOME),
            **shared_server_env(),
            **(extra_env or {}),
        }
    )
    if crash:
        env["RAGEN_CRASH_AT"] = crash
    state.mkdir(parents=True, exist_ok=True)
    out_path, err_path = state / "cli.out", state / "cli.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return Result(code, out_path.read_text(), err_path.read_text())


def train(state: Path, crash: str | None = None, extra: tuple[str, ...] = ()) -> Result:
    sets = [x for o in [*TINY, *extra, f"trainer.run_root={state / 'runs'}"] for x in ("--set", o)]
    return ragen(["train", str(CONFIG), *sets], state, crash)


def only_run(state: Path) -> Path:
    runs = [p for p in (state / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def weights(run: Path, k: int) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = run / f"iter_{k:04d}" / "checkpoint"
    return {
        "policy": safetensors.torch.load_file(str(ckpt / "policy" / "model.safetensors")),
        "critic": safetensors.torch.load_file(str(ckpt / "critic.safetensors")),
    }


def assert_bitwise_equal(a: dict, b: dict) -> None:
    for part in a:
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)


def mlflow_steps(state: Path, run: Path) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    run_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    from ragen_core.tracking.keys import parse_steps
    from ragen_core.tracking.tracker import LOGGED_STEPS_TAG

    return sorted(parse_steps(client.get_run(run_id).data.tags[LOGGED_STEPS_TAG]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted tiny run."""
    state = tmp_path_factory.mktemp("reference")
    out = train(state)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return state, only_run(state)


def test_uninterrupted_run_is_complete_and_logged(reference: tuple[Path, Path]) -> None:
    state, run = reference
    assert all((run / f"iter_{k:04d}" / "DONE").exists() for k in (1, 2, 3))
    assert mlflow_steps(state, run) == [0, 1, 2, 3]
    metrics = json.loads((run / "iter_0003" / "metrics.json").read_text())
    for key in (
        "train/Bandit/success",
        "val-env/Bandit/success",
        "rollout/in_group_std",
        "actor/entropy",
        "actor/grad_norm",
        "critic/vf_loss",
        "actor/pg_clipfrac",
        "response_length/mean",
        "timing_s/gen",
        "perf/tokens_per_s",
    ):
        assert key in metrics, key
    # What the user saw: the warm start's progress, a line per iteration (through Prefect's logger),
    # then where to look next.
    err, out = (state / "cli.err").read_text(), (state / "cli.out").read_text()
    warm = [line for line in err.splitlines() if "| warm start: step " in line]
    assert len(warm) == 10 and warm[-1].endswith("ETA 0s"), err[-2000:]
    lines = [line for line in err.splitlines() if re.search(r"\biteration \d+/3 \|", line)]
    assert [re.search(r"iteration (\d+/3)", line).group(1) for line in lines] == ["1/3", "2/3", "3/3"], err[
        -2000:
    ]
    assert "val success" in lines[-1] and "ETA" in lines[0] and "ETA" not in lines[-1]
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert f"ragen evaluate {run_id}" in out and f"ragen train --resume {run_id}" in out
    assert f"ragen evaluate models:/{run_id}@best" in out and f"ragen show {run_id}" in out
    assert "#/experiments/" in out and "?workflowType=machine_learning" in out  # MLflow's model-training view


def flow_run_artifacts(run_id: str) -> dict[str, dict]:
    """The latest artifacts of the train flow run that trained ``run_id`` (named ``train/<run id>``), by key."""
    runs = prefect_api("/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"train/{run_id}"]}}})
    assert len(runs) == 1, runs
    arts = prefect_api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}}})
    return {a["key"]: a for a in arts}


def test_the_flow_run_links_its_mlflow_run_and_shows_progress(reference: tuple[Path, Path]) -> None:
    """Prefect's artifacts page: a link to the MLflow run and a progress bar that ends at 100 %, whose
    description is the last iteration line."""
    _state, run = reference
    info = json.loads((run / "run.json").read_text())
    arts = flow_run_artifacts(info["run_id"])
    key = info["run_id"].lower()
    link = arts[f"mlflow-{key}"]
    assert link["type"] == "markdown" and info["mlflow_run_id"] in link["data"]  # a link, rendered by Prefect
    progress = arts[f"progress-{key}"]
    assert progress["type"] == "progress" and progress["data"] == 100.0
    assert progress["description"].startswith("iteration 3/3 | train success")
    # the run's task runs are named after their iterations, not Prefect's random suffixes
    [flow_run] = prefect_api(
        "/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"train/{info['run_id']}"]}}}
    )
    tasks = prefect_api("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    names = {t["name"] for t in tasks}
    assert {f"{stage}-{k}" for stage in ("rollout", "filter", "learn") for k in (1, 2, 3)} <= names, names
    assert "evaluate-step-0" in names, names


def test_the_flow_run_is_tagged_and_ends_with_a_summary_artifact(reference: tuple[Path, Path]) -> None:
    """Prefect's flow runs page filters by tag (env, algorithm; a run's task runs carry them too), and
    the flow run's last artifact says what the run reached and where it is."""
    _state, run = reference
    info = json.loads((run / "run.json").read_text())
    [flow_run] = prefect_api(
        "/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"train/{info['run_id']}"]}}}
    )
    assert {"ragen", "env:Bandit", "adv_estimator:gae"} <= set(flow_run["tags"]), flow_run["tags"]
    assert not [t for t in flow_run["tags"] if t.startswith("sweep")]  # not a sweep member
    tagged = prefect_api(
        "/task_runs/filter",
        {"flow_runs": {"id": {"any_": [flow_run["id"]]}}, "task_runs": {"tags": {"all_": ["env:Bandit"]}}},
    )
    assert {"learn-3", "evaluate-step-3", f"{info['run_id']}/iteration-3"} <= {t["name"] for t in tagged}
    summary = flow_run_artifacts(info["run_id"])[artifact_key("summary", info["run_id"])]
    assert summary["type"] == "markdown"
    text = summary["data"]
    best = RunDir(run).best_step(3)
    for step in ("0", "3"):  # first and last validated steps
        assert f"step {step} (" in text, text
    evals = {s: json.loads((run / "eval" / f"step_{s:04d}.json").read_text()) for s in (0, 3)}
    row = next(line for line in text.splitlines() if line.startswith("| Bandit |"))
    assert (
        f"{evals[0]['val-env/Bandit/success']:.3f}" in row
        and f"{evals[3]['val-env/Bandit/success']:.3f}" in row
    )
    assert f"best step **{best}**" in text
    assert str(run) in text and info["mlflow_run_id"] in text and f"models:/{info['run_id']}@final" in text


def test_the_kept_policies_are_logged_models_registered_with_aliases(
    reference: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final and the best policy are LoggedModels of the run with their step's metrics, versions
    of the config's registered model (``bandit-tiny``) under the run's aliases ``<run id>-final`` and
    ``<run id>-best``; ``models:/<run id>@best`` resolves to the run's own folder, or, where the run is
    not, to downloaded files."""
    from mlflow.tracking import MlflowClient

    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.run.logged_models import model_id_of, resolve_model_uri, run_alias
    from ragen_core.run.run_dir import RunDir
    from ragen_core.tracking.tracker import Tracker

    state, root = reference
    run = RunDir(root)
    info = run.info()
    uri = f"sqlite:///{state.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    best_step = int(client.get_run(info["mlflow_run_id"]).data.tags["ragen.best_step"])
    assert info["registered_model"] == "bandit-tiny"  # the config's model: its runs are versions of it
    for alias, step in (("final", 3), ("best", best_step)):
        version = client.get_model_version_by_alias("bandit-tiny", run_alias(info["run_id"], alias))
        assert version.tags["ragen.run_id"] == info["run_id"] and version.tags["ragen.step"] == str(step)
        model = client.get_logged_model(model_id_of(version))
        assert model.source_run_id == info["mlflow_run_id"] and model.tags["ragen.step"] == str(step)
        linked = {m.key: m.value for m in model.metrics or []}
        assert linked["val-env/success"] == pytest.approx(
            run.read_json(run.eval_metrics_file(step))["val-env/success"]
        )
        files = {f.path for f in client.list_logged_model_artifacts(model.model_id)}
        assert {"config.json", "model.safetensors"} <= files, files

    # `ragen evaluate` of the registered best policy: an MLflow run nested under the training run,
    # its metrics linked to the LoggedModel too
    out = ragen(["evaluate", f"models:/{info['run_id']}@best", "--n", "4", "--max-new-tokens", "8"], state)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"nested under the training run {info['mlflow_run_id']}" in " ".join(out.stdout.split())
    best_version = client.get_model_version_by_alias("bandit-tiny", run_alias(info["run_id"], "best"))
    best = client.get_logged_model(model_id_of(best_version))
    (evaluation,) = [
        r
        for r in client.search_runs(
            [best.experiment_id], f"tags.mlflow.parentRunId = '{info['mlflow_run_id']}'"
        )
        if r.data.tags.get("ragen.model_id") == best.model_id
    ]
    assert evaluation.data.tags["ragen.evaluates"] == f"{info['run_id']}@best"
    assert evaluation.info.run_id in {m.run_id for m in best.metrics or []}

    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))
    here = resolve_model_uri(
        f"models:/{info['run_id']}@final", Tracker(TrackingConfig(tracking_uri=uri), state), tmp_path
    )
    assert here.folder == run.policy_after(3) and here.step == 3
    monkeypatch.setenv("RAGEN_STATE_DIR", str(tmp_path / "elsewhere"))  # a machine without the run
    there = resolve_model_uri(
        f"models:/{info['run_id']}@final",
        Tracker(TrackingConfig(tracking_uri=uri), state),
        tmp_path / "cache",
    )
    assert there.folder != here.folder
    for name in ("config.json", "model.safetensors"):
        assert (there.folder / name).read_bytes() == (here.folder / name).read_bytes()


def test_the_run_lists_its_environments_as_datasets_the_warm_start_curve_and_system_metrics(
    reference: tuple[Path, Path],
) -> None:
    from mlflow.tracking import MlflowClient

    state, run = reference
    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    inputs = client.get_run(info["mlflow_run_id"]).inputs.dataset_inputs
    by_context = {t.value: d.dataset for d in inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert set(by_context) == {"train", "validation"}
    assert (
        by_context["train"].name == "train: Bandit x4"
        and by_context["validation"].name == "validation: Bandit x16"
    )
    profile = json.loads(by_context["validation"].profile)
    assert (
        profile["seeds"] == {"base": 123, "per_iteration": 16, "fixed": True} and profile["group_size"] == 1
    )
    curve = json.loads((run / "init_policy" / "sft_metrics.json").read_text())["loss_curve"]
    history = client.get_metric_history(info["mlflow_run_id"], "sft/loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v)) for s, v in curve] and curve
    # MLflow's System metrics tab: sampled every 10 s while the run trained (about 30 s here)
    metrics = client.get_run(info["mlflow_run_id"]).data.metrics
    assert (
        "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics
    )


def test_the_run_page_says_what_ran_and_reached_and_shows_the_overview_first(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    state, run = reference
    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{state.resolve() / 'mlflow.db'}")
    tags = client.get_run(info["mlflow_run_id"]).data.tags
    note = tags["mlflow.note.content"]
    end = json.loads((run / "eval" / "step_0003.json").read_text())["val-env/Bandit/success"]
    assert note.startswith(f"**{info['run_id']}**: GAE (StarPO-S) on Bandit") and "3 of 3 iterations" in note
    assert re.search(rf"^\| (\*\*3\*\* \(best\)|3) \| {end:.3f} \|$", note, re.M), (
        note
    )  # the validation table
    assert f"models:/{info['run_id']}@best" in note
    # the flow run that trained it: a link in the description and a tag
    flow_run = tags["prefect.flow_run_id"]
    assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run}")
    assert f"Prefect flow run: [train/{info['run_id']}]({tags['prefect.flow_run_url']})" in note
    # the default logging level: the core metrics go to MLflow, the run folder keeps every metric
    logged = set(client.get_run(info["mlflow_run_id"]).data.metrics)
    assert {"val-env/Bandit/success", "train/success", "rollout/filter_kept_ratio", "actor/entropy"} <= logged
    assert "critic/vf_loss" not in logged and "critic/vf_loss" in json.loads(
        (run / "iter_0003" / "metrics.json").read_text()
    )
    top = {a.path for a in client.list_artifacts(info["mlflow_run_id"])}
    assert "overview.png" in top and "plots" in top, top
    # the filter's decisions beside the rollouts they judge, and a readable page per iteration
    listed = {a.path for a in client.list_artifacts(info["mlflow_run_id"], "rollouts/iter_0003")}
    assert listed == {"rollouts/iter_0003/rollouts.parquet", "rollouts/iter_0003/filter.json"}, listed
    page = Path(client.download_artifacts(info["mlflow_run_id"], "transcripts/iter_0003.html", str(tmp_path)))
    assert "kept by the filter" in page.read_text() and "dropped by the filter" in page.read_text()


def test_iterations_are_numbered_alike_on_disk_in_parquet_and_in_mlflow(reference: tuple[Path, Path]) -> None:
    """Iteration k's folder, its rollout rows and its MLflow step all say k; a validation file and its
    rows say how many iterations the policy trained (0: before training)."""
    import pyarrow.parquet as pq

    state, run = reference
    for k in (1, 2, 3):
        rows = pq.read_table(run / f"iter_{k:04d}" / "rollouts.parquet").column("iteration").to_pylist()
        assert set(rows) == {k}, (k, set(rows))
    evals = sorted((run / "eval").glob("step_*.parquet"))
    assert [f.name for f in evals] == ["step_0000.parquet", "step_0003.parquet"]
    for f in evals:
        assert set(pq.read_table(f).column("iteration").to_pylist()) == {int(f.stem[5:])}
    assert mlflow_steps(state, run) == [0, 1, 2, 3]


def test_iterations_as_subflows_train_the_same_weights(reference: tuple[Path, Path], tmp_path: Path) -> None:
    """bandit-tiny runs its iterations as nested task runs (the default); as subflows (the other
    choice) the same config trains the same weights and logs the same steps."""
    from ragen_core.config import load_config

    assert load_config(CONFIG).trainer.iteration_as == "task"
    out = train(tmp_path, extra=("trainer.iteration_as=subflow",))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(tmp_path)
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]
    assert_bitwise_equal(weights(run, 3), weights(reference[1], 3))


def test_keep_policies_prunes_old_weights_and_changes_nothing_else(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """trainer.keep_policies=2 on the reference config (3 iterations, validated at 3): iteration 1 loses
    its weights after iteration 3, everything else is as the reference has it, and evaluating or
    rerunning from the pruned step is one line naming why."""
    out = train(tmp_path, extra=("trainer.keep_policies=2",))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(tmp_path)
    pruned = run / "iter_0001" / "checkpoint"
    assert not (pruned / "policy").exists() and not (pruned / "optim.pt").exists()
    assert "trainer.keep_policies=2" in (pruned / "WEIGHTS_PRUNED").read_text()
    assert (run / "iter_0002" / "checkpoint" / "policy" / "model.safetensors").is_file()
    assert_bitwise_equal(weights(run, 3), weights(reference[1], 3))
    for k in (1, 2, 3):  # what each iteration played is untouched (the run id aside)
        name = f"iter_{k:04d}/rollouts.parquet"
        played, ref = (pq.read_table(r / name).drop_columns(["run_id"]) for r in (run, reference[1]))
        assert played.equals(ref), k

    evaluated = ragen(["evaluate", f"{run.name}@1", "--n", "4", "--max-new-tokens", "8"], tmp_path)
    said = evaluated.stdout + evaluated.stderr
    assert evaluated.returncode != 0 and "Traceback" not in said, said[-3000:]
    assert (
        "no checkpoint at step 1 (its weights were pruned after iteration 3 (trainer.keep_policies=2))"
        in said
    )
    assert "it has steps 0, 2-3" in said
    rerun = ragen(["rerun", str(run), "--iteration", "2", "--stage", "learn"], tmp_path)
    said = rerun.stdout + rerun.stderr
    assert rerun.returncode != 0 and "Traceback" not in said, said[-3000:]
    assert "WEIGHTS_PRUNED" in said and "trainer.keep_policies=2" in said


@pytest.mark.parametrize("point", ["rollout", "learn", "checkpoint"])
def test_killed_run_resumes_to_the_same_weights(
    point: str, reference: tuple[Path, Path], tmp_path: Path
) -> None:
    crashed = train(tmp_path, crash=f"{point}:2")
    assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL: nothing got to clean up
    run = only_run(tmp_path)
    assert (run / "iter_0001" / "DONE").exists() and not (run / "iter_0002" / "DONE").exists()
    mlflow_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    resumed = ragen(["train", "--resume", run.name], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((run / "run.json").read_text())["mlflow_run_id"] == mlflow_id  # the same MLflow run
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]  # nothing lost, nothing logged twice
    assert_bitwise_equal(weights(run, 3), weights(reference[1], 3))


def test_a_run_killed_again_while_resuming_resumes_to_the_same_weights(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """The double-resume kill: killed in iteration 2, killed again in iteration 3 of the resume."""
    assert train(tmp_path, crash="learn:2").returncode == -9
    run = only_run(tmp_path)
    again = ragen(["train", "--resume", run.name], tmp_path, crash="rollout:3")
    assert again.returncode == -9 and (run / "iter_0002" / "DONE").exists()
    resumed = ragen(["train", "--resume", run.name], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert mlflow_steps(tmp_path, run) == [0, 1, 2, 3]
    assert_bitwise_equal(weights(run, 3), weights(reference[1], 3))


@pytest.mark.parametrize("stage", ["learn", "rollout"])
def test_rerun_reproduces_the_stored_iteration(stage: str, reference: tuple[Path, Path]) -> None:
    state, run = reference
    out = ragen(["rerun", str(run), "--iteration", "3", "--stage", stage], state)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "identical" in out.stdout
    # in Prefect: a tagged flow run whose artifact holds the verdict
    runs = prefect_api(
        "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"run:{run.name}", f"stage:{stage}"]}}}
    )
    assert runs and all({"ragen", "rerun", "env:Bandit"} <= set(r["tags"]) for r in runs), runs
    key = artifact_key("rerun", run.name, "iter-3", stage)
    arts = prefect_api("/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
    assert arts, key
    verdict = arts[-1]["data"]
    assert f"Rerun of {stage}, iteration 3" in verdict and "**identical**" in verdict, verdict
    assert str(run) in verdict
    logs = prefect_api("/logs/filter", {"logs": {"flow_run_id": {"any_": [arts[-1]["flow_run_id"]]}}})
    assert any(f"{stage} of iteration 3:" in entry["message"] for entry in logs), logs


def test_a_rerun_of_the_learn_stage_scales_the_loss_as_the_run_did(tmp_path: Path) -> None:
    """rollout.filter.loss_scaling=linear: the learn stage scaled the advantages by the kept fraction
    of the groups (2 of 4 here); a rerun of that stage must take the same step, so it reruns identical
    (it once stepped unscaled and reported 'different')."""
    from ragen_core.run.rerun import rerun_stage
    from ragen_core.run.run_dir import RunDir

    out = train(
        tmp_path,
        extra=("trainer.iterations=2", "rollout.filter.value=0.5", "rollout.filter.loss_scaling=linear"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = RunDir(only_run(tmp_path))
    assert len(run.read_json(run.filter_file(2))["kept_rows"]) == 8  # 2 of 4 groups of 4: the scale is 0.5
    result = rerun_stage(run, 2, "learn", tmp_path / "rerun", backend="local")
    assert result.identical, result.detail


def test_an_echo_trap_rollback_leaves_every_stored_iteration_rerunnable(tmp_path: Path) -> None:
    """Any entropy change fires (patience 1, ratios 0.99999 / 1.00001 of iteration 1's entropy): after
    iteration 2 the run rolls back to iteration 1's state, and at 3 it stops (one rollback allowed).
    The rollback is a record of its own; no stored iteration is rewritten, so every stage of every
    stored iteration reruns identical, iteration 3's learn stage from iteration 1's state."""
    from ragen_core.run.rerun import rerun_stage
    from ragen_core.run.run_dir import RunDir

    monitor = (
        "monitor.action=rollback",
        "monitor.max_rollbacks=1",
        "monitor.patience=1",
        "monitor.entropy_init_window=1",
        "monitor.entropy_collapse_ratio=0.99999",
        "monitor.entropy_blowup_ratio=1.00001",
        "monitor.act_on=[entropy_collapse,entropy_blowup]",
        "trainer.iterations=4",
    )
    out = train(tmp_path, extra=monitor)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = RunDir(only_run(tmp_path))
    assert run.last_complete() == 3 and not run.iter_dir(4).exists()  # stopped at 3: rollbacks used up
    record = run.read_json(run.rollback_file(2))
    assert (record["after"], record["to"]) == (2, 1) and record["signals"]
    assert run.start_of(3) == 1 and run.start_of(2) == 1 and run.start_of(4) == 3
    assert json.loads((run.checkpoint(2) / "manifest.json").read_text())["iteration"] == 2
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            weights(run.root, 2)["policy"].values(), weights(run.root, 1)["policy"].values(), strict=True
        )
    )
    for k in (1, 2, 3):
        for stage in ("rollout", "learn"):
            result = rerun_stage(run, k, stage, tmp_path / "reruns" / f"{k}-{stage}", backend="local")
            assert result.identical, (k, stage, result.detail)
    cli = ragen(["rerun", str(run.root), "--iteration", "3", "--stage", "learn"], tmp_path)
    assert cli.returncode == 0 and "identical" in cli.stdout, cli.stdout[-3000:] + cli.stderr[-3000:]
    # Each signal was also a Prefect event about the run, related to its flow run (what automations match).
    events = prefect_api(
        "/events/filter",
        {
            "filter": {
                "event": {"prefix": ["ragen.echo-trap."]},
                "resource": {"id": [f"ragen.run.{run.root.name}"]},
            }
        },
    )["events"]
    assert events, "no ragen.echo-trap.* event reached Prefect"
    assert {e["payload"]["iteration"] for e in events} >= {2}
    for e in events:
        assert any(r["prefect.resource.id"].startswith("prefect.flow-run.") for r in e["related"]), e[
            "related"
        ]


def test_a_run_stored_before_the_renumbering_reruns_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """A run written by an older ragen-flow has v1 Parquet files (iteration column = k - 1): the
    rerun, which writes v2, compares every other column and finds them identical."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ragen_core.integrity import record
    from ragen_core.run.rerun import rerun_stage
    from ragen_core.run.run_dir import RunDir
    from ragen_core.trajectory import SCHEMA_VERSION_KEY

    copy = tmp_path / reference[1].name
    shutil.copytree(reference[1], copy)
    path = copy / "iter_0002" / "rollouts.parquet"
    table = pq.read_table(path)
    old = table.set_column(
        table.schema.get_field_index("iteration"), "iteration", pa.array([1] * table.num_rows, pa.int32())
    )
    pq.write_table(old.replace_schema_metadata({SCHEMA_VERSION_KEY: b"1"}), path, compression="zstd")
    record(path)  # as the older version recorded it
    result = rerun_stage(RunDir(copy), 2, "rollout", tmp_path / "rerun", backend="local")
    assert result.identical and "schema v1" in result.detail, result.detail
    changed = old.set_column(
        table.schema.get_field_index("score"), "score", pa.array([9.0] * table.num_rows, pa.float32())
    )
    pq.write_table(changed.replace_schema_metadata({SCHEMA_VERSION_KEY: b"1"}), path, compression="zstd")
    record(path)
    assert not rerun_stage(RunDir(copy), 2, "rollout", tmp_path / "rerun2", backend="local").identical


def test_rerun_detects_a_changed_artifact(reference: tuple[Path, Path], tmp_path: Path) -> None:
    state, run = reference
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    ckpt = copy / "iter_0003" / "checkpoint" / "policy" / "model.safetensors"
    tensors = safetensors.torch.load_file(str(ckpt))
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1e-3
    safetensors.torch.save_file(tensors, str(ckpt))
    # A different but intact checkpoint: re-record its digest (unrecorded, it is reported as corrupt).
    from ragen_core.integrity import sha256_file
    from ragen_core.learner.checkpoint import manifest_digest

    manifest = json.loads((ckpt.parents[1] / "manifest.json").read_text())
    manifest["files"]["policy/model.safetensors"] = sha256_file(ckpt)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (ckpt.parents[1] / "manifest.json").write_text(json.dumps(manifest))
    out = ragen(["rerun", str(copy), "--iteration", "3", "--stage", "learn"], state)
    assert out.returncode == 2 and "DIFFERENT" in out.stdout


def test_config_typo_fails_before_any_work(tmp_path: Path) -> None:
    out = ragen(["train", str(CONFIG), "--set", "learner.optim.mini_bach_size=4"], tmp_path)
    assert out.returncode == 1
    assert "did you mean learner.optim.mini_batch_size" in out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_unreachable_tracking_server_fails_fast(tmp_path: Path) -> None:
    import time

    t0 = time.perf_counter()
    sets = [x for o in [*TINY, f"trainer.run_root={tmp_path / 'runs'}"] for x in ("--set", o)]
    out = ragen(
        ["train", str(CONFIG), *sets],
        tmp_path,
        timeout=300,
        extra_env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"},
    )  # discard port: nothing listens
    elapsed = time.perf_counter() - t0
    assert out.returncode != 0
    assert "http://127.0.0.1:9" in out.stderr + out.stdout and "unreachable" in out.stderr + out.stdout
    assert elapsed < 120


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime: what work on a copy must leave unchanged."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_copied_state_folder_works_as_its_own_and_never_writes_the_original(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """`cp -a STATE COPY` of a trained run's state folder, whose run index is as ragen-flow wrote it before
    (absolute entries into the original): show, rerun, resume and evaluate on the copy use the copy's
    run and MLflow store; the rerun and the evaluation are MLflow runs nested under the training run,
    the evaluation named after the step it evaluated and logged at that step; nothing of the original
    changes."""
    from mlflow.tracking import MlflowClient

    from ragen_core.run.rerun import RERUN_ITERATION_TAG, RERUN_STAGE_TAG, RERUN_VERDICT_TAG

    state, run = reference
    copy = tmp_path / "copy"
    shutil.copytree(state, copy, symlinks=True)
    (copy / "runs.json").write_text(json.dumps({run.name: str(run.resolve())}))
    before = listing(state)
    here = copy / "runs" / run.name

    shown = ragen(["show", f"{run.name}/iter_0003"], copy)
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    rerun = ragen(["rerun", run.name, "--iteration", "3", "--stage", "learn"], copy)
    assert rerun.returncode == 0 and "identical" in rerun.stdout, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert (here / "reruns" / "iter_0003" / "checkpoint").is_dir()
    resumed = ragen(["train", "--resume", run.name, "--set", "trainer.iterations=4"], copy)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (here / "iter_0004" / "DONE").exists() and not (run / "iter_0004").exists()
    evaluated = ragen(["evaluate", f"{run.name}@4", "--n", "4", "--max-new-tokens", "8"], copy)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert listing(state) == before

    client = MlflowClient(tracking_uri=f"sqlite:///{copy.resolve() / 'mlflow.db'}")
    training = client.get_run(json.loads((here / "run.json").read_text())["mlflow_run_id"])
    assert training.info.artifact_uri.startswith((copy.resolve() / "mlartifacts").as_uri())
    assert mlflow_steps(copy, here) == [0, 1, 2, 3, 4]
    assert {a.path for a in client.list_artifacts(training.info.run_id, "rollouts")} >= {"rollouts/iter_0004"}
    assert (copy / "mlartifacts").is_dir() and training.data.tags["ragen.run_dir"] == f"runs/{run.name}"
    nested = client.search_runs(
        [training.info.experiment_id], f"tags.mlflow.parentRunId = '{training.info.run_id}'"
    )
    by_name = {r.info.run_name: r for r in nested}
    evaluation = by_name[f"eval-{run.name}@step4"]
    assert evaluation.data.tags["ragen.step"] == "4"
    steps = {m.step for m in client.get_metric_history(evaluation.info.run_id, "val-env/Bandit/success")}
    assert steps == {4}
    record = by_name["rerun-learn@iter3"].data.tags
    assert (record[RERUN_STAGE_TAG], record[RERUN_ITERATION_TAG], record[RERUN_VERDICT_TAG]) == (
        "learn",
        "3",
        "identical",
    )
    assert "nested under the training run" in rerun.stdout
