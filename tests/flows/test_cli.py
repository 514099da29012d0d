"""The ``ragen`` CLI: ``--help`` lists the commands; ``ragen show`` on real and hand-made trajectory files."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from flows.cli import app
from flows.cli.pipeline import success_per_tag
from ragen_core.tracking.rendering import summarize
from ragen_core.trajectory import Trajectory, read_trajectories, write_trajectories

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args: str):
    # a wide terminal so that rich does not wrap the lines the assertions look for
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def make(
    env_tag: str,
    env_id: int,
    success: bool,
    score: float,
    turns: int,
    response: int,
    penalties: list[float],
    end: str = "done",
) -> Trajectory:
    """A hand-made trajectory: ``response`` sampled tokens, one assistant message per turn."""
    n = response + 5
    messages = [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": f"Turn 1:\nState:\n[#] env {env_id}"},
    ]
    for k in range(turns):
        messages.append({"role": "assistant", "content": f"<think>thought {k}</think><answer>Up</answer>"})
        if k + 1 < turns:
            messages.append({"role": "user", "content": f"Reward:\n0\nTurn {k + 2}:"})
    penalty = sum(penalties)
    return Trajectory(
        run_id="r",
        iteration=0,
        split="train",
        env_tag=env_tag,
        group_id=env_id // 2,
        env_id=env_id,
        seed=100 + env_id,
        turn_count=turns,
        success=success,
        truncated=end != "done",
        reward=score - penalty,
        format_penalty=penalty,
        score=score,
        input_ids=list(range(n)),
        loss_mask=[0] * 5 + [1] * response,
        turn_index=[0] * n,
        rollout_logprobs=[0.0] * n,
        messages=messages,
        actions=[["Up"] for _ in range(turns)],
        turn_rewards=[(score - penalty) / turns] * turns,
        info={
            "end_reason": end,
            "turn_penalties": penalties,
            "first_trained_turn": 0,
            "response_truncated": False,
            "turns_cut_by_max_new_tokens": 0,
        },
    )


HANDMADE = [
    make("SimpleSokoban", 0, True, 9.9, 2, 10, [0.0, -0.1]),
    make("SimpleSokoban", 1, False, -0.5, 3, 20, [0.0, 0.0, 0.0], end="max_turn"),
    make("FrozenLake", 2, False, -0.1, 1, 7, [-0.1], end="budget"),
    make("FrozenLake", 3, True, 1.0, 1, 3, [0.0]),
]


@pytest.fixture(scope="module")
def handmade(tmp_path_factory) -> Path:
    return write_trajectories(HANDMADE, tmp_path_factory.mktemp("cli") / "hand.parquet")


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """Trajectories from run_rollouts with a tiny model: 2 groups x 2, 2 turns, few tokens."""
    from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
    from ragen_core.protocol import ProtocolConfig
    from ragen_core.rollout.engine import SamplingParams
    from ragen_core.rollout.hf_engine import HFEngine
    from ragen_core.rollout.runner import run_rollouts
    from tests.tiny_policy import smallest_policy

    model, tok = smallest_policy()
    groups = EnvGroups(
        EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[2], group_size=2), ProtocolConfig(max_turn=2)
    )
    trajs = run_rollouts(
        groups, HFEngine(model, tok), tok, SamplingParams(max_new_tokens=8), seed=0, run_id="cli"
    )
    return write_trajectories(trajs, tmp_path_factory.mktemp("cli") / "real.parquet")


def rows_shown(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"row (\d+): ", output)]


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "show" in result.output and "demo" in result.output


def test_console_script_help():
    exe = Path(sys.executable).with_name("ragen")
    if not exe.exists():
        pytest.skip("the ragen console script is not installed in this environment")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "show" in out.stdout and "demo" in out.stdout


def test_show_real_rollout_file(real):
    trajs = read_trajectories(real)
    result = invoke("show", str(real), "--limit", "10")
    assert result.exit_code == 0, result.output
    assert rows_shown(result.output) == list(range(len(trajs))) == [0, 1, 2, 3]
    out = result.output
    for role in ("<system>", "<user>", "<assistant>"):
        assert role in out
    assert "You're a helpful assistant." in out and "Turn 1:" in out
    # the model's raw text is shown verbatim (rich markup is not interpreted)
    assert trajs[0].messages[2]["content"].splitlines()[0] in out
    assert "turn 1: " in out and "end reason " + trajs[0].info["end_reason"] in out
    assert "SimpleSokoban" in out and "mean response tokens" in out
    mean_tokens = sum(sum(t.loss_mask) for t in trajs) / len(trajs)
    assert f"{mean_tokens:.1f}" in out


def test_row_failed_env_and_limit_filters(handmade):
    result = invoke("show", str(handmade), "--row", "2")
    assert result.exit_code == 0, result.output
    assert rows_shown(result.output) == [2]
    assert "FAILED" in result.output and "end reason budget" in result.output
    assert "format penalty -0.10" in result.output

    result = invoke("show", str(handmade), "--failed")
    assert rows_shown(result.output) == [1, 2]
    assert "SUCCESS" not in result.output

    result = invoke("show", str(handmade), "--env", "FrozenLake")
    assert rows_shown(result.output) == [2, 3]

    result = invoke("show", str(handmade), "--env", "FrozenLake", "--failed")
    assert rows_shown(result.output) == [2]

    result = invoke("show", str(handmade), "--limit", "1")
    assert rows_shown(result.output) == [0]
    assert "3 more matching trajectories" in result.output

    result = invoke("show", str(handmade), "--limit", "0")
    assert rows_shown(result.output) == [] and "4 of 4 trajectories" in result.output

    result = invoke("show", str(handmade), "--env", "Nope")
    assert result.exit_code == 1 and "Nope" in result.output and "FrozenLake, SimpleSokoban" in result.output

    result = invoke("show", str(handmade), "--row", "9")
    assert result.exit_code == 1 and "out of range" in result.output

    result = invoke("show", str(handmade), "--row", "0", "--failed")  # row 0 succeeded
    assert result.exit_code == 0 and "no trajectories match" in result.output


def test_summary_numbers(handmade):
    rows = {r["tag"]: r for r in summarize(HANDMADE)}
    sok, fl, every = rows["SimpleSokoban"], rows["FrozenLake"], rows["all"]
    assert sok["trajectories"] == 2 and sok["success_rate"] == 0.5
    assert sok["mean_score"] == pytest.approx(4.7) and sok["mean_turns"] == 2.5
    assert sok["mean_response_tokens"] == 15 and sok["format_penalty_rate"] == pytest.approx(1 / 5)
    assert fl["success_rate"] == 0.5 and fl["mean_score"] == pytest.approx(0.45)
    assert fl["mean_response_tokens"] == 5 and fl["format_penalty_rate"] == 0.5
    assert every["trajectories"] == 4 and every["format_penalty_rate"] == pytest.approx(2 / 7)
    assert every["mean_turns"] == pytest.approx(7 / 4)

    out = invoke("show", str(handmade), "--limit", "0").output
    sok_line = next(
        line for line in out.splitlines() if "SimpleSokoban" in line and "│" in line
    )  # the table row
    assert re.findall(r"[-+]?\d+\.?\d*%?", sok_line) == ["2", "50.0%", "+4.700", "2.50", "15.0", "20.0%"]
    fl_line = next(line for line in out.splitlines() if "FrozenLake" in line and "│" in line)  # the table row
    assert re.findall(r"[-+]?\d+\.?\d*%?", fl_line) == ["2", "50.0%", "+0.450", "1.00", "5.0", "50.0%"]


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated"])
def test_bad_file_exits_1_naming_the_file(handmade, tmp_path, kind):
    path = tmp_path / f"{kind}.parquet"
    if kind == "garbage":
        path.write_bytes(b"this is not parquet at all")
    elif kind == "truncated":
        data = handmade.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    result = invoke("show", str(path))
    assert result.exit_code == 1
    assert path.name in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# ------------------------------------------------------------------ CLI polish: help, show, per-tag success
def _commands(command, path: tuple[str, ...] = ()):
    """(path, click command) of the app and every command and sub-command under it."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_version_and_short_help():
    import importlib.metadata

    import typer

    result = invoke("--version")
    assert (
        result.exit_code == 0
        and result.output.strip() == f"ragen-flow {importlib.metadata.version('ragen-flow')}"
    )
    for path, _ in _commands(typer.main.get_command(app)):
        short, long = invoke(*path, "-h"), invoke(*path, "--help")
        assert short.exit_code == 0 and short.output.startswith("Usage: "), (path, short.output)
        assert short.output == long.output, path


