"""Countdown: generated puzzles, scoring 1 / 0.1 / 0, the oracle, data files, hostile answers."""

from __future__ import annotations

import builtins
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.countdown import CountdownEnv, format_reward, generate_puzzle, score_answer, solve

NUMS = [3, 5, 2]
TARGET = 4


@pytest.mark.parametrize(
    ("answer", "reward", "valid"),
    [
        ("2 + 5 - 3", 1.0, True),
        ("5 - 3 + 2", 1.0, True),
        ("(5 * 2 - 3) - 3 + 3", 0.0, False),  # numbers used more than once
        ("  2+5-3  ", 1.0, True),
        ("2 + 5 - 3 = 4", 1.0, True),  # restated target is dropped
        ("2 + 5 - 3 = 5", 0.0, False),  # a different right side counts as a number
        ("2 + 5 = 7 - 3", 0.0, False),
        ("5 * 2 - 3", 0.1, True),  # right numbers, wrong value
        ("3 * 5 / 2", 0.1, True),  # non-integer value is simply wrong
        ("5 + 2 + 3 +", 0.1, False),  # right numbers, unparseable
        ("2 ** 5 - 3", 0.1, False),
        ("2 + 5", 0.0, False),  # a number missing
        ("2 + 5 - 3 + 1", 0.0, False),  # an extra number
        ("2 + 5 - 4", 0.0, False),  # a wrong number
        ("", 0.0, False),
        ("four", 0.0, False),
    ],
)
def test_scoring(answer: str, reward: float, valid: bool) -> None:
    scored = score_answer(answer, NUMS, TARGET)
    assert scored.reward == reward
    assert scored.valid == valid
    assert scored.success == (reward == 1.0)


def test_step_protocol() -> None:
    env = CountdownEnv()
    obs = env.reset(11)
    assert obs == f"Target: {env.target}, nums: {env.nums}"
    assert env.render() == obs
    assert env.actions is None
    result = env.step(env.solution)
    assert (result.reward, result.done) == (1.0, True)
    assert result.observation == "Your answer get 1.0 points."
    assert result.info == {"success": True, "action_is_valid": True, "action_is_effective": True}
    again = env.step(env.solution or "")
    assert again.reward == 0.0 and again.done and not again.info["success"]

    env.reset(11)
    wrong = " + ".join(str(n) for n in env.nums) + " + 0"
    result = env.step(wrong)
    assert (result.reward, result.done, result.observation) == (0.0, True, "Your answer get 0.0 points.")
    assert result.info == {"success": False, "action_is_valid": False, "action_is_effective": False}


def test_format_score_step(tmp_path: Path) -> None:
    env = CountdownEnv(data_path=_single_puzzle(tmp_path, NUMS, TARGET))
    env.reset(0)
    result = env.step("5 * 2 - 3")
    assert (result.reward, result.done) == (0.1, True)
    assert result.observation == "Your answer get 0.1 points."
    assert result.info == {"success": False, "action_is_valid": True, "action_is_effective": True}
    env.reset(0)
    result = env.step("5 + 2 + 3 +")
    assert result.reward == 0.1
    assert result.info == {"success": False, "action_is_valid": False, "action_is_effective": False}


def test_format_reward_has_at_most_two_decimals() -> None:
    assert [format_reward(r) for r in (1, 0.1, 0.0, 0.30000000000000004, 0.125)] == [
        "1.0",
        "0.1",
        "0.0",
        "0.3",
        "0.12",
    ]


def test_make_uses_the_catalogue() -> None:
    env = envs.make("Countdown")
    assert isinstance(env, CountdownEnv)
    assert env.env_type == "countdown"
    assert env.reset(5).startswith("Target: ")


def test_oracle_solves_500_generated_puzzles() -> None:
    env = CountdownEnv()
    for seed in range(500):
        env.reset(seed)
        assert 1 <= env.target <= 100
        assert len(env.nums) in (3, 4)
        assert all(1 <= n <= 100 for n in env.nums)
        stored = env.solution
        assert stored is not None
        assert score_answer(stored, env.nums, env.target).reward == 1.0
        found = solve(env.nums, env.target)
        assert found is not None
        assert env.step(found).reward == 1.0


def test_solve_reports_impossible_puzzles() -> None:
    assert solve([1, 1], 5) is None
    assert solve([], 3) is None
    assert solve([7], 7) == "7"
    assert solve([4, 6], 1) is None
    answer = solve([1, 3, 4, 6], 24)  # needs fractions: 6 / (1 - 3/4)
    assert answer is not None and score_answer(answer, [1, 3, 4, 6], 24).reward == 1.0


