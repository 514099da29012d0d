"""The state folder: where runs, the local MLflow store, Prefect's home, imported models and Ray's
token live (docs/architecture.md, "State folder"). ``$RAGEN_STATE_DIR``, default ``.state`` in the
working directory. Every module that needs it asks here, so the rule is written once; likewise for the
user cache folder, which outlives state folders and clones (the vLLM venv, the empty MLflow store)."""

from __future__ import annotations

import os
from pathlib import Path

STATE_ENV = "RAGEN_STATE_DIR"
DEFAULT_STATE_DIR = ".state"


def state_dir() -> Path:
    """The state folder, as the environment says now (not resolved: relative stays relative)."""
    return Path(os.environ.get(STATE_ENV, DEFAULT_STATE_DIR))


def models_dir(state: str | os.PathLike[str] | None = None) -> Path:
    """``<state>/models``, where ``ragen model import`` puts models: ``state`` or the state folder."""
    return Path(state if state is not None else state_dir()) / "models"


def cache_dir() -> Path:
    """ragen-flow's folder in the user cache: ``$XDG_CACHE_HOME/ragen-flow``, else
    ``~/.cache/ragen-flow`` (an empty ``XDG_CACHE_HOME`` counts as unset, as in the Makefile)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragen-flow"
