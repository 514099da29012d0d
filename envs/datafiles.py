"""Reading local data files (JSONL or Parquet) for the data-backed environments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rows(path: str | Path, what: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file.

    Parquet needs pyarrow, imported here only (``envs`` depends on the stdlib and numpy). ``what``
    names the environment in errors.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is a core dependency
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
        rows: list[dict[str, Any]] = pq.read_table(path, columns=columns).to_pylist()
        return rows
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    raise ValueError(f"{what} data file must be .jsonl or .parquet, got {path}")
