"""The safe arithmetic evaluator: exact values, strict syntax, bounded work, no code execution."""

from __future__ import annotations

import builtins
import contextlib
import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from envs.arith import (
    MAX_DEPTH,
    MAX_LENGTH,
    ArithError,
    evaluate,
    integers_in,
    tokenize,
    try_evaluate,
)


@pytest.mark.parametrize(
    ("text", "value", "numbers"),
    [
        ("2 + 5 - 3", 4, (2, 5, 3)),
        ("6 / 4 * 2", 3, (6, 4, 2)),
        ("(98 + 73) / 9", 19, (98, 73, 9)),
        ("2 * (3 + 4)", 14, (2, 3, 4)),
        ("2 * 3 + 4", 10, (2, 3, 4)),
        ("10 - 4 - 3", 3, (10, 4, 3)),
        ("64 / 4 / 2", 8, (64, 4, 2)),
        ("-3 + 5", 2, (3, 5)),
        ("-(1 - 4) * +2", 6, (1, 4, 2)),
        ("1 / 3", Fraction(1, 3), (1, 3)),
        (" \t7\n", 7, (7,)),
        ("0", 0, (0,)),
    ],
)
def test_values_are_exact_and_numbers_are_recorded(
    text: str, value: Fraction | int, numbers: tuple[int, ...]
) -> None:
    result = evaluate(text)
    assert result.value == value
    assert isinstance(result.value, Fraction)
    assert result.numbers == numbers


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "1 +",
        "(1 + 2",
        "1 + 2)",
        "()",
        "1 2",
        "2 ** 3",
        "9**9**9",
        "7 // 2",
        "2 ^ 3",
        "1.5 + 2",
        "3 = 3",
        "1 / 0",
        "1 / (2 - 2)",
        "07 + 1",
        "abs(-3)",
        "__import__('os')",
        "().__class__",
        "x + 1",
        "\u0663 + 1",  # ARABIC-INDIC DIGIT THREE
        "\uff13 + 1",  # FULLWIDTH DIGIT THREE
        "1\x00+ 2",
        "3 \u00d7 4",  # multiplication sign
        "1" * 40,  # literal over MAX_DIGITS
        "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1),
        "-" * (MAX_DEPTH + 1) + "1",
        "1+" * 300 + "1",  # more than MAX_TOKENS tokens, under MAX_LENGTH characters
        "1" + " " * MAX_LENGTH,
    ],
)
def test_malformed_expressions_raise_arith_error(text: str) -> None:
    with pytest.raises(ArithError):
        evaluate(text)
    assert try_evaluate(text) is None


def test_nesting_up_to_the_limit_is_fine() -> None:
    depth = MAX_DEPTH
    assert evaluate("(" * depth + "5" + ")" * depth).value == 5


def test_non_string_input_is_an_arith_error() -> None:
    with pytest.raises(ArithError):
        tokenize(b"1 + 2")  # type: ignore[arg-type]


def test_integers_in_sees_ascii_digits_only() -> None:
    assert integers_in("a12b 3 \u0663 \uff14 007") == [12, 3, 7]
    assert integers_in("") == []


HOSTILE = {
    "import": "__import__('os').system('touch {marker}')",
    "pathlib": "__import__('pathlib').Path('{marker}').touch()",
    "attribute": "().__class__.__base__.__subclasses__()",
    "power_tower": "9**9**9",
    "deep_parens": "(" * 10_000 + "1" + ")" * 10_000,
    "one_megabyte": "1+" * 500_000,
    "unicode_digits": "\u0663 + \u0664 + \u0665",
    "nul_bytes": "1\x00+\x002",
    "long_literal": "9" * 999,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_is_rejected_fast_without_running_code(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    text = HOSTILE[name].format(marker=marker)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the evaluator must never run code")

    evaluate("1 + 1")  # warm up outside the timed region
    for fn in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, fn, forbidden)
    start = time.perf_counter()
    result = try_evaluate(text)
    elapsed = time.perf_counter() - start
    assert result is None
    assert elapsed < 0.05, f"{name}: {elapsed * 1000:.1f} ms"
    assert not marker.exists()


# Property tests --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_only_ever_raises_arith_error(text: str) -> None:
    try:
        result = evaluate(text)
    except ArithError:
        return
    assert isinstance(result.value, Fraction)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ", max_size=60))
def test_operator_soup_only_ever_raises_arith_error(text: str) -> None:
    with contextlib.suppress(ArithError):
        evaluate(text)


Case = tuple[str, Fraction | None, int]
"""Expression text, its value (``None`` when it divides by zero), its nesting depth."""


def _expressions() -> st.SearchStrategy[Case]:
    """Well-formed expressions with their value computed by Fraction arithmetic."""
    leaves = st.integers(min_value=0, max_value=999).map(lambda n: (str(n), Fraction(n), 0))

    def combine(a: Case, op: str, b: Case) -> Case:
        (ta, va, da), (tb, vb, db) = a, b
        text, depth = f"({ta} {op} {tb})", max(da, db) + 1
        if va is None or vb is None:
            return text, None, depth
        if op == "+":
            return text, va + vb, depth
        if op == "-":
            return text, va - vb, depth
        if op == "*":
            return text, va * vb, depth
        return text, (None if vb == 0 else va / vb), depth

    def negate(c: Case) -> Case:
        return f"-{c[0]}", (None if c[1] is None else -c[1]), c[2] + 1

    def extend(children: st.SearchStrategy[Case]) -> st.SearchStrategy[Case]:
        return st.builds(combine, children, st.sampled_from("+-*/"), children) | children.map(negate)

    return st.recursive(leaves, extend, max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_expressions())
def test_agrees_with_fraction_arithmetic(case: Case) -> None:
    text, expected, depth = case
    assume(depth <= MAX_DEPTH)
    result = try_evaluate(text)
    if expected is None:
        assert result is None
    else:
        assert result is not None
        assert result.value == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=8), st.data())
def test_flat_expressions_match_python_precedence(nums: list[int], data: st.DataObject) -> None:
    """Unparenthesised + - * chains: same value as Python integer arithmetic (precedence, assoc.)."""
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(nums) - 1, max_size=len(nums) - 1))
    text = str(nums[0]) + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:], strict=True))
    expected = 0
    # Evaluate with explicit precedence: sum of signed products.
    term, sign = nums[0], 1
    for op, n in zip(ops, nums[1:], strict=True):
        if op == "*":
            term *= n
        else:
            expected += sign * term
            term, sign = n, (1 if op == "+" else -1)
    expected += sign * term
    result = evaluate(text)
    assert result.value == expected
    assert list(result.numbers) == nums
