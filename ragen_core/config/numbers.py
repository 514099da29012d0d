"""Numbers a config may hold: finite ones only, in every float field of every section.

Pydantic reads ``inf`` (and YAML's ``.inf``) into a float field, and a bound such as ``gt=0`` lets it
through (NaN fails every comparison, so a bounded field refused NaN but not infinity): a learning
rate of ``inf`` passed validation and failed at iteration 2 as "the model produced NaN logits".
One check over the validated tree covers every section, whichever module owns it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

#: The most iterations a run may have: iteration folders and evaluation steps are named with four
#: digits (``iter_0001``, ``eval/step_0001.json``), so that they sort in order.
MAX_ITERATIONS = 9999


def non_finite(tree: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted key, value)`` for every infinite or NaN float in ``tree`` (dicts, lists, numbers)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from non_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from non_finite(value, f"{prefix}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        yield prefix, tree


def non_finite_problems(tree: Any) -> list[str]:
    """One message per non-finite number in ``tree``, naming its key and the fix."""
    return [
        f"{key}: {value} is not a finite number; give it a finite value (e.g. --set {key}=...)"
        for key, value in non_finite(tree)
    ]
