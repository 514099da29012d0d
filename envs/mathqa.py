"""MathQA: answer a math question (single turn by default, free text), MetaMathQA's format.

Data (docs/architecture.md, "Deliberate differences from RAGEN": MathQA data and attempts). RAGEN
downloads ``meta-math/MetaMathQA`` from the Hugging Face hub at construction. We read a local file
instead: ``data_path`` is a ``.jsonl`` or ``.parquet`` file with MetaMathQA's fields, ``query`` (the
question shown to the model) and ``response`` (a worked solution ending in
``"The answer is: <gold>"``; the gold answer is the text after the last such marker, the whole
response when there is none, as in RAGEN). Rows with ``question``/``answer`` fields (the gold
answer given directly) are accepted too. The default is the shipped ``envs/data/mathqa_arith.jsonl``:
500 one- and two-step arithmetic problems written by :func:`generate_arith_set` (seed 0), small
enough for tests and CPU demos; point ``data_path`` at the real MetaMathQA for paper runs.

Episode. ``reset(seed)`` picks the question with a local ``random.Random(seed)`` (same seed, same
question in any process; RAGEN's ``random.randint`` under a seed context, minus the global state).
Each ``step(answer)`` is one attempt: correct at attempt ``k`` (from 0) pays ``1 / 2**k``, ends the
episode and says ``"Correct!"``; a wrong answer pays 0 and says ``"Incorrect. Please think again."``.
After ``max_attempts`` attempts the episode ends. The default, 1, matches the tag's action budget
(``max_actions_per_traj = 1``), so the 1/2^k schedule is consistent with what can actually run
(in RAGEN, with a budget of 1, it is not); raise both together for multi-attempt training.

Correctness. RAGEN's rule: lowercase both strings, remove all whitespace, compare. We add one
conservative equivalence (``numeric_match``, on by default): when both normalised strings are plain
decimal numbers (``-12``, ``12.0``, ``0.50``; ASCII digits, optional sign and fractional part, nothing
else), they match if their values are equal, so ``12.0`` is accepted for ``12``. Nothing is parsed
beyond that: no fractions, units, thousands separators or LaTeX, which could turn a wrong answer into a
right one.

``info``: ``action_is_valid`` = the answer is non-empty (RAGEN's rule); ``action_is_effective`` = the
same (a non-empty answer is graded). Every answer, empty or not, uses one attempt, as every action
counts against the tag's budget. ``success`` = correct.
"""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import ClassVar

from envs.base import Env, StepResult
from envs.datafiles import read_rows

DEFAULT_DATA_PATH = Path(__file__).with_name("data") / "mathqa_arith.jsonl"
"""The shipped arithmetic set (``generate_arith_set(500, seed=0)``)."""

ANSWER_MARKER = "The answer is: "
CORRECT = "Correct!"
INCORRECT = "Incorrect. Please think again."

_DECIMAL = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?", re.ASCII)


# --------------------------------------------------------------------------------------------
# Answer checking


def normalize_answer(text: str) -> str:
    """RAGEN's normal form: lowercase, every whitespace character removed."""
    return "".join(text.lower().split())


def answers_match(answer: str, gold: str, *, numeric_match: bool = True) -> bool:
    """Whether ``answer`` is the gold answer (see the module docstring for the rule)."""
    a, g = normalize_answer(answer), normalize_answer(gold)
    if a == g:
        return True
    if numeric_match and _DECIMAL.fullmatch(a) and _DECIMAL.fullmatch(g):
        try:
            return Decimal(a) == Decimal(g)
        except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
            return False
    return False


def gold_from_response(response: str) -> str:
    """The text after the last ``"The answer is: "`` (the whole response if there is none)."""
    return response.rpartition(ANSWER_MARKER)[2].strip()


# --------------------------------------------------------------------------------------------
# Data


