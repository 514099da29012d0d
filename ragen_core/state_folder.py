"""The state folder: where runs, the local MLflow store, Prefect's home, imported models and Ray's
token live (docs/architecture.md, "State folder"). ``$RAGEN_STATE_DIR``, default ``.state`` in the
working directory. Every module that needs it asks here, so the rule is written once; likewise for the
user cache folder, which outlives state folders and clones (the vLLM venv, the empty MLflow store)."""

from __future__ import annotations

import os
import re
from pathlib import Path

STATE_ENV = "RAGEN_STATE_DIR"
DEFAULT_STATE_DIR = ".state"


def state_dir() -> Path:
    """The state folder, as the environment says now (not resolved: relative stays relative)."""
    return Path(os.environ.get(STATE_ENV, DEFAULT_STATE_DIR))


#: What a state folder's path may not hold: the local MLflow and Prefect databases are opened by
#: ``sqlite:///<state>/...`` URLs, whose parser (SQLAlchemy's) takes ``?`` as the start of the query
#: (both databases then landed in one file beside the folder) and ``%XX`` as an escape. (``#``, and a
#: ``%`` not followed by two hex digits, reach the file name as they are: runs work there.)
_URL_BREAKING = re.compile(r"\?|%[0-9A-Fa-f]{2}")


def check_state_dir(state: str | os.PathLike[str]) -> None:
    """Refuse (``ValueError``, one line naming the folder and the fix) a state folder whose path the
    databases' URLs cannot carry."""
    path = str(Path(state).resolve())
    bad = sorted(set(_URL_BREAKING.findall(path)))
    if bad:
        raise ValueError(
            f"state folder {path} ({STATE_ENV}) holds {' '.join(repr(c) for c in bad)}, which the "
            f"databases' URLs (sqlite:///...) cannot carry; set {STATE_ENV} to a folder without '?' "
            "or '%' followed by two hex digits"
        )


def models_dir(state: str | os.PathLike[str] | None = None) -> Path:
    """``<state>/models``, where ``ragen model import`` puts models: ``state`` or the state folder."""
    return Path(state if state is not None else state_dir()) / "models"


def runs_dir(run_root: str | os.PathLike[str] | None = None) -> Path:
    """Where runs go: ``run_root`` (``trainer.run_root``) or ``<state>/runs``."""
    return Path(run_root or state_dir() / "runs")


