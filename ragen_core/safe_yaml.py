"""YAML for files a user hands us (configs, sweeps): PyYAML's safe loader with a bound on how far
aliases expand.

PyYAML builds an alias as a shared reference, so a few hundred bytes of nested aliases (``&a [*b,
*b, ...]`` nine levels deep, a "billion laughs") load at once; what reads the result afterwards
(merging overrides, pydantic's validation, hashing the config) walks every copy and hangs for
minutes. The composed document is measured first, each shared node counted as often as it is
referenced (in time linear in the file), and refused beyond :data:`MAX_NODES`.
"""

from __future__ import annotations

from typing import Any

import yaml

#: The most values (scalars, lists, mappings, counted with aliases expanded) a document may hold; a
#: full run config is about 200, a sweep a few hundred.
MAX_NODES = 100_000


class AliasBombError(ValueError):
    """A YAML document whose aliases expand beyond :data:`MAX_NODES` values."""


def expanded_size(node: yaml.Node, sizes: dict[int, int] | None = None) -> int:
    """How many nodes ``node`` holds with every alias written out (each shared node sized once)."""
    sizes = {} if sizes is None else sizes
    open_: set[int] = set()  # nodes whose children are being sized: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:  # iterative post-order: a deep document must not hit the recursion limit
        current, children_done = stack.pop()
        if id(current) in sizes:
            continue
        children = _children(current)
        if children_done:
            sizes[id(current)] = min(1 + sum(sizes[id(c)] for c in children), MAX_NODES + 1)
            open_.discard(id(current))
            continue
        if id(current) in open_:
            raise AliasBombError("an alias (*name) refers to a list or mapping that holds it; write it out")
        open_.add(id(current))
        stack.append((current, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(node)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def safe_load(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing (:class:`AliasBombError`) a document whose aliases expand
    beyond :data:`MAX_NODES` values before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = expanded_size(node)
        if size > MAX_NODES:
            raise AliasBombError(
                f"its aliases (*name) expand to more than {MAX_NODES} values; write the values out, or "
                "refer to a list or mapping by alias fewer times"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()
