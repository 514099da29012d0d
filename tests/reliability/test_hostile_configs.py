"""Configs and sweep files that are valid YAML but hostile: refused at once, naming the file or key
and the fix, before any work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ragen_core.config import ConfigError, load_config
from ragen_core.safe_yaml import safe_load
from ragen_core.sweep.spec import SweepError, load_sweep


def alias_bomb(levels: int, tail: str) -> str:
    """A "billion laughs": each level a list of nine aliases of the level below (9**levels values)."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join([*lines, tail.replace("LAST", f"*l{levels - 1}")]) + "\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("levels", [9, 10])
def test_a_yaml_alias_bomb_config_is_refused_at_once(levels: int, tmp_path: Path) -> None:
    """Before: 9 levels (~500 bytes) were refused after 36 s, 10 levels did not answer in 100 s."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels, "trainer: {iterations: 2, run_name: LAST}"))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    took = time.perf_counter() - t0
    assert took < 1.0, took
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "write the values out" in message, message


@pytest.mark.timeout(60)
def test_a_yaml_alias_bomb_sweep_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(alias_bomb(10, "base: configs/bandit-tiny.yaml\ngrid: {trainer.run_name: LAST}"))
    t0 = time.perf_counter()
    with pytest.raises(SweepError, match="aliases"):
        load_sweep(path)
    assert time.perf_counter() - t0 < 1.0


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(ValueError, match="holds it"):
        safe_load("a: &a [1, *a]\n")


def test_ordinary_aliases_still_load() -> None:
    """Aliases within the bound load as PyYAML loads them (shared values, merge keys)."""
    text = "base: &b {lr: 0.1, tags: [A, B]}\none: *b\ntwo: {<<: *b, lr: 0.2}\n"
    assert safe_load(text) == {
        "base": {"lr": 0.1, "tags": ["A", "B"]},
        "one": {"lr": 0.1, "tags": ["A", "B"]},
        "two": {"lr": 0.2, "tags": ["A", "B"]},
    }
    assert safe_load("") is None