def test_console_script_version():
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--version"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert re.fullmatch(r"ragen-flow \d+\.\d+\.\d+\S*\n", out.stdout), out.stdout


def test_every_option_has_help_and_lists_its_choices():
    """--backend, --stage and --engine once did not list their choices; some options had no help."""
    import typer

    choices_seen = {}
    for path, command in _commands(typer.main.get_command(app)):
        help_text = " ".join(invoke(*path, "--help").output.split())
        for param in command.params:
            assert (param.help or "").strip(), f"{' '.join(('ragen', *path))} {param.opts}: no help text"
            descriptor = getattr(param, "type_descriptor", None)  # typer's view of the annotation
            if descriptor is not None and descriptor.is_choice:
                shown = "|".join(str(c) for c in descriptor.choices)
                assert f"<{shown}>" in help_text, (path, param.opts, help_text)
                choices_seen[param.opts[0]] = shown
    assert {"--backend", "--stage", "--engine", "--dtype"} <= set(choices_seen), choices_seen


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory) -> tuple[Path, Path]:
    """A state folder with one run (as training leaves it) of two iterations: iteration 1 without a
    filter decision, iteration 2 with one (groups 0 kept, 1 dropped). Returns (state, run directory)."""
    from ragen_core.config import dump_config, load_config

    state = tmp_path_factory.mktemp("state")
    run = state / "runs" / "bandit-tiny-0123abcd-ef4567"
    run.mkdir(parents=True)
    dump_config(load_config(ROOT / "configs" / "bandit-tiny.yaml"), run / "config.yaml")
    for k in (1, 2):  # each iteration's rows carry its number, as training writes them
        rows = [dataclasses.replace(t, iteration=k) for t in HANDMADE]
        write_trajectories(rows, run / f"iter_{k:04d}" / "rollouts.parquet")
    # rows 0 and 1 are group 0, rows 2 and 3 group 1 (make(): group_id = env_id // 2)
    (run / "iter_0002" / "filter.json").write_text('{"kept_rows": [0, 1], "metrics": {}}')
    return state, run


