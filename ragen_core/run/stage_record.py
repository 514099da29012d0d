"""What a finished stage made, and from what: the record that lets a resumed run reuse it.

A run killed between stages resumes its pending iteration without redoing the stages that
finished: a stage's stored output is reused when, and only when,

* its record is in this run's directory (so nothing is ever reused across runs),
* every output it lists still exists with the digest it had when the stage wrote it, and
* every input it lists (the policy it played, the rollouts it learned from, ...) has the digest
  it had then.

Otherwise the stage runs again and overwrites its own outputs and record. A deleted, truncated or
edited output is therefore regenerated (the stage is deterministic), never trusted. Digests are
:func:`ragen_core.run.run_dir.file_digest` of files or folders. The record is written last, after
every output, so a stage killed half-way has no record and reruns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ragen_core.run.run_dir import atomic_write_text, file_digest


def _digest(path: Path) -> str | None:
    if not path.exists():
        return None
    return file_digest(path)


def load(record: Path, inputs: Mapping[str, Path]) -> dict[str, Any] | None:
    """The stored result (``metrics`` and ``extra``) of the stage that wrote ``record``, if it may be
    reused with these ``inputs``; else None."""
    try:
        data = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    want = data.get("inputs", {})
    if set(want) != set(inputs) or any(_digest(p) != want[name] for name, p in inputs.items()):
        return None
    for rel, digest in data.get("outputs", {}).items():
        if _digest(record.parent.parent / rel) != digest:
            return None
    return {"metrics": data.get("metrics", {}), "extra": data.get("extra", {})}


def save(
    record: Path,
    inputs: Mapping[str, Path],
    outputs: list[Path],
    metrics: Mapping[str, float],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the record of a stage that has just written ``outputs`` from ``inputs``."""
    base = record.parent.parent
    data = {
        "inputs": {name: _digest(p) for name, p in inputs.items()},
        "outputs": {str(p.relative_to(base)): _digest(p) for p in outputs},
        "metrics": dict(metrics),
        "extra": dict(extra or {}),
    }
    # No digest of the record itself: it holds the digests, and a damaged record only costs a rerun.
    atomic_write_text(record, json.dumps(data, indent=1, sort_keys=True), record_digest=False)


def made_with(record: Path) -> dict[str, Any]:
    """The ``extra`` a stage recorded of how it ran (e.g. the learn stage's learner count); empty when
    there is no readable record (a stage of an older version, or one that never finished)."""
    try:
        data = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    extra = data.get("extra", {})
    return extra if isinstance(extra, dict) else {}


def recorded_digest(record: Path, output: Path) -> str | None:
    """The digest ``record`` holds of ``output`` when its stage wrote it (None: no readable record)."""
    try:
        data = json.loads(record.read_text())
        digest = data.get("outputs", {}).get(str(output.relative_to(record.parent.parent)))
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


def misplaced_rows(path: Path, k: int, record: Path) -> str | None:
    """Why the trajectory file ``path`` of iteration (or step) ``k`` holds another iteration's rows
    (a file copied or swapped between folders, its SHA256SUMS rewritten), else None. Trajectory schema
    v1 files are not checked: their ``iteration`` column held the seed round."""
    import pyarrow.parquet as pq

    from ragen_core.trajectory import schema_version

    try:
        if schema_version(path) == "1":
            return None
        held = sorted(set(pq.read_table(path, columns=["iteration"]).column("iteration").to_pylist()))
    except (OSError, ValueError, KeyError):
        return None  # unreadable: the reader that follows names the damage
    if not held or held == [k]:
        return None
    which = ", ".join(str(i) for i in held)
    where = f"{path.parent.name}/{path.name}"
    stored = recorded_digest(record, path)
    digests = f"stored digest {stored[:12] if stored else 'none'}..., file digest {file_digest(path)[:12]}..."
    fix = (
        f"delete {path.parent / 'DONE'} and resume the run (`ragen train --resume`): iteration {k} is recomputed"
        if path.name == "rollouts.parquet"
        else "delete it and evaluate the step again"
    )
    return (
        f"{where} holds iteration {which}'s rows, not iteration {k}'s ({digests}): it was copied or swapped "
        f"from another folder, so it is neither shown nor compared; restore it from a copy, or {fix}"
    )


def misplaced_file(path: Path) -> str | None:
    """:func:`misplaced_rows` for a run's trajectory file found by its place: ``iter_K/rollouts.parquet``
    (the rollout stage's record) or ``eval/step_K.parquet`` (the evaluate stage's); None elsewhere."""
    folder, name = path.parent.name, path.name
    if name == "rollouts.parquet" and folder.startswith("iter_") and folder[5:].isdigit():
        return misplaced_rows(path, int(folder[5:]), path.parent / "stages" / "rollout.json")
    if folder == "eval" and name.startswith("step_") and name.endswith(".parquet") and name[5:-8].isdigit():
        return misplaced_rows(path, int(name[5:-8]), path.parent / "stages" / f"step_{name[5:-8]}.json")
    return None