def test_generation_is_deterministic_and_varied() -> None:
    a = [generate_puzzle(seed) for seed in range(100)]
    b = [generate_puzzle(seed) for seed in range(100)]
    assert a == b
    assert len({(tuple(n), t) for n, t, _ in a}) >= 95
    env1, env2 = CountdownEnv(), CountdownEnv()
    assert [env1.reset(s) for s in range(20)] == [env2.reset(s) for s in range(20)]


def test_generator_config() -> None:
    env = CountdownEnv(num_count=4, min_number=1, max_number=20, max_target=50)
    for seed in range(50):
        env.reset(seed)
        assert len(env.nums) == 4 and all(1 <= n <= 20 for n in env.nums) and 1 <= env.target <= 50
    with pytest.raises(ValueError):
        CountdownEnv(min_number=5, max_number=2)


def test_data_file_mode(tmp_path: Path) -> None:
    rows = [
        {"target": 24, "nums": [1, 3, 4, 6]},
        {"target": 4, "nums": [3, 5, 2]},
        {"target": 5, "nums": [1, 1]},
    ]
    path = tmp_path / "countdown.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = envs.make("Countdown", data_path=str(path))
    assert env.reset(0) == "Target: 24, nums: [1, 3, 4, 6]"
    assert env.reset(4) == "Target: 4, nums: [3, 5, 2]"  # seed mod len
    assert env.step("2 + 5 - 3").reward == 1.0
    env.reset(2)
    assert env.solution is None  # unsolvable rows are kept; the oracle says so
    env.reset(3)
    assert env.solution is not None and env.step(env.solution).reward == 1.0

    limited = CountdownEnv(data_path=path, max_instances=1)
    assert limited.reset(1) == limited.reset(0)


def test_parquet_data_file(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "countdown.parquet"
    pq.write_table(pa.table({"target": [4], "nums": [[3, 5, 2]]}), path)
    env = CountdownEnv(data_path=path)
    assert env.reset(9) == "Target: 4, nums: [3, 5, 2]"


def test_bad_data_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"target": 3}\n')
    with pytest.raises(ValueError, match="row 0"):
        CountdownEnv(data_path=bad)
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        CountdownEnv(data_path=tmp_path / "x.csv")


def test_use_before_reset_is_an_error() -> None:
    env = CountdownEnv()
    with pytest.raises(RuntimeError):
        env.step("1 + 2")
    with pytest.raises(RuntimeError):
        env.render()


HOSTILE = [
    "__import__('os').system('touch {marker}')",
    "__import__('pathlib').Path('{marker}').touch()",
    "().__class__.__base__.__subclasses__()",
    "9**9**9",
    "(" * 10_000 + "1" + ")" * 10_000,
    "1+" * 500_000,
    "\u0669\u0668 + \u0667\u0663 / \u0669",  # Arabic-Indic 98 + 73 / 9
    "\uff19\uff18 + \uff17\uff13 / \uff19",  # full-width digits
    "98\x00 + 73\x00 / 9",  # right numbers and value, with NUL bytes
    "(98 + 73) / 9\x1b[2J",  # an escape sequence
]


@pytest.mark.parametrize("index", range(len(HOSTILE)))
def test_hostile_answers_score_zero_fast_and_run_nothing(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    answer = HOSTILE[index].format(marker=marker)
    env = CountdownEnv(data_path=_single_puzzle(tmp_path, [98, 73, 9], 19))
    env.reset(0)
    assert env.step("(98 + 73) / 9").reward == 1.0  # the puzzle is solvable; warms up the code path
    env.reset(0)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("scoring must never run code")

    for fn in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, fn, forbidden)
    start = time.perf_counter()
    result = env.step(answer)
    elapsed = time.perf_counter() - start
    assert result.reward == 0.0
    assert result.done and not result.info["success"] and not result.info["action_is_valid"]
    assert elapsed < 0.05, f"{elapsed * 1000:.1f} ms"
    assert not marker.exists()


def _single_puzzle(tmp_path: Path, nums: list[int], target: int) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"nums": nums, "target": target}) + "\n")
    return path


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120) | st.text(alphabet="3524 +-*/()=", max_size=40))
def test_scoring_arbitrary_text_never_raises(answer: str) -> None:
    scored = score_answer(answer, NUMS, TARGET)
    assert scored.reward in (0.0, 0.1, 1.0)
    assert scored.success == (scored.reward == 1.0)
    if scored.valid:
        assert scored.reward in (0.1, 1.0)