def invoke_in(state: Path, *args: str):
    return runner.invoke(
        app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", "RAGEN_STATE_DIR": str(state)}
    )


def marks(output: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"row (\d+): .*? (KEPT|DROPPED) by the filter", output)}


@pytest.mark.parametrize(
    "target",
    ["{id}", "{dir}", "{id}/iter_0002", "{id}/iter_2", "{dir}/iter_0002", "{dir}/iter_0002/rollouts.parquet"],
)
def test_show_a_run_or_iteration_marks_the_filter_decisions(stored_run, target):
    """`ragen show RUN_ID` and `ragen show RUN/iter_0002` were once not understood; the filter's
    decisions were nowhere to be seen."""
    state, run = stored_run
    result = invoke_in(state, "show", target.format(id=run.name, dir=run), "--limit", "4")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    if not target.endswith(".parquet"):  # the file read is named when the argument did not name it
        assert f"trajectories: {run / 'iter_0002' / 'rollouts.parquet'}" in text
    assert marks(result.output) == {0: "KEPT", 1: "KEPT", 2: "DROPPED", 3: "DROPPED"}
    assert f"filter: kept 2 of 4 trajectories (whole groups; {run / 'iter_0002' / 'filter.json'})" in text
    assert text.count("filter: dropped") == 2  # on the result line of each dropped trajectory


