"""Size limits on the shipped code: no module over 600 lines, no function over 80 lines and no function
with a radon cyclomatic complexity over 20, in every package outside ``benchmarks/`` and ``tests/``.

A long module holds several jobs and a long or branchy function hides its steps; past these limits the
fix is to split along the jobs (a module per job, a named helper per step), not to raise the limit.
ruff's C901 is not enough: it does not count ``and``/``or``, radon does. Read from the source (nothing
is imported), so the check takes about a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Class, Function

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "ragen_core", "tasks", "flows")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_COMPLEXITY = 20


def _sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_the_packages_hold_sources() -> None:
    # Guards the other checks against passing on an empty file list (a moved folder, a wrong ROOT).
    assert len(_sources()) > 50


def test_no_module_over_the_line_limit() -> None:
    too_long = {_name(p): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines: {too_long}; split each along its jobs into modules "
        "named for what they do"
    )


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{_name(path)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_the_line_limit() -> None:
    too_long = [f for p in _sources() for f in _long_functions(p)]
    assert not too_long, (
        f"functions over {MAX_FUNCTION_LINES} lines (decorators not counted): {too_long}; move their "
        "steps into named helpers"
    )


def _complex_functions(path: Path) -> list[str]:
    found = []
    for block in cc_visit(path.read_text()):
        # A class's methods come both inside it and on their own: the class's entry is skipped.
        if isinstance(block, Class):
            continue
        assert isinstance(block, Function)
        if block.complexity > MAX_COMPLEXITY:
            found.append(f"{_name(path)}:{block.lineno} {block.fullname} (complexity {block.complexity})")
    return found


def test_no_function_over_the_complexity_limit() -> None:
    too_complex = [f for p in _sources() for f in _complex_functions(p)]
    assert not too_complex, (
        f"functions with radon cyclomatic complexity over {MAX_COMPLEXITY}: {too_complex}; move "
        "branches into named helpers or tables"
    )


def test_the_limits_catch_offenders(tmp_path: Path) -> None:
    long_body = "def long(x):\n" + "    x += 1\n" * MAX_FUNCTION_LINES + "    return x\n"
    # Each `if` with an `and` adds two: 11 of them give 23, over the limit.
    branchy = "def branchy(a, b):\n" + "".join(
        f"    if a == {i} and b:\n        return {i}\n" for i in range(11)
    )
    path = tmp_path / "offender.py"
    path.write_text(long_body + branchy)
    assert [f.split()[-3] for f in _long_functions(path)] == ["long"]
    assert [f.split()[1] for f in _complex_functions(path)] == ["branchy"]
