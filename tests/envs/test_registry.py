"""The tag catalogue, `envs.make`, and third-party plug-ins through the `ragen.envs` entry points."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import envs
from envs.registry import EnvSpec

CATALOGUE_TAGS = [
    "SimpleSokoban",
    "LargerSokoban",
    "SokobanNewVocab",
    "FrozenLake",
    "Bandit",
    "BanditTest",
    "Countdown",
    "MathQA",
]


def test_catalogue_has_the_papers_tags() -> None:
    assert set(CATALOGUE_TAGS) <= set(envs.tags())
    assert envs.spec("SimpleSokoban").max_actions_per_traj == 10
    assert envs.spec("Bandit").max_actions_per_traj == 1
    assert envs.spec("LargerSokoban").env_config["num_boxes"] == 2
    assert "Sokoban puzzle" in envs.spec("SokobanNewVocab").env_instruction


@pytest.mark.parametrize("tag", CATALOGUE_TAGS)
def test_make_every_tag(tag: str) -> None:
    env = envs.make(tag)
    assert env.tag == tag
    state = env.reset(seed=1)
    assert isinstance(state, str) and state
    assert env.render() == state


def test_overrides_replace_env_config() -> None:
    s = envs.spec("SimpleSokoban", num_boxes=2)
    assert s.env_config["num_boxes"] == 2
    assert envs.spec("SimpleSokoban").env_config["num_boxes"] == 1  # catalogue untouched


def test_unknown_tag_names_close_matches() -> None:
    with pytest.raises(envs.UnknownEnvError, match="Did you mean SimpleSokoban"):
        envs.make("SimpleSokobn")


def test_bad_env_config_names_the_tag() -> None:
    with pytest.raises(TypeError, match="FrozenLake"):
        envs.make("FrozenLake", no_such_setting=3)


def test_register_tag_at_run_time() -> None:
    envs.register_tag(EnvSpec(tag="TinySokoban", env_type="sokoban", env_config={"dim_room": [5, 5]}))
    assert envs.make("TinySokoban").reset(seed=3).count("\n") == 4


PLUGIN_MODULE = '''
from envs.base import Env, StepResult


class EchoEnv(Env):
    """Says back what it is told; succeeds on 'win'."""

    default_spec = {"env_instruction": "Say win.", "max_actions_per_traj": 2}

    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting
        self.state = ""

    def reset(self, seed: int) -> str:
        self.state = f"{self.greeting} {seed}"
        return self.state

    def step(self, action: str) -> StepResult:
        self.state = action
        ok = action == "win"
        return StepResult(action, 1.0 if ok else 0.0, ok,
                          {"success": ok, "action_is_valid": True, "action_is_effective": True})

    def render(self) -> str:
        return self.state
'''


def test_third_party_plugin_through_entry_points(tmp_path: Path) -> None:
    """A real package, installed with pip, registers a type through `ragen.envs`."""
    src = tmp_path / "src"
    (src / "ragen_echo").mkdir(parents=True)
    (src / "ragen_echo" / "__init__.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "ragen-echo"
            version = "0.0.1"
            [project.entry-points."ragen.envs"]
            echo = "ragen_echo:EchoEnv"
            [tool.setuptools]
            packages = ["ragen_echo"]
            """
        )
    )
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    code = textwrap.dedent(
        """
        import json, sys, envs
        env = envs.make("echo", greeting="hi")
        first = env.reset(seed=5)
        r = env.step("win")
        print(json.dumps({"first": first, "tags": envs.tags(), "done": r.done,
                          "budget": env.spec.max_actions_per_traj}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"first": "hi 5", "tags": got["tags"], "done": True, "budget": 2}
    assert "echo" in got["tags"] and "SimpleSokoban" in got["tags"]
