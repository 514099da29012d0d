"""Environment registry: built-in types, the tag catalogue, and third-party plug-ins.

A *type* is an :class:`~envs.base.Env` subclass (``sokoban``); a *tag* is a named configuration
of a type (``LargerSokoban``: 8x8, 2 boxes, budget 10). Plug-ins register types through the
entry-point group ``ragen.envs`` (name = type name, value = ``module:EnvClass``); a plug-in class
may carry ``default_spec`` (instruction, budget, max tokens) so that its type name works as a tag.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from envs.base import Env

ENTRY_POINT_GROUP = "ragen.envs"
CATALOGUE_PATH = Path(__file__).with_name("catalogue.yaml")

# Built-in types, imported lazily so that `import envs` stays cheap.
_BUILTIN_TYPES: dict[str, str] = {
    "bandit": "envs.bandit:BanditEnv",
    "sokoban": "envs.sokoban:SokobanEnv",
    "frozen_lake": "envs.frozen_lake:FrozenLakeEnv",
    "countdown": "envs.countdown:CountdownEnv",
    "metamathqa": "envs.mathqa:MathQAEnv",
    "webshop": "envs.webshop:WebShopEnv",
    # maintained libraries (the `envlibs` extra), imported when a tag of theirs is built
    "reasoning_gym": "envs.adapters.reasoning_gym:ReasoningGymEnv",
    "textarena": "envs.adapters.textarena:TextArenaEnv",
}


@dataclass(frozen=True)
class EnvSpec:
    """One catalogue entry."""

    tag: str
    env_type: str
    env_instruction: str = ""
    max_actions_per_traj: int = 10
    max_tokens: int = 100
    #: turns an episode gets where no config says otherwise (``ragen evaluate`` of a model folder);
    #: RAGEN's per-environment configs: one for the single-answer tasks, else agent_proxy's default 5
    max_turn: int = 5
    env_config: dict[str, Any] = field(default_factory=dict)
    #: part of the tiny tokenizer's default corpus (false keeps the corpus, hence the tokenizers of
    #: the existing tiny configs, as they were when a tag with long texts joined the catalogue)
    tokenizer_corpus: bool = True


class UnknownEnvError(KeyError):
    """A tag or type that no catalogue entry, built-in or plug-in provides."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


_types: dict[str, type[Env]] = {}
_tags: dict[str, EnvSpec] = {}
_loaded = False


def _load_class(path: str) -> type[Env]:
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"{path} is not an envs.base.Env subclass")
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    raw = yaml.safe_load(CATALOGUE_PATH.read_text()) or {}
    for tag, entry in raw.items():
        entry = dict(entry)
        entry["env_config"] = dict(entry.get("env_config") or {})
        _tags.setdefault(tag, EnvSpec(tag=tag, **entry))
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plug-in must not break the built-ins
            raise ImportError(
                f"ragen.envs plug-in {ep.name!r} ({ep.value}) failed to import: {exc}. "
                "Fix or uninstall that package."
            ) from exc
        register_type(ep.name, cls)
    _loaded = True


def register_type(env_type: str, cls: type[Env]) -> None:
    """Register an environment type; if the class has ``default_spec``, its name becomes a tag too."""
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"environment type {env_type!r}: {cls!r} is not an envs.base.Env subclass")
    _types[env_type] = cls
    default_spec = getattr(cls, "default_spec", None)
    if default_spec is not None and env_type not in _tags:
        _tags[env_type] = EnvSpec(tag=env_type, env_type=env_type, **default_spec)


def register_tag(spec: EnvSpec) -> None:
    """Add or replace a catalogue tag at run time."""
    _load()
    _tags[spec.tag] = spec


def env_class(env_type: str) -> type[Env]:
    _load()
    if env_type in _types:
        return _types[env_type]
    if env_type in _BUILTIN_TYPES:
        _types[env_type] = _load_class(_BUILTIN_TYPES[env_type])
        return _types[env_type]
    known = sorted(set(_types) | set(_BUILTIN_TYPES))
    raise UnknownEnvError(
        f"unknown environment type {env_type!r}; known types: {', '.join(known)}. "
        f"Third-party types register through the entry-point group {ENTRY_POINT_GROUP!r}."
    )


def tags() -> list[str]:
    """Every known tag: the catalogue's, plug-ins' and those registered at run time."""
    _load()
    return sorted(_tags)


def catalogue_tags() -> list[str]:
    """The tags of the shipped catalogue file only (stable: nothing registered at run time)."""
    return list(yaml.safe_load(CATALOGUE_PATH.read_text()) or {})


def default_corpus_tags() -> list[str]:
    """The shipped tags whose texts train the tiny tokenizer by default (``tokenizer_corpus``)."""
    raw = yaml.safe_load(CATALOGUE_PATH.read_text()) or {}
    return [tag for tag, entry in raw.items() if (entry or {}).get("tokenizer_corpus", True)]


def spec(tag: str, **overrides: Any) -> EnvSpec:
    """The catalogue entry for ``tag``; keyword overrides replace ``env_config`` keys."""
    _load()
    if tag not in _tags:
        import difflib

        close = difflib.get_close_matches(tag, list(_tags), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownEnvError(f"unknown environment tag {tag!r}.{hint} Known tags: {', '.join(tags())}.")
    s = _tags[tag]
    if overrides:
        s = replace(s, env_config={**s.env_config, **overrides})
    return s


def success_means(tag: str) -> str | None:
    """What a success is for ``tag``, in one sentence (its class's ``success_means``), or None for a
    tag this install does not know (a plug-in's trajectories read elsewhere)."""
    try:
        return env_class(spec(tag).env_type).success_means
    except UnknownEnvError:
        return None


def available(tag: str) -> bool:
    """Whether ``tag`` can be built here: its class's ``requires`` module (a library adapter's
    library) is installed. Found without importing it, so a missing extra costs nothing."""
    from importlib.util import find_spec

    needed = env_class(spec(tag).env_type).requires
    return needed is None or find_spec(needed) is not None


def make(tag: str, **overrides: Any) -> Env:
    """Build the environment of catalogue ``tag``; ``overrides`` replace its ``env_config`` keys."""
    s = spec(tag, **overrides)
    cls = env_class(s.env_type)
    try:
        env = cls(**s.env_config)
    except TypeError as exc:
        raise TypeError(
            f"environment tag {tag!r} ({s.env_type}): bad env_config {s.env_config}: {exc}"
        ) from exc
    env.tag = s.tag  # type: ignore[attr-defined]
    env.spec = s  # type: ignore[attr-defined]
    return env
