"""MathQA: local data, answer matching, the 1/2^k attempt reward, the shipped arithmetic set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envs
from envs.mathqa import (
    CORRECT,
    DEFAULT_DATA_PATH,
    INCORRECT,
    MathQAEnv,
    answers_match,
    generate_arith_set,
    gold_from_response,
    load_questions,
    solve,
)

ROOT = Path(__file__).resolve().parents[2]


def _data(tmp_path: Path, rows: list[dict[str, str]], name: str = "qa.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("answer", "gold", "match"),
    [
        ("12", "12", True),
        (" 1 2 ", "12", True),  # all whitespace removed (RAGEN)
        ("\\frac{1}{2}", "\\frac {1} {2}", True),
        ("X = 3", "x=3", True),  # case-insensitive
        ("12.0", "12", True),  # plain decimals compare by value
        ("-0.50", "-.5", False),  # ".5" is not a plain decimal in our rule
        ("0.50", "0.5", True),
        ("+7", "7", True),
        ("12.5", "12", False),
        ("1,000", "1000", False),  # no separators
        ("$12$", "12", False),  # no LaTeX stripping
        ("12 apples", "12", False),
        ("1/2", "0.5", False),  # no fractions
        ("", "12", False),
        ("\u0661\u0662", "12", False),  # Arabic-Indic digits are not ASCII decimals
    ],
)
def test_answers_match(answer: str, gold: str, match: bool) -> None:
    assert answers_match(answer, gold) is match


def test_numeric_match_can_be_turned_off() -> None:
    assert not answers_match("12.0", "12", numeric_match=False)
    assert answers_match(" 12 ", "12", numeric_match=False)


def test_gold_from_response() -> None:
    assert gold_from_response("So 3 + 4 = 7.\nThe answer is: 7") == "7"
    assert gold_from_response("The answer is: 1\nThe answer is: 2 ") == "2"
    assert gold_from_response("no marker") == "no marker"


def test_single_attempt_episode(tmp_path: Path) -> None:
    path = _data(tmp_path, [{"query": "What is 3 + 4?", "response": "3 + 4 = 7.\nThe answer is: 7"}])
    env = MathQAEnv(data_path=path)
    assert env.actions is None
    assert env.reset(0) == "What is 3 + 4?"
    assert env.render() == "What is 3 + 4?"
    result = env.step(" 7 ")
    assert (result.observation, result.reward, result.done) == (CORRECT, 1.0, True)
    assert result.info == {"success": True, "action_is_valid": True, "action_is_effective": True}

    env.reset(0)
    result = env.step("8")
    assert (result.observation, result.reward, result.done) == (INCORRECT, 0.0, True)  # max_attempts 1
    assert result.info == {"success": False, "action_is_valid": True, "action_is_effective": True}
    after = env.step("7")
    assert after.done and after.reward == 0.0 and not after.info["success"]

    env.reset(0)
    result = env.step("   ")
    assert result.reward == 0.0 and result.done
    assert result.info == {"success": False, "action_is_valid": False, "action_is_effective": False}


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_reward_halves_with_each_attempt(tmp_path: Path, k: int) -> None:
    path = _data(tmp_path, [{"question": "2 * 21?", "answer": "42"}])
    env = MathQAEnv(data_path=path, max_attempts=4)
    env.reset(5)
    for _ in range(k):
        wrong = env.step("41")
        assert (wrong.observation, wrong.reward, wrong.done) == (INCORRECT, 0.0, False)
    right = env.step("42")
    assert (right.observation, right.reward, right.done) == (CORRECT, 1.0 / 2**k, True)


def test_episode_ends_after_max_attempts(tmp_path: Path) -> None:
    env = MathQAEnv(data_path=_data(tmp_path, [{"question": "q", "answer": "a"}]), max_attempts=3)
    env.reset(0)
    assert [env.step("b").done for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError):
        MathQAEnv(max_attempts=0)


def test_default_data_loads_and_oracle_scores_one() -> None:
    env = envs.make("MathQA")
    assert isinstance(env, MathQAEnv)
    assert env.env_type == "metamathqa"
    assert len(env) == 500
    for seed in range(200):
        obs = env.reset(seed)
        assert obs == env.query and obs
        result = env.step(solve(env))
        assert result.reward == 1.0 and result.info["success"]


def test_shipped_file_is_the_generator_output() -> None:
    lines = DEFAULT_DATA_PATH.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == generate_arith_set(500, 0)
    assert DEFAULT_DATA_PATH.stat().st_size < 200_000
    golds = [gold for _, gold in load_questions(DEFAULT_DATA_PATH)]
    assert all(g.lstrip("-").isdigit() for g in golds)
    assert len(set(q for q, _ in load_questions(DEFAULT_DATA_PATH))) >= 490


def test_generator_is_deterministic_and_seeded() -> None:
    assert generate_arith_set(20, 3) == generate_arith_set(20, 3)
    assert generate_arith_set(20, 3) != generate_arith_set(20, 4)
    for rec in generate_arith_set(50, 1):
        assert set(rec) == {"query", "response", "type"}
        assert "The answer is: " in rec["response"]


def test_seed_selects_question_deterministically_across_processes() -> None:
    env = MathQAEnv()
    here = [env.reset(seed) for seed in range(30)]
    assert here == [MathQAEnv().reset(seed) for seed in range(30)]
    assert len(set(here)) >= 25
    code = "import json; from envs.mathqa import MathQAEnv; e = MathQAEnv(); print(json.dumps([e.reset(s) for s in range(30)]))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "99"},
    )
    assert json.loads(out.stdout) == here


def test_parquet_data(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"query": ["What is 1 + 1?"], "response": ["1 + 1 = 2\nThe answer is: 2"]}), path)
    env = MathQAEnv(data_path=path)
    assert env.reset(3) == "What is 1 + 1?"
    assert env.step("2").reward == 1.0


def test_bad_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row 0"):
        MathQAEnv(data_path=_data(tmp_path, [{"prompt": "x"}]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no questions"):
        MathQAEnv(data_path=empty)


def test_use_before_reset_is_an_error() -> None:
    env = MathQAEnv()
    with pytest.raises(RuntimeError):
        env.step("1")
    with pytest.raises(RuntimeError):
        solve(env)
