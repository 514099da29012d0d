"""Configs and sweep files that are valid YAML but hostile: refused at once, naming the file or key
and the fix, before any work."""

from __future__ import annotations

import time
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from ragen_core.config import ConfigError, RagenConfig, load_config
from ragen_core.config.numbers import MAX_ITERATIONS
from ragen_core.errors import describe
from ragen_core.safe_yaml import safe_load
from ragen_core.sweep.spec import SweepError, load_sweep

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bandit-tiny.yaml"


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


def _float_keys(model: type[BaseModel] = RagenConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config whose field holds a float (maybe optional)."""
    keys = []
    for name, field in model.model_fields.items():
        args = (field.annotation, *typing.get_args(field.annotation))
        if float in args:
            keys.append(prefix + name)
        for sub in args:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                keys += _float_keys(sub, f"{prefix}{name}.")
    return keys


FLOAT_KEYS = _float_keys()


def test_every_float_key_is_found() -> None:
    assert len(FLOAT_KEYS) > 20 and "learner.optim.actor_lr" in FLOAT_KEYS


@pytest.mark.parametrize("value", ["inf", "-inf", ".nan"])
def test_no_float_key_takes_a_non_finite_number(value: str) -> None:
    """Before: ``learner.optim.actor_lr=inf`` (and 24 other float keys of 44) passed, and the run failed at
    iteration 2 on NaN logits; -inf and NaN were refused only where a bound happened to exclude them
    (one key took each)."""
    passed = []
    for key in FLOAT_KEYS:
        try:
            load_config(CONFIG, [f"{key}={value}"])
        except ConfigError as exc:
            assert key in str(exc), str(exc)
        else:
            passed.append(key)
    assert not passed, f"{value} accepted for: {', '.join(passed)}"


def test_iterations_fit_the_folder_names() -> None:
    with pytest.raises(ConfigError, match=r"trainer.iterations: .*9999"):
        load_config(CONFIG, ["trainer.iterations=1000000000"])
    assert load_config(CONFIG, [f"trainer.iterations={MAX_ITERATIONS}"]).trainer.iterations == 9999


def test_errors_relayed_from_ray_lose_their_colours() -> None:
    """Before: the ray backend's error read ``\\x1b[36mray::LearnerActor...`` on the terminal."""

    class Remote(ValueError):
        user_error = True

    text = "\x1b[36mray::LearnerActor.update()\x1b[39m (pid=7): the model produced NaN logits"
    assert describe(Remote(text)) == "ray::LearnerActor.update() (pid=7): the model produced NaN logits"
    assert "\x1b" not in describe(RuntimeError(text))
