"""Names and tag texts as MLflow takes them: a metric, param or tag name MLflow accepts
(:func:`metric_key`), and the ``ragen.logged_steps`` tag's list of steps (:func:`format_steps`,
:func:`parse_steps`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH


_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def format_steps(steps: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 5}`` -> ``"0-3,5"`` (what the ``ragen.logged_steps`` tag holds)."""
    out: list[list[int]] = []
    for k in sorted(set(steps)):
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def parse_steps(text: str) -> set[int]:
    """The inverse of :func:`format_steps`."""
    steps: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        steps.update(range(int(a), int(b or a) + 1))
    return steps


def metric_key(name: str) -> str:
    """A name MLflow accepts for a metric, param or tag: ``@`` -> ``_at_``, any other character
    outside ``[A-Za-z0-9_./ :-]`` -> ``_``, no empty / ``.`` / ``..`` path parts, at most 250 chars."""
    key = _BAD_CHARS.sub("_", str(name).replace("@", "_at_"))
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    key = "/".join(parts) or "_"
    return key[:MAX_KEY_LEN]
