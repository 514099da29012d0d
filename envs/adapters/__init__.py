"""Environments taken from maintained libraries instead of written by hand.

Each adapter is an :class:`envs.base.Env` subclass registered as a built-in type; it imports its
library only when an environment is built (``envs.make``), so ``import envs`` and every other tag work
without it. The libraries come with the ``envlibs`` extra: ``pip install 'ragen-flow[envlibs]'``.

* :mod:`envs.adapters.reasoning_gym`: ``reasoning-gym``'s procedural datasets as single-answer tasks,
  scored by the dataset's own ``score_answer``.
* :mod:`envs.adapters.textarena`: ``textarena``'s single-player games as multi-turn environments,
  rewarded with the game's own final reward.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "envlibs"


class MissingLibraryError(ImportError):
    """A library environment's package is not installed."""


def import_library(module: str, package: str, env_type: str) -> ModuleType:
    """``importlib.import_module(module)``, or an error that names the package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingLibraryError(
            f"environment type {env_type!r} needs the {package} package ({exc}). Install it with "
            f"`pip install 'ragen-flow[{EXTRA}]'` (or the pinned {package} of pyproject.toml's "
            f"{EXTRA} extra)."
        ) from exc