def load_questions(path: str | Path) -> list[tuple[str, str]]:
    """``(query, gold answer)`` pairs from a local ``.jsonl``/``.json`` or ``.parquet`` file.

    Parquet needs pyarrow, imported here only (``envs`` depends on the stdlib and numpy).
    """
    path = Path(path)
    rows = read_rows(path, "MathQA")
    questions: list[tuple[str, str]] = []
    for k, row in enumerate(rows):
        if "query" in row and "response" in row:
            questions.append((str(row["query"]), gold_from_response(str(row["response"]))))
        elif "question" in row and "answer" in row:
            questions.append((str(row["question"]), str(row["answer"]).strip()))
        else:
            raise ValueError(f"{path}: row {k} needs 'query' and 'response' (or 'question' and 'answer')")
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


_NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Finn",
    "Grace",
    "Hugo",
    "Iris",
    "Jack",
    "Lena",
    "Mia",
    "Noah",
    "Omar",
    "Priya",
    "Sam",
    "Tara",
    "Yuki",
    "Zoe",
    "Leo",
)
_ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "books",
    "shells",
    "coins",
    "cards",
    "stamps",
)


def _arith_item(rng: random.Random) -> tuple[str, str, int]:
    """One problem: ``(query, worked solution, integer answer)``."""
    name = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(10)
    if kind == 0:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is ${a} + {b}$?", f"We add: ${a} + {b} = {a + b}$.", a + b
    if kind == 1:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is ${a} - {b}$?", f"We subtract: ${a} - {b} = {a - b}$.", a - b
    if kind == 2:
        a, b = rng.randint(2, 99), rng.randint(2, 30)
        return f"Compute ${a} \\times {b}$.", f"${a} \\times {b} = {a * b}$.", a * b
    if kind == 3:
        b, c = rng.randint(2, 30), rng.randint(2, 40)
        return (
            f"What is ${b * c} \\div {b}$?",
            f"Since ${b} \\times {c} = {b * c}$, we have ${b * c} \\div {b} = {c}$.",
            c,
        )
    if kind == 4:
        a, b = rng.randint(3, 60), rng.randint(2, 60)
        return (
            f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            f"{name} has ${a} + {b} = {a + b}$ {item}.",
            a + b,
        )
    if kind == 5:
        a, b = rng.randint(2, 12), rng.randint(2, 24)
        return (
            f"{name} buys {a} boxes of {item} with {b} {item} in each box. How many {item} is that in total?",
            f"In total there are ${a} \\times {b} = {a * b}$ {item}.",
            a * b,
        )
    if kind == 6:
        friends, each = rng.randint(2, 12), rng.randint(2, 20)
        total = friends * each
        return (
            f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each "
            "friend get?",
            f"Each friend gets ${total} \\div {friends} = {each}$ {item}.",
            each,
        )
    if kind == 7:
        a, b, c = rng.randint(20, 90), rng.randint(1, 19), rng.randint(1, 40)
        return (
            f"{name} had {a} {item}, gave away {b}, and then found {c} more. How many {item} does "
            f"{name} have now?",
            f"After giving some away, {name} has ${a} - {b} = {a - b}$. After finding more, "
            f"${a - b} + {c} = {a - b + c}$.",
            a - b + c,
        )
    if kind == 8:
        count, price = rng.randint(2, 9), rng.randint(2, 15)
        paid = count * price + rng.randint(0, 30)
        return (
            f"{name} buys {count} notebooks at {price} dollars each and pays with {paid} dollars. "
            f"How many dollars of change does {name} get?",
            f"The notebooks cost ${count} \\times {price} = {count * price}$ dollars, so the change is "
            f"${paid} - {count * price} = {paid - count * price}$.",
            paid - count * price,
        )
    a, b, c = rng.randint(1, 50), rng.randint(2, 12), rng.randint(2, 12)
    return (
        f"What is ${a} - {b} \\times {c}$?",
        f"Multiplication comes first: ${b} \\times {c} = {b * c}$, then ${a} - {b * c} = {a - b * c}$.",
        a - b * c,
    )


