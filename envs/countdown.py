"""Countdown: combine the given numbers with + - * / to reach a target (single turn, free text).

Puzzles (docs/architecture.md, "Deliberate differences from RAGEN": Countdown puzzles). RAGEN reads
the HF dataset ``Jiayi-Pan/Countdown-Tasks-3to4`` and keeps only puzzles solvable with + and -. We
generate each puzzle from the seed instead, with a local ``random.Random(seed)`` (the same seed
gives the same puzzle in any process): draw 3 or 4 numbers
(``num_count``) in ``[min_number, max_number]``, then combine them in a random order with random
operators whose results stay exact positive integers (``a - b`` only when ``a > b``, ``a / b`` only
when ``b`` divides ``a``, products up to :data:`MAX_INTERMEDIATE`) until the result lands in
``[min_target, max_target]``. So every puzzle has a known solution, kept in :attr:`CountdownEnv.solution`,
and all four operators occur. ``data_path`` (a local ``.jsonl`` or ``.parquet`` file with ``target`` and
``nums`` columns, the HF dataset's schema) replaces the generator: ``index = seed mod len``, as in RAGEN.

Scoring (RAGEN's, with a safe evaluator instead of ``eval``, see :mod:`envs.arith`):

* ``0`` if the integers written in the answer are not the puzzle's numbers as a multiset (each number
  exactly once, all of them), or if the answer is over :data:`envs.arith.MAX_LENGTH` characters or
  holds control characters (NUL, ...): no format credit for garbage;
* ``format_score`` (0.1) if the numbers match but the expression does not parse or its value is not
  the target;
* ``score`` (1.0) if it parses, uses exactly the numbers, and equals the target. Equality is exact
  (rational arithmetic): RAGEN's 1e-5 tolerance only absorbs float rounding, which cannot occur here,
  and a tolerance would accept an answer that misses by a tiny fraction.

``"expr = target"`` is accepted as ``expr`` when the right side is exactly the target's integer: the
prompt's own worked example ends in "2 + 5 - 3 = 4", so models copy the pattern; RAGEN then counts the
target as an extra number and scores a correct equation 0. Restating the target adds no information,
so we drop it; any other right side (another number, an expression, a second ``=``) is left in place
and makes the answer unparseable (and usually fails the number check).

``info``: ``action_is_valid`` = the answer is a well-formed expression over exactly the puzzle's
numbers (right or wrong value); ``action_is_effective`` = the same (a valid answer is what gets
graded as an equation); ``success`` = reward == ``score``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

from envs.arith import MAX_LENGTH, integers_in, try_evaluate
from envs.base import Env, StepResult, format_reward
from envs.datafiles import read_rows

MAX_INTERMEDIATE = 10_000
"""Largest product the generator forms on the way to a target (keeps solutions human-sized)."""

_ALLOWED_CONTROL = frozenset("\t\n\r")


def _is_control(ch: str) -> bool:
    """C0/C1 control characters other than tab and newlines (NUL, ESC, DEL, ...)."""
    code = ord(ch)
    return (code < 32 or 0x7F <= code <= 0x9F) and ch not in _ALLOWED_CONTROL


# --------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True)
class Score:
    """How an answer was graded."""

    reward: float
    valid: bool
    """Well-formed expression over exactly the puzzle's numbers."""
    success: bool


def _drop_restated_target(answer: str, target: int) -> str:
    """``"expr = target"`` -> ``"expr"``; anything else unchanged (see the module docstring)."""
    if answer.count("=") != 1:
        return answer
    lhs, _, rhs = answer.partition("=")
    rhs = rhs.strip()
    if rhs.isascii() and rhs.isdigit() and int(rhs) == target:
        return lhs
    return answer


def score_answer(
    answer: str, nums: Sequence[int], target: int, *, score: float = 1.0, format_score: float = 0.1
) -> Score:
    """Grade a Countdown equation; never evaluates code, never raises for ``str`` input."""
    if not isinstance(answer, str) or len(answer) > MAX_LENGTH:
        return Score(0.0, False, False)
    if any(_is_control(ch) for ch in answer):
        return Score(0.0, False, False)
    expression = _drop_restated_target(answer, target)
    if sorted(integers_in(expression)) != sorted(nums):
        return Score(0.0, False, False)
    evaluation = try_evaluate(expression)
    if evaluation is None:
        return Score(float(format_score), False, False)
    if evaluation.value == target:
        return Score(float(score), True, True)
    return Score(float(format_score), True, False)


