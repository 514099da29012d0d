"""Weight files checked before a model loads: a safetensors file starts with an 8-byte little-endian
header length and that many bytes of JSON. A corrupt or hostile file (a header length of 2^62) makes
the safetensors loader fail deep inside a model load, after a run folder and a Prefect flow run exist,
with ``SafetensorError: header too large`` and no file named. Reading the 8 bytes and the header is
cheap (no torch), so the CLI checks every weight file of a model folder before any work."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ragen_core.errors import RagenError

#: safetensors' own limit on the JSON header (100 MB): a longer one is refused by the loader.
MAX_HEADER_BYTES = 100_000_000


class WeightsFileError(RagenError, ValueError):
    """A weight file that cannot be a valid safetensors file; the message names it and the fix."""


def _read_header(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A safetensors file's JSON header, or None and why it is not a valid one."""
    size = path.stat().st_size
    if size < 8:
        return None, f"{size} bytes, shorter than the 8-byte header length"
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > size - 8 or length > MAX_HEADER_BYTES:
            return None, f"its header length field says {length} bytes, the file has {size}"
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None, "its header is not JSON"
    if not isinstance(header, dict):
        return None, "its header is not a JSON object"
    ends = [
        int(v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
    ]
    if ends and max(ends) > size - 8 - length:
        return (
            None,
            f"its tensors end at byte {max(ends)} of the data, and the file holds {size - 8 - length}",
        )
    return header, None


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """One line naming ``path``, why it is not a valid safetensors file and the fix; None if it is."""
    path = Path(path)
    try:
        why = _read_header(path)[1]
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    if why is None:
        return None
    return (
        f"{path}: not a valid safetensors file ({why}); it is truncated or corrupt: save, download or "
        "`ragen model import` the model again"
    )


def parameter_count(folder: str | os.PathLike[str]) -> int | None:
    """The number of weights in a model folder's ``*.safetensors`` files, from their headers (no torch);
    None where there is no such file or a header does not parse (:func:`check_model_folder` says why)."""
    total, found = 0, False
    for path in sorted(Path(folder).glob("*.safetensors")):
        header, _ = _read_header(path)
        if header is None:
            return None
        for key, tensor in header.items():
            if key != "__metadata__" and isinstance(tensor, dict):
                total, found = total + math.prod(int(dim) for dim in tensor.get("shape", [])), True
    return total if found else None


def check_model_folder(folder: str | os.PathLike[str]) -> None:
    """:class:`WeightsFileError` for the first broken ``*.safetensors`` file of a model folder (and its
    ``policy/`` subfolder, where a run keeps a checkpoint's weights)."""
    root = Path(folder)
    if not root.is_dir():
        return
    for path in sorted([*root.glob("*.safetensors"), *root.glob("policy/*.safetensors")]):
        problem = safetensors_problem(path)
        if problem:
            raise WeightsFileError(problem)