def generate_arith_set(n: int = 500, seed: int = 0) -> list[dict[str, str]]:
    """``n`` MetaMathQA-style records (``query``, ``response``, ``type``) of 1-2 step arithmetic.

    The shipped default data file is ``generate_arith_set(500, 0)``; regenerate it with
    ``python -m envs.mathqa``. Local RNG only, so the output depends on ``(n, seed)`` alone.
    """
    rng = random.Random(seed)
    records: list[dict[str, str]] = []
    for _ in range(n):
        query, work, answer = _arith_item(rng)
        records.append({"query": query, "response": f"{work}\n{ANSWER_MARKER}{answer}", "type": "arith"})
    return records


def write_arith_set(path: str | Path = DEFAULT_DATA_PATH, n: int = 500, seed: int = 0) -> Path:
    """Write :func:`generate_arith_set` as JSONL (one record per line, stable key order)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(rec, sort_keys=True) for rec in generate_arith_set(n, seed)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# The environment


class MathQAEnv(Env):
    """One question per episode; each action is an attempt at the answer (free text)."""

    env_type: ClassVar[str] = "metamathqa"
    success_means: ClassVar[str] = (
        "the answer equals the gold answer after lowercasing and removing whitespace (or both are plain "
        "decimal numbers of equal value), at an allowed attempt."
    )

    def __init__(
        self, data_path: str | Path | None = None, max_attempts: int = 1, numeric_match: bool = True
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.data_path = DEFAULT_DATA_PATH if data_path is None else Path(data_path)
        self.max_attempts = int(max_attempts)
        self.numeric_match = bool(numeric_match)
        self._questions = load_questions(self.data_path)
        self.actions = None
        self.index: int | None = None
        self.query: str = ""
        self.gold_answer: str = ""
        self.attempts = 0
        self._observation: str | None = None
        self._done = False

    def __len__(self) -> int:
        return len(self._questions)

    def reset(self, seed: int) -> str:
        """Pick the question of ``seed`` (local RNG) and return it."""
        self.index = random.Random(seed).randrange(len(self._questions))
        self.query, self.gold_answer = self._questions[self.index]
        self.attempts = 0
        self._done = False
        self._observation = self.query
        return self._observation

    def step(self, action: str) -> StepResult:
        """Grade one attempt (see the module docstring for rewards and termination)."""
        if self._observation is None:
            raise RuntimeError("MathQAEnv.step() before reset(seed)")
        if self._done:  # already answered or out of attempts: nothing more to grade
            return StepResult(
                self._observation,
                0.0,
                True,
                {"success": False, "action_is_valid": False, "action_is_effective": False},
            )
        valid = isinstance(action, str) and action.strip() != ""
        correct = valid and answers_match(action, self.gold_answer, numeric_match=self.numeric_match)
        attempt = self.attempts
        self.attempts += 1
        if correct:
            reward = 1.0 / 2**attempt
            self._done = True
            self._observation = CORRECT
        else:
            reward = 0.0
            self._done = self.attempts >= self.max_attempts
            self._observation = INCORRECT
        return StepResult(
            self._observation,
            reward,
            self._done,
            {"success": correct, "action_is_valid": valid, "action_is_effective": valid},
        )

    def render(self) -> str:
        """The question before any attempt, then the latest feedback."""
        if self._observation is None:
            raise RuntimeError("MathQAEnv.render() before reset(seed)")
        return self._observation

    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """The gold answer."""
        return [solve(self)]

    def close(self) -> None:
        self._observation = None


def solve(env: MathQAEnv) -> str:
    """Oracle answer for the current question: the gold answer."""
    if env.index is None:
        raise RuntimeError("solve(env) before env.reset(seed)")
    return env.gold_answer


if __name__ == "__main__":  # regenerate the shipped data file
    print(write_arith_set())
