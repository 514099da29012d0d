"""The layers import one way (envs < ragen_core < tasks < flows), inside ``ragen_core`` each subpackage
imports only those below it (``CORE_LAYERS``), and no modules import each other in a cycle.

Read from the source with ``ast`` (nothing is imported). Every import counts, also one inside a function:
a function-level import hides a cycle from Python, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("envs", "ragen_core", "tasks", "flows")  # lowest first


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _imports(path: Path, name: str) -> set[str]:
    """Project modules imported anywhere in the file at ``path`` (module ``name``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] in LAYERS}


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


#: Which parts of ``ragen_core`` each part may import (besides itself). ``base`` is every module directly
#: in ``ragen_core/``: the errors, the state folder, integrity and storage, the agent protocol, the env
#: groups, the trajectory table, the Echo-Trap monitor and the algorithms' mode names; it imports only
#: itself. docs/architecture.md, "Layers", draws the same table.
CORE_LAYERS: dict[str, set[str]] = {
    "base": set(),
    "algorithms": {"base"},
    "config": {"base", "algorithms"},  # the registries' names (ragen_core.algorithms.registry, no torch)
    "models": {"base", "config"},
    "rollout": {"base", "algorithms", "models"},
    "learner": {"base", "algorithms", "config", "models", "rollout"},
    "tracking": {"base", "config"},
    "run": {"base", "algorithms", "config", "models", "rollout", "learner", "tracking"},
    "sweep": {"base", "config", "tracking", "run"},
}


def _core_part(module: str) -> str:
    """The part of ``ragen_core`` a module of it belongs to: its subpackage, or ``base``."""
    parts = module.split(".")
    return (
        parts[1]
        if len(parts) > 2 or (len(parts) == 2 and (ROOT / "ragen_core" / parts[1]).is_dir())
        else "base"
    )


def _core_violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in modules.items():
        if not name.startswith("ragen_core"):
            continue
        part = _core_part(name)
        for resolved in sorted({_resolve(t, modules) or "" for t in _imports(path, name)}):
            if not resolved.startswith("ragen_core"):
                continue
            other = _core_part(resolved)
            if other != part and other not in CORE_LAYERS[part]:
                bad.append(f"{name} ({part}) imports {resolved} ({other})")
    return bad


def test_no_import_points_up_a_layer() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(path, name):
            resolved = _resolve(target, modules)
            if resolved and _layer(resolved) > _layer(name):
                upward.append(f"{name} imports {resolved}")
    assert not upward, "imports pointing up a layer (envs < ragen_core < tasks < flows):\n" + "\n".join(
        upward
    )


def test_every_core_subpackage_has_a_row() -> None:
    """A new subpackage of ``ragen_core`` states what it may import."""
    found = {p.name for p in (ROOT / "ragen_core").iterdir() if (p / "__init__.py").is_file()}
    assert found | {"base"} == set(CORE_LAYERS), (
        f"add a row to CORE_LAYERS for {sorted(found - set(CORE_LAYERS))}"
    )


def test_core_subpackages_import_only_those_below() -> None:
    bad = _core_violations(_modules())
    assert not bad, "imports CORE_LAYERS does not allow:\n" + "\n".join(bad)


def test_the_core_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check itself: a config module importing the learner is reported."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from ragen_core.learner.update import Learner\n")
    found = _core_violations({"ragen_core.config.probe": path, **_modules()})
    assert found == ["ragen_core.config.probe (config) imports ragen_core.learner.update (learner)"]


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = {_resolve(t, modules) for t in _imports(path, name)}
        # a package's __init__ is loaded with its modules: edges into a package's own modules are not cycles
        graph[name] = {d for d in deps if d and d != name and not d.startswith(name + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("bad", ["flows.cli", "tasks.stages"])
def test_the_layer_check_sees_an_upward_import(bad: str, tmp_path: Path) -> None:
    """The check itself: an envs module importing an upper layer is reported."""
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n    import {bad}\n")
    assert _resolve(next(iter(_imports(path, "envs.probe"))), _modules()) == bad
