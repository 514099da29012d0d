"""Where an imported model came from: the ``ragen_source.json`` record of a folder that
``ragen model import`` made, and the MLflow tags a run gets from it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

#: The provenance record written into every imported folder.
SOURCE_FILE = "ragen_source.json"


def read_provenance(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The folder's ``ragen_source.json`` (None when it has none)."""
    p = Path(folder) / SOURCE_FILE
    if not p.is_file():
        return None
    # A hand-edited record may hold another JSON value; model_provenance checks for a dict.
    return cast("dict[str, Any] | None", json.loads(p.read_text(encoding="utf-8")))


def model_provenance(path: str | os.PathLike[str] | None) -> dict[str, str]:
    """MLflow tags describing where an imported model came from; ``{}`` for any other model.

    Tags: ``ragen.model.source`` (the GGUF file name), ``ragen.model.source_sha256``,
    ``ragen.model.package``, ``ragen.model.package_version``, ``ragen.model.dtype``,
    ``ragen.model.architecture``, ``ragen.model.imported_with`` (transformers version). A record
    that cannot be read gives one ``ragen.model.provenance_error`` tag instead of failing the run.
    """
    if path is None:
        return {}
    try:
        record = read_provenance(path)
    except (OSError, ValueError) as exc:
        return {
            "ragen.model.provenance_error": f"{Path(path) / SOURCE_FILE}: {type(exc).__name__}: {exc}"[:500]
        }
    if not isinstance(record, dict):
        return {}
    keys = {
        "ragen.model.source": Path(str(record.get("gguf_file") or "")).name or None,
        "ragen.model.source_sha256": record.get("gguf_sha256"),
        "ragen.model.package": record.get("package"),
        "ragen.model.package_version": record.get("package_version"),
        "ragen.model.dtype": record.get("dtype"),
        "ragen.model.architecture": record.get("architecture"),
        "ragen.model.imported_with": (
            f"transformers {record['transformers_version']}" if record.get("transformers_version") else None
        ),
    }
    return {k: str(v) for k, v in keys.items() if v not in (None, "")}