def cache_dir() -> Path:
    """ragen-flow's folder in the user cache: ``$XDG_CACHE_HOME/ragen-flow``, else
    ``~/.cache/ragen-flow`` (an empty ``XDG_CACHE_HOME`` counts as unset, as in the Makefile)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragen-flow"


def run_index_path() -> Path:
    """``<state>/runs.json``: run id -> run directory, for every run created with this state folder.
    A run inside the state folder is recorded relative to it (:func:`index_entry`), so that a copied or
    moved folder finds its own runs."""
    return state_dir() / "runs.json"


def index_entry(root: str | os.PathLike[str]) -> str:
    """How the run index (and the MLflow run's tags) record the run directory ``root``: relative to the
    state folder when it is inside it (``runs/<id>``), else absolute."""
    root, state = Path(root).resolve(), state_dir().resolve()
    return root.relative_to(state).as_posix() if root.is_relative_to(state) else str(root)


def _copied_here(recorded: Path, state: Path) -> tuple[Path, Path] | None:
    """(the run directory here, the folder ``recorded`` lies in) when ``state`` holds a run at the place
    where ``recorded`` is under some other folder: the state folder was copied or moved from there."""
    parts = recorded.parts
    for n in range(1, len(parts) - 1):
        here = state.joinpath(*parts[-n:])
        if (here / "config.yaml").is_file():
            return here, Path(*parts[:-n])
    return None


def indexed_run(entry: str) -> Path:
    """The run directory of a run index entry: a relative one is under the state folder; an absolute one
    (an index written before entries were relative, or a run outside the state folder) is used as it
    is, unless it lies outside the state folder and the state folder holds a run at the same place: the
    folder was copied or moved, and a copy must never read or write the original's runs."""
    path, state = Path(entry), state_dir()
    if not path.is_absolute():
        return state / path
    if path.is_relative_to(state.resolve()):
        return path
    copied = _copied_here(path, state)
    return copied[0] if copied else path


def copied_from() -> tuple[Path, list[str]] | None:
    """The folder the run index's absolute entries point into when this state folder holds their runs
    too (it was copied or moved from there), with those run ids; None when no entry does so."""
    state, found, origin = state_dir(), [], None
    for run_id, entry in sorted(read_run_index().items()):
        path = Path(entry)
        if path.is_absolute() and not path.is_relative_to(state.resolve()):
            copied = _copied_here(path, state)
            if copied:
                found.append(run_id)
                origin = origin or copied[1]
    return (origin, found) if origin is not None else None


def read_run_index() -> dict[str, str]:
    """The run index (run id -> directory), ``{}`` when there is none; one line naming the file and
    the fix (a :class:`~ragen_core.errors.RagenError`) when it is not a JSON object."""
    import json

    from ragen_core.errors import RagenError

    index = run_index_path()
    try:
        data = json.loads(index.read_text())
    except FileNotFoundError:
        return {}
    except (UnicodeDecodeError, ValueError) as exc:
        data = exc
    if not isinstance(data, dict):
        raise RagenError(
            f"the run index {index} is not a JSON object ({data}); repair it or move it aside "
            f"(mv {index} {index}.broken): runs are still found by their directory"
        )
    return data


def locate_run(run_id_or_path: str, run_root: str | os.PathLike[str] | None = None) -> Path | None:
    """The directory of a run given by directory, by id (the run index) or by id under ``run_root``
    (default ``<state>/runs``); None when there is none. Here, not in ``run_dir``, because the CLI asks
    it before anything heavy loads (``run_dir`` brings the config module, hence torch): an unknown run
    fails in a fraction of a second."""
    candidates = [Path(run_id_or_path)]
    if not (candidates[0] / "config.yaml").is_file():  # a run directory needs no index
        known = read_run_index().get(run_id_or_path)
        if known:
            candidates.append(indexed_run(known))
    candidates.append(runs_dir(run_root) / run_id_or_path)
    return next((c for c in candidates if (c / "config.yaml").is_file()), None)


def run_not_found(run_id_or_path: str, run_root: str | os.PathLike[str] | None = None) -> str:
    """Why :func:`locate_run` found nothing, and the fix (one line)."""
    default_root = runs_dir(run_root)
    return (
        f"no run {run_id_or_path!r}: not a run directory, not in the run index {run_index_path()}, and not "
        f"under {default_root}; pass the run directory"
    )


# The web UIs of a state folder --------------------------------------------------------------------
#: The ports ``ragen ui`` serves a state folder's MLflow UI and Prefect UI on unless told otherwise.
DEFAULT_UI_PORTS = {"mlflow": 5000, "prefect": 4200}


def ui_ports_path(state: str | os.PathLike[str] | None = None) -> Path:
    """``<state>/ui.json``: the ports ``ragen ui`` last served this state folder on."""
    return Path(state if state is not None else state_dir()) / "ui.json"


def ui_ports(state: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """The ports this state folder's UIs are served on: those ``ragen ui`` last used here (it remembers
    them, so that a link a run writes, into MLflow, Prefect or the terminal, opens where the UI is), else
    :data:`DEFAULT_UI_PORTS`. A missing or unreadable file gives the defaults: a link is a courtesy, and
    the next ``ragen ui`` writes the file again."""
    import json

    ports = dict(DEFAULT_UI_PORTS)
    try:
        data = json.loads(ui_ports_path(state).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return ports
    if isinstance(data, dict):
        ports.update({k: v for k, v in data.items() if k in ports and type(v) is int and 0 < v < 65536})
    return ports


def remember_ui_ports(ports: dict[str, int], state: str | os.PathLike[str] | None = None) -> None:
    """Record the ports ``ragen ui`` serves on (written whole, then renamed: never half a file)."""
    import json

    path = ui_ports_path(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: ports[k] for k in DEFAULT_UI_PORTS}) + "\n")
    tmp.replace(path)


def mlflow_ui_url(state: str | os.PathLike[str] | None = None) -> str:
    """The MLflow UI of this state folder's local store, as ``ragen ui`` serves it."""
    return f"http://127.0.0.1:{ui_ports(state)['mlflow']}"


def prefect_ui_url(state: str | os.PathLike[str] | None = None) -> str:
    """The Prefect UI of this state folder's Prefect database, as ``ragen ui`` serves it."""
    return f"http://127.0.0.1:{ui_ports(state)['prefect']}"
