"""What a policy reference (``ragen evaluate POLICY``) names, decided without loading anything heavy.

A reference is a run (``RUN_ID``, ``RUN_ID@STEP`` or a run directory), a model folder, the name of a
Hugging Face model already in the local cache, or a registered model (``models:/<run id>@best``). Nothing is downloaded (``HF_HUB_OFFLINE``), so a name that
is none of these cannot work, and :func:`locate_policy` says so at once: only the standard library and
the state folder's run index are read here (no torch, Prefect or MLflow), so the CLI and the evaluate
flow reject an unknown reference in a fraction of a second, before a model or a server starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ragen_core.errors import RagenError
from ragen_core.state_folder import locate_run, models_dir, run_not_found, runs_dir, state_dir


class PolicyNotFoundError(RagenError, FileNotFoundError):
    """A policy reference that names no run, no model folder and no cached Hugging Face model."""


@dataclass(frozen=True)
class PolicyRef:
    """A located reference: a run (its directory and the ``@STEP`` text, ``""`` without one) or a model
    (a folder or a cached Hugging Face name)."""

    kind: Literal["run", "model", "registry"]
    source: str
    step: str = ""
    has_step: bool = False


def hf_hub_cache() -> Path:
    """Where ``huggingface_hub`` keeps downloaded models (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub")


def in_hf_cache(name: str) -> bool:
    """Whether ``org/name`` (or ``name``) has a snapshot in the local Hugging Face cache."""
    folder = hf_hub_cache() / ("models--" + name.replace("/", "--"))
    snapshots = folder / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _examples() -> str:
    """A few run ids and imported models to suggest (the newest first), or ``""``."""
    found: list[tuple[float, str]] = []
    for folder in (runs_dir(), models_dir()):
        if folder.is_dir():
            for d in folder.iterdir():
                if d.is_dir():
                    found.append((d.stat().st_mtime, str(d) if folder.name == "models" else d.name))
    names = [n for _, n in sorted(found, reverse=True)[:3]]
    return f" (here: {', '.join(names)})" if names else ""


def locate_policy(spec: str) -> PolicyRef:
    """What ``spec`` names; :class:`PolicyNotFoundError` (one line: what was looked for, what to pass
    instead) when it names nothing that could be evaluated.

    ``RUN@STEP`` must name a run (a model folder may contain ``@`` too: an existing path wins).
    """
    if spec.startswith("models:/"):  # the MLflow registry (a run's kept policies): looked up when resolved
        return PolicyRef("registry", spec)
    name, at, step = spec.partition("@")
    run = locate_run(name)
    if run is not None:
        return PolicyRef("run", str(run), step, bool(at))
    path = Path(spec).expanduser()
    if path.is_dir():
        return PolicyRef("model", spec)
    if path.exists():
        raise PolicyNotFoundError(
            f"{spec} is a file, not a model folder or a run; pass a run id (RUN_ID[@STEP]), a run "
            "directory, or a folder with a model's config.json and weights"
        )
    if at:  # RUN@STEP: a run was meant
        raise PolicyNotFoundError(run_not_found(name))
    if in_hf_cache(spec):
        return PolicyRef("model", spec)
    raise PolicyNotFoundError(
        f"no run or model {spec!r}: not a run id or run directory (run index "
        f"{state_dir() / 'runs.json'}, runs under {runs_dir()}), not a model folder, and not "
        f"in the Hugging Face cache {hf_hub_cache()} (nothing is downloaded); pass a run id or RUN_ID@STEP"
        f"{_examples()}, a run directory, or a model folder (`ragen model import` makes one)"
    )