def test_show_an_iteration_without_filter_and_the_summary_counts(stored_run):
    state, run = stored_run
    result = invoke_in(state, "show", f"{run.name}/iter_0001", "--limit", "4")
    assert result.exit_code == 0, result.output
    assert rows_shown(result.output) == [0, 1, 2, 3] and not marks(result.output)
    assert "kept by filter" not in result.output
    result = invoke_in(state, "show", run.name, "--limit", "0")
    counts = {
        cells[0]: cells[1:3]
        for line in result.output.splitlines()
        if (cells := [c.strip() for c in line.strip("│ ").split("│")])
        and cells[0] in ("SimpleSokoban", "FrozenLake", "all")
    }
    assert counts == {"SimpleSokoban": ["2", "2"], "FrozenLake": ["2", "0"], "all": ["4", "2"]}, result.output


def test_show_says_what_success_means(stored_run, tmp_path):
    """A Bandit answer with reward +0.00 once showed SUCCESS next to one with +0.10 FAILED, with no word
    on what success means."""
    state, run = stored_run
    out = invoke_in(state, "show", run.name, "--limit", "0").output
    assert "success on SimpleSokoban: every box is on a target within the action budget." in out
    assert "success on FrozenLake: " in out
    bandit = [make("Bandit", 0, True, 0.0, 1, 3, [0.0]), make("Bandit", 1, False, 0.1, 1, 3, [0.0])]
    path = write_trajectories(bandit, tmp_path / "bandit.parquet")
    out = invoke_in(state, "show", str(path)).output
    assert "success on Bandit: the pulled arm is the high-risk arm, whatever it happened to pay." in out
    assert "success on SimpleSokoban" not in out  # only the tags shown


@pytest.mark.parametrize(
    ("target", "needles"),
    [
        (
            "{id}/iter_0009",
            ("iter_0009", "no rollouts.parquet", "iterations with rollouts: iter_0001, iter_0002"),
        ),
        ("no-such-run", ("no-such-run", "no such trajectory file, iteration folder or run", "RUN/iter_K")),
        ("no-such-run/iter_0002", ("no-such-run/iter_0002", "pass a .parquet file, a run id")),
    ],
)
def test_show_of_nothing_says_what_to_pass(stored_run, target, needles):
    state, run = stored_run
    result = invoke_in(state, "show", target.format(id=run.name))
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in result.output
    for needle in needles:
        assert needle in text, (needle, text)


def test_configure_environment_turns_telemetry_off_without_overriding_the_user(tmp_path):
    """Prefect's telemetry notice was once printed although ragen-flow turns telemetry off."""
    from tests.process_env import child_env

    probe = (
        "import json, os, sys\n"
        "from flows.settings import configure_environment\n"
        "configure_environment(sys.argv[1])\n"
        "from prefect._internal.analytics.enabled import is_telemetry_enabled\n"
        "print(json.dumps({k: os.environ.get(k) for k in sys.argv[2:]} | {'prefect': is_telemetry_enabled()}))\n"
    )
    keys = [
        "DO_NOT_TRACK",
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "MLFLOW_DISABLE_TELEMETRY",
        "HF_HUB_DISABLE_TELEMETRY",
        "RAY_USAGE_STATS_ENABLED",
    ]
    import json

    def run(**env: str) -> dict:
        base = {k: v for k, v in child_env().items() if k not in keys}
        out = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "state"), *keys],
            env={**base, **env},
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        return json.loads(out.stdout.splitlines()[-1])

    got = run()
    assert got == {
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "prefect": False,
    }
    assert run(DO_NOT_TRACK="0", MLFLOW_DISABLE_TELEMETRY="false")["DO_NOT_TRACK"] == "0"


def test_train_prints_validation_success_per_tag_never_averaged():
    """Success is reported per tag; a training tag is never averaged with a held-out one."""
    step = {"val-env/success": 0.5, "val-env/Bandit/success": 0.75, "val-env/BanditTest/success": 0.25}
    assert success_per_tag(step, ["Bandit"], ["Bandit", "BanditTest"]) == {
        "Bandit": 0.75,
        "BanditTest (held out)": 0.25,
    }