# --------------------------------------------------------------------------------------------
# Oracle


def _strip_outer_parens(expr: str) -> str:
    """``"(a + b)"`` -> ``"a + b"`` when the outer pair encloses the whole string."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return expr
    depth = 0
    for i, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(expr) - 1:
            return expr
    return expr[1:-1]


def solve(nums: Sequence[int], target: int) -> str | None:
    """An equation that uses every number once and equals ``target``, or ``None`` if none exists.

    Exhaustive search over + - * / on exact Fractions: repeatedly replace two values by their
    combination. A multiset of values that failed once fails again whatever expressions produced it,
    so visited multisets are skipped (this keeps 4 numbers at a few thousand states).
    """
    goal = Fraction(target)
    seen: set[tuple[Fraction, ...]] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == goal else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = [item for k, item in enumerate(items) if k not in (i, j)]
                candidates = [
                    (a + b, f"({ea} + {eb})"),
                    (a * b, f"({ea} * {eb})"),
                    (a - b, f"({ea} - {eb})"),
                    (b - a, f"({eb} - {ea})"),
                ]
                if b != 0:
                    candidates.append((a / b, f"({ea} / {eb})"))
                if a != 0:
                    candidates.append((b / a, f"({eb} / {ea})"))
                for value, expr in candidates:
                    found = search([*rest, (value, expr)])
                    if found is not None:
                        return found
        return None

    if not nums:
        return None
    found = search([(Fraction(int(n)), str(int(n))) for n in nums])
    return None if found is None else _strip_outer_parens(found)


# --------------------------------------------------------------------------------------------
# Puzzle generation and data files


def generate_puzzle(
    seed: int,
    num_count: Sequence[int] = (3, 4),
    min_number: int = 1,
    max_number: int = 100,
    min_target: int = 1,
    max_target: int = 100,
) -> tuple[list[int], int, str]:
    """``(nums, target, solution)`` for ``seed``; deterministic in any process (local RNG only)."""
    if min_number < 1 or max_number < min_number:
        raise ValueError(f"need 1 <= min_number <= max_number, got {min_number}, {max_number}")
    if min_target < 1 or max_target < min_target:
        raise ValueError(f"need 1 <= min_target <= max_target, got {min_target}, {max_target}")
    counts = list(num_count)
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"num_count must hold positive integers, got {num_count}")
    rng = random.Random(seed)
    for _ in range(2000):
        k = rng.choice(counts)
        nums = [rng.randint(min_number, max_number) for _ in range(k)]
        for _ in range(20):
            items: list[tuple[int, str]] = [(n, str(n)) for n in nums]
            while len(items) > 1:
                i, j = rng.sample(range(len(items)), 2)
                (a, ea), (b, eb) = items[i], items[j]
                options: list[tuple[int, str]] = [(a + b, "+")]
                if a > b:
                    options.append((a - b, "-"))
                if a * b <= MAX_INTERMEDIATE:
                    options.append((a * b, "*"))
                if b > 1 and a % b == 0:
                    options.append((a // b, "/"))
                value, op = rng.choice(options)
                items = [item for idx, item in enumerate(items) if idx not in (i, j)]
                items.append((value, f"({ea} {op} {eb})"))
            value, expr = items[0]
            if min_target <= value <= max_target:
                return nums, value, _strip_outer_parens(expr)
    raise RuntimeError(  # not reached with sane ranges; a clear message beats a silent loop
        f"could not generate a Countdown puzzle for seed {seed} with numbers in [{min_number}, "
        f"{max_number}] and targets in [{min_target}, {max_target}]"
    )


def load_puzzles(path: str | Path, max_instances: int | None = None) -> list[tuple[list[int], int]]:
    """Read ``(nums, target)`` rows from a local ``.jsonl``/``.json`` or ``.parquet`` file.

    Parquet needs pyarrow, imported here only (``envs`` depends on the stdlib and numpy).
    """
    path = Path(path)
    rows = read_rows(path, "Countdown", columns=["target", "nums"])
    if max_instances is not None:
        rows = rows[:max_instances]
    puzzles: list[tuple[list[int], int]] = []
    for k, row in enumerate(rows):
        try:
            nums = [int(n) for n in row["nums"]]
            target = int(row["target"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: row {k} needs integer 'target' and list 'nums': {row!r}") from exc
        puzzles.append((nums, target))
    if not puzzles:
        raise ValueError(f"{path}: no puzzles")
    return puzzles


# --------------------------------------------------------------------------------------------
# The environment


class CountdownEnv(Env):
    """One puzzle per episode; the single action is the equation (free text)."""

    env_type: ClassVar[str] = "countdown"
    success_means: ClassVar[str] = (
        "the answer parses, uses each of the puzzle's numbers exactly once, and its exact value is "
        "the target."
    )

    def __init__(
        self,
        num_count: int | Sequence[int] = (3, 4),
        min_number: int = 1,
        max_number: int = 100,
        min_target: int = 1,
        max_target: int = 100,
        data_path: str | Path | None = None,
        max_instances: int | None = None,
        score: float = 1.0,
        format_score: float = 0.1,
    ) -> None:
        self.num_count: tuple[int, ...] = (num_count,) if isinstance(num_count, int) else tuple(num_count)
        self.min_number = int(min_number)
        self.max_number = int(max_number)
        self.min_target = int(min_target)
        self.max_target = int(max_target)
        self.score = float(score)
        self.format_score = float(format_score)
        self.data_path = None if data_path is None else Path(data_path)
        self._puzzles = None if self.data_path is None else load_puzzles(self.data_path, max_instances)
        if self._puzzles is None:  # fail at construction on bad ranges, not at the first reset
            generate_puzzle(
                0, self.num_count, self.min_number, self.max_number, self.min_target, self.max_target
            )
        self.actions = None
        self.nums: list[int] = []
        self.target: int = 0
        self._solution: str | None = None
        self._solved = False
        self._observation: str | None = None
        self._done = False

    def reset(self, seed: int) -> str:
        """Pick (data file) or generate (default) the puzzle of ``seed``."""
        if self._puzzles is not None:
            nums, target = self._puzzles[seed % len(self._puzzles)]
            self.nums, self.target = list(nums), target
            self._solution, self._solved = None, False  # found on demand by `solution`
        else:
            self.nums, self.target, self._solution = generate_puzzle(
                seed, self.num_count, self.min_number, self.max_number, self.min_target, self.max_target
            )
            self._solved = True
        self._done = False
        self._observation = f"Target: {self.target}, nums: {self.nums}"
        return self._observation

    @property
    def solution(self) -> str | None:
        """A correct equation for the current puzzle (``None`` if a data-file puzzle has none)."""
        if self._observation is None:
            raise RuntimeError("CountdownEnv.solution before reset(seed)")
        if not self._solved:
            self._solution, self._solved = solve(self.nums, self.target), True
        return self._solution

    def step(self, action: str) -> StepResult:
        """Grade the equation; the episode ends whatever it scored (one answer per puzzle)."""
        if self._observation is None:
            raise RuntimeError("CountdownEnv.step() before reset(seed)")
        if self._done:  # the answer was already graded: a second one changes nothing
            return StepResult(
                self._observation,
                0.0,
                True,
                {"success": False, "action_is_valid": False, "action_is_effective": False},
            )
        graded = score_answer(
            action, self.nums, self.target, score=self.score, format_score=self.format_score
        )
        self._done = True
        self._observation = f"Your answer get {format_reward(graded.reward)} points."
        return StepResult(
            self._observation,
            graded.reward,
            True,
            {"success": graded.success, "action_is_valid": graded.valid, "action_is_effective": graded.valid},
        )

    def render(self) -> str:
        """The puzzle before the answer, the grading message after it."""
        if self._observation is None:
            raise RuntimeError("CountdownEnv.render() before reset(seed)")
        return self._observation

    # Oracle and demonstrations ------------------------------------------------------------------------
    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """A correct equation (``[]`` when a data-file puzzle has none)."""
        sol = self.solution
        return [sol] if sol else []

    def think_text(self, actions: Sequence[str]) -> str:
        """``Target 24, nums [1, 2, 3, 4]. I try 1 * 2 * 3 * 4.``"""
        first = actions[0] if actions else ""
        return f"Target {self.target}, nums {self.nums}. I try {first}."

    def random_answer(self, plan: list[str], cap: int, rng: random.Random) -> list[str]:
        """A random expression of the puzzle's numbers: shuffled, joined by random operators.

        It uses each of the puzzle's numbers once, so a noise turn still shows a well-formed equation
        (usually of the wrong value) rather than an answer of the wrong shape.
        """
        nums = list(self.nums)
        rng.shuffle(nums)
        expr = str(nums[0])
        for n in nums[1:]:
            expr += f" {rng.choice('+-*/')} {n}"
        return [expr]

    def close(self) -> None:
        self._observation = None
