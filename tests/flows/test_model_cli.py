"""``ragen model import``: its output lines, and bad input as one clear line and exit code 1.

The conversion itself is replaced by a tiny model here (the real SmolLM2 import is
tests/ragen_core/models/test_model_import.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from flows.cli import app
from ragen_core.models import importing

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


runner = CliRunner()


def invoke(state, *args: str):
    return runner.invoke(
        app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", "RAGEN_STATE_DIR": str(state)}
    )


def tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """tests.ragen_core.models.test_model_import's small GGUF file, with a chat template."""
    from tests.ragen_core.models.test_model_import import tiny_gguf as make

    return make(path, arch, chat_template="{{ x }}")


def test_model_help_lists_import():
    result = runner.invoke(app, ["model", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "import" in result.output


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda tmp: str(tmp / "missing.gguf"), "does not exist"),
        (
            lambda tmp: str(tiny_gguf(tmp / "m.gguf", "madeupnet")),
            "architecture 'madeupnet' is not one transformers",
        ),
        (lambda tmp: "ragen_no_such_model_pkg", "run `make models`"),
    ],
)
def test_bad_source_is_one_line_and_exit_1(tmp_path, make, expected):
    result = invoke(tmp_path / "state", "model", "import", make(tmp_path))
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.output
    assert not (tmp_path / "state" / "models").exists() or not any((tmp_path / "state" / "models").iterdir())


def test_import_then_again_says_where_it_is(tmp_path, monkeypatch):
    from ragen_core.config.model import ModelConfig
    from ragen_core.models.policies import build_tiny_policy, torch_dtype

    tiny = build_tiny_policy(
        ModelConfig(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=300
        ),
        corpus=["State:\n#P_O", "0 1 2"],
    )

    def fake_load(gguf, dtype, template):  # what the conversion returns: the model in the asked dtype
        return copy.deepcopy(tiny[0]).to(torch_dtype(dtype)), tiny[1]

    monkeypatch.setattr(importing, "_load_converted", fake_load)
    src = tiny_gguf(tmp_path / "Tiny-Chat.Q4_K_M.gguf")
    folder = tmp_path / "state" / "models" / "tiny-chat"
    first = invoke(tmp_path / "state", "model", "import", str(src))
    assert first.exit_code == 0, first.output
    assert "converting" in first.output and f"into {folder}" in first.output
    assert f"use it with: --set model.path={folder}" in first.output
    again = invoke(tmp_path / "state", "model", "import", str(src))
    assert again.exit_code == 0, again.output
    assert f"already imported: {folder}" in again.output and "converting" not in again.output
    other = invoke(tmp_path / "state", "model", "import", str(src), "--name", "copy", "--dtype", "bfloat16")
    assert other.exit_code == 0, other.output
    assert '"dtype": "bfloat16"' in (tmp_path / "state" / "models" / "copy" / "ragen_source.json").read_text()
    bad = invoke(tmp_path / "state", "model", "import", str(src), "--name", "../escape")
    assert bad.exit_code == 1 and "--name '../escape'" in bad.output
