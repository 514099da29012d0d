"""Names and tag texts as MLflow takes them: a metric, param or tag name MLflow accepts
(:func:`metric_key`), and the ``ragen.logged_steps`` tag's list of steps (:func:`format_steps`,
:func:`parse_steps`), and the history of a param a resume changed (:func:`resumed_value_tags`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


#: ``ragen.resume.<param>``: the values accepted resumes gave a param, oldest first (``2 -> 4 -> 8``
#: for ``trainer.iterations`` extended twice); MLflow keeps a param's first value.
RESUMED_VALUES_PREFIX = "ragen.resume."


def resumed_value_tags(
    changed: Mapping[str, str], existing: Mapping[str, str], tags: Mapping[str, str]
) -> dict[str, str]:
    """The ``ragen.resume.<param>`` tags of a resume: each changed param's history (from the run's
    ``tags``, else its first value in ``existing``), then its new value."""
    out = {}
    for key, value in changed.items():
        tag = RESUMED_VALUES_PREFIX + key
        history = tags.get(tag) or existing[key]
        if history.rsplit(" -> ", 1)[-1] != value:
            history = f"{history} -> {value}"
        out[tag] = history if len(history) <= 5000 else "... " + history[-4996:]
    return out
