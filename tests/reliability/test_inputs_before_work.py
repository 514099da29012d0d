"""The state folder's files, the tracking URI and a model's weight files are checked before any work:
a damaged one is named in one line with the fix, fast, and no run folder is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ragen_core.config.tracking import uri_scheme_problem
from ragen_core.models.weights_check import safetensors_problem
from tests.reliability.cli import CONFIG, TINY, clear_error, run_cli

#: Every case needs no work, so it answers within this after the CLI has started (conftest.py).
FAST_S = 10.0


def _no_run_folder(state: Path) -> None:
    runs = state / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def test_random_bytes_as_mlflow_db(tmp_path: Path, cli_start_seconds: float) -> None:
    db = tmp_path / "mlflow.db"
    db.write_bytes(os.urandom(4096))
    out = run_cli(["train", str(CONFIG), *TINY], tmp_path)
    clear_error(out, str(db), "not an SQLite database", "move it aside")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    _no_run_folder(tmp_path)


def test_broken_run_index(tmp_path: Path, cli_start_seconds: float) -> None:
    index = tmp_path / "runs.json"
    index.write_text('{"a-run": ')
    out = run_cli(["train", str(CONFIG), *TINY], tmp_path)
    clear_error(out, str(index), "move it aside")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    _no_run_folder(tmp_path)  # before: a run folder the index does not list


def test_unknown_tracking_scheme(tmp_path: Path, cli_start_seconds: float) -> None:
    out = run_cli(["train", str(CONFIG), *TINY, "--set", "tracking.tracking_uri=foo://bar"], tmp_path)
    clear_error(out, "tracking.tracking_uri", "'foo'", "sqlite://")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    _no_run_folder(tmp_path)


def test_unknown_scheme_in_the_environment(tmp_path: Path) -> None:
    out = run_cli(["train", str(CONFIG), *TINY], tmp_path, MLFLOW_TRACKING_URI="foo://bar")
    clear_error(out, "foo://bar", "MLFLOW_TRACKING_URI")
    _no_run_folder(tmp_path)


def test_unreachable_tracking_server_named_before_work(tmp_path: Path, cli_start_seconds: float) -> None:
    out = run_cli(
        ["train", str(CONFIG), *TINY, "--set", "tracking.tracking_uri=http://127.0.0.1:9"], tmp_path
    )
    clear_error(out, "http://127.0.0.1:9", "unreachable")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    _no_run_folder(tmp_path)


def _hostile_model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    weights.write_bytes((2**62).to_bytes(8, "little") + b"{}" * 16)
    return weights


@pytest.mark.parametrize("how", ["evaluate", "model.path"])
def test_hostile_safetensors_header(tmp_path: Path, how: str, cli_start_seconds: float) -> None:
    weights = _hostile_model(tmp_path / "model")
    if how == "evaluate":
        args = ["evaluate", str(weights.parent), "--n", "1"]
    else:
        args = ["train", str(CONFIG), *TINY, "--set", f"model.path={weights.parent}"]
    out = run_cli(args, tmp_path)
    clear_error(out, str(weights), "not a valid safetensors file", "header length")
    assert out.seconds < cli_start_seconds + FAST_S, out.seconds
    _no_run_folder(tmp_path)
    assert not (tmp_path / "eval").exists()


def test_safetensors_header_checks(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.zeros(4)}, str(good))
    assert safetensors_problem(good) is None
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-8])  # the tensor data cut short
    assert "tensors end at byte 16" in (safetensors_problem(cut) or "")
    not_json = tmp_path / "junk.safetensors"
    not_json.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{[")
    assert "not JSON" in (safetensors_problem(not_json) or "")
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01")
    assert "shorter than" in (safetensors_problem(short) or "")


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("sqlite:///x.db", True),
        ("http://h:5000", True),
        ("postgresql+psycopg2://u@h/db", True),
        ("/abs/folder", True),
        ("file:///abs/folder", True),
        ("foo://bar", False),
        ("s3://bucket", False),
    ],
)
def test_tracking_uri_schemes(uri: str, ok: bool) -> None:
    assert (uri_scheme_problem(uri) is None) is ok
