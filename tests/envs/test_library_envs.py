"""Environments from maintained libraries: reasoning-gym (single answer) and textarena (multi-turn games).

They need the ``envlibs`` extra. Without it the library tests skip, saying so, except where
``RAGEN_REQUIRE_ENVLIBS=1`` (``make test``, hence CI), where a missing library fails them. The tests of
the adapters' own error paths run without the libraries.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest

import envs
from envs.adapters import MissingLibraryError, import_library
from envs.base import Env
from envs.oracles import oracle_actions
from tests.envs.test_env_hooks import record

RG_TAGS = ["RG-Arithmetic", "RG-Countdown", "RG-MiniSudoku"]
TA_TAGS = ["TA-2048", "TA-2048-16", "TA-GuessTheNumber", "TA-GuessTheNumber-15"]
SUMS = {
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    }
}


def _need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    msg = f"{package} is not installed (the envlibs extra: pip install 'ragen-flow[envlibs]')"
    if os.environ.get("RAGEN_REQUIRE_ENVLIBS") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def rg() -> None:
    _need("reasoning_gym", "reasoning-gym")


@pytest.fixture
def ta() -> None:
    _need("textarena", "textarena")


def _lib(tag: str) -> tuple[str, str]:
    return ("reasoning_gym", "reasoning-gym") if tag.startswith("RG-") else ("textarena", "textarena")


# Registry and hooks ------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", RG_TAGS + TA_TAGS)
def test_library_tags_are_registered_and_build(tag: str) -> None:
    _need(*_lib(tag))
    assert tag in envs.catalogue_tags()
    assert tag not in envs.registry.default_corpus_tags()  # the existing tiny tokenizers stay as they were
    env = envs.make(tag)
    state = env.reset(seed=1)
    assert isinstance(state, str) and state
    assert env.render() == state
    cls = type(env)
    assert cls.success_means is not Env.success_means
    assert cls.success_means.endswith(".") and cls.success_means[0].islower()


@pytest.mark.parametrize("tag", RG_TAGS + TA_TAGS)
def test_hooks_of_library_envs_are_deterministic(tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start's hooks (oracle, think text, random answers) played as the builtin envs' golden
    test plays them: twice the same, whatever the global ``random`` state in between."""
    _need(*_lib(tag))
    monkeypatch.setattr("tests.envs.test_env_hooks.TAGS", [tag])
    hooks = (
        oracle_actions,
        lambda env, actions: env.think_text(actions),
        lambda env, plan, cap, rng: env.random_answer(plan, cap, rng),
    )
    first = record(*hooks)
    random.seed(12345)
    assert record(*hooks) == first
    assert all(turn["oracle/5/5"] for ep in first for turn in ep["turns"][:1])


def test_missing_library_names_the_extra() -> None:
    with pytest.raises(MissingLibraryError, match=r"ragen-flow\[envlibs\]") as err:
        import_library("no_such_library_xyz", "no-such-library", "reasoning_gym")
    assert "no-such-library" in str(err.value)


def test_available_checks_the_library_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert envs.available("Bandit")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert not envs.available("RG-Arithmetic") and not envs.available("TA-2048")
    assert envs.available("Bandit")  # a builtin needs nothing beyond ragen-flow


def test_adapters_do_not_import_their_library_until_built() -> None:
    import subprocess

    code = (
        "import sys, envs; envs.registry.env_class('reasoning_gym'); envs.registry.env_class('textarena');"
        "print('reasoning_gym' in sys.modules, 'textarena' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# reasoning-gym ---------------------------------------------------------------------------------------
def test_rg_same_seed_same_item_in_a_new_env(rg: None) -> None:
    a, b = envs.make("RG-Arithmetic"), envs.make("RG-Arithmetic")
    assert [a.reset(s) for s in range(5)] == [b.reset(s) for s in range(5)]
    assert len({a.reset(s) for s in range(20)}) > 10  # different seeds, different items
    other = envs.make("RG-Arithmetic", dataset_seed=1)
    assert other.reset(3) == a.reset(4)  # reasoning-gym draws item i from Random(dataset_seed + i)


def test_rg_reward_is_the_librarys_score(rg: None) -> None:
    import reasoning_gym

    for tag, dataset in [("RG-Arithmetic", "basic_arithmetic"), ("RG-MiniSudoku", "mini_sudoku")]:
        env = envs.make(tag)
        data = reasoning_gym.create_dataset(dataset, seed=0, size=100_000)
        for seed in range(6):
            env.reset(seed)
            entry = data[seed]
            right = entry["answer"]
            wrong_cell = right.replace("1", "2", 1)  # sudoku: partial credit
            for answer in [right, "7", wrong_cell, f"  {right}  "]:
                env.reset(seed)
                res = env.step(answer)
                want = float(data.score_answer(answer, entry))
                assert res.reward == want, (tag, seed, answer)
                assert res.done and res.info["success"] == (want == 1.0)
                assert res.info["action_is_valid"]


def test_rg_sudoku_partial_credit_is_not_success(rg: None) -> None:
    env = envs.make("RG-MiniSudoku")
    env.reset(0)
    (right,) = oracle_actions(env, 1, 1, 1)
    rows = right.split("\n")
    swapped = "\n".join([rows[1], rows[0], *rows[2:]])
    res = env.step(swapped)
    assert 0.0 < res.reward < 1.0 and not res.info["success"]


@pytest.mark.parametrize("answer", ["", "   ", "1" * 5000, "\x00\x01", "<answer>", "NaN"])
def test_rg_malformed_answers_score_zero(rg: None, answer: str) -> None:
    env = envs.make("RG-Arithmetic", **SUMS)
    env.reset(0)
    res = env.step(answer)
    assert res.reward == 0.0 and res.done and not res.info["success"]
    assert env.step("5").reward == 0.0  # one answer per item


def test_rg_a_scorer_that_raises_scores_zero(rg: None, monkeypatch: pytest.MonkeyPatch) -> None:
    env = envs.make("RG-Arithmetic")
    env.reset(0)

    def broken(answer: str, entry: dict) -> float:
        raise IndexError("library bug")

    monkeypatch.setattr(env.data, "score_answer", broken)  # type: ignore[attr-defined]
    res = env.step("3")
    assert res.reward == 0.0 and not res.info["action_is_valid"]


def test_rg_bad_settings_name_the_dataset(rg: None) -> None:
    with pytest.raises(ValueError, match="no_such_dataset"):
        envs.make("RG-Arithmetic", dataset="no_such_dataset")
    with pytest.raises(ValueError, match="dataset_seed"):
        envs.make("RG-Arithmetic", config={"seed": 3})
    with pytest.raises(ValueError, match="basic_arithmetic"):
        envs.make("RG-Arithmetic", config={"min_terms": 0})


# textarena --------------------------------------------------------------------------------------------
def _play(env: Env, seed: int, moves: list[str]) -> list[tuple[str, float, bool, dict]]:
    out: list[tuple[str, float, bool, dict]] = [(env.reset(seed), 0.0, False, {})]
    for move in moves:
        r = env.step(move)
        out.append((r.observation, r.reward, r.done, r.info))
        if r.done:
            break
    return out


def test_ta_same_seed_same_game_whatever_else_draws_from_random(ta: None) -> None:
    moves = ["Down", "Left", "Down", "Right", "Up", "Left"] * 3
    a = envs.make("TA-2048")
    first = _play(a, 7, moves)
    random.seed(999)
    state = random.getstate()
    b = envs.make("TA-2048")
    assert _play(b, 7, moves) == first
    assert random.getstate() == state  # the caller's generator is left alone
    assert _play(a, 8, moves)[0][0] != first[0][0]
    # interleaved episodes do not disturb each other
    a.reset(7)
    b.reset(7)
    for move in moves[:6]:
        assert a.step(move) == b.step(move)


def test_ta_reward_is_the_games_own(ta: None) -> None:
    """Replaying our moves in textarena's own environment (its make, wrappers and all) gives the same
    end and the same reward."""
    import textarena

    env = envs.make("TA-2048-16")
    for seed in range(4):
        env.reset(seed)
        moves: list[str] = []
        done, reward = False, 0.0
        for _ in range(60):
            plan = oracle_actions(env, 60, 1, 1) or ["Up"]
            moves.append(plan[0])
            r = env.step(plan[0])
            if r.done:
                done, reward = True, r.reward
                break
        assert done
        theirs = textarena.make("2048-v0", target_tile=16)
        theirs.reset(num_players=1, seed=seed)
        for move in moves:
            their_done, _ = theirs.step(action=f"[{move}]")
        rewards, _ = theirs.close()
        assert their_done and rewards[0] == reward


def test_ta_oracle_wins_more_than_random_moves(ta: None) -> None:
    """TA-2048-16 as the protocol plays it: 4 turns of up to 3 moves, 12 moves in all."""

    def rate(policy: str) -> float:
        env = envs.make("TA-2048-16")
        wins = 0
        for seed in range(200):
            env.reset(seed)
            rng, left = random.Random(seed), 12
            for turn in range(4):
                if policy == "oracle":
                    plan = oracle_actions(env, left, 3, 4 - turn)
                else:
                    plan = [rng.choice(env.actions or []) for _ in range(min(3, left))]
                assert len(plan) == min(3, left)
                results = []
                for move in plan:
                    results.append(env.step(move))
                    if results[-1].done:
                        break
                left -= len(results)
                if results[-1].done:
                    wins += results[-1].info["success"]
                    break
        return wins / 200

    assert (rate("oracle"), rate("random")) == (0.635, 0.265)  # measured; a change here moves the config


def test_ta_malformed_and_invalid_moves(ta: None) -> None:
    env = envs.make("TA-2048")
    first = env.reset(0)
    for junk in ["Jump", "", "[Up]", "up down"]:
        r = env.step(junk)  # not in the vocabulary: nothing happens, the game never sees it
        assert (r.observation, r.reward, r.done, r.info["action_is_valid"]) == (first, 0.0, False, False)
    # a slide that moves nothing is invalid in the game itself; a second one in a row ends it
    env.reset(0)
    stuck: list[str] = []
    for _ in range(20):
        board = env.game.state.game_state["board"]  # type: ignore[attr-defined]
        stuck = [m for m in ("Up", "Down", "Left", "Right") if _slides_nothing(board, m)]
        if stuck:
            break
        assert env.step("Up").info["action_is_valid"]
    assert stuck, "no position with a move that slides nothing after 20 moves Up"
    r = env.step(stuck[0])
    assert not r.info["action_is_valid"] and not r.done and "invalid move" in r.observation
    r = env.step(stuck[0])
    assert r.done and not r.info["success"] and not r.info["action_is_valid"]
    assert env.step("Down").info["action_is_valid"] is False  # after the end, nothing


def _slides_nothing(board: list[list[int]], move: str) -> bool:
    from envs.adapters.textarena import slide_2048

    return slide_2048(board, move) == board


def test_ta_free_text_game_binary_search_wins(ta: None) -> None:
    env = envs.make("TA-GuessTheNumber")
    for seed in range(10):
        assert env.reset(seed) == "The game waits for your first move."
        for _ in range(10):
            (guess,) = oracle_actions(env, 10, 1, 1)
            r = env.step(guess)
            if r.done:
                break
        assert r.done and r.info["success"] and r.reward == 1.0
    env.reset(0)
    r = env.step("[7]")  # already bracketed: sent as it is
    assert r.info["action_is_valid"]
    r = env.step("x" * 2000)
    assert not r.info["action_is_valid"] and r.reward == 0.0


def test_ta_guess_15_binary_search_wins_in_4_and_bad_guesses_do_not_raise(ta: None) -> None:
    """TA-GuessTheNumber-15 (configs/textarena-guess-tiny.yaml): 1-15 in 4 guesses; binary search always wins."""
    env = envs.make("TA-GuessTheNumber-15")
    for seed in range(100):
        env.reset(seed)
        for turn in range(4):
            (guess,) = oracle_actions(env, 4 - turn, 1, 4 - turn)
            assert 1 <= int(guess) <= 15
            r = env.step(guess)
            if r.done:
                break
        assert r.done and r.info["success"] and r.reward == 1.0, seed
    # textarena ends the game on the guess after its max_turns-th: max_turns 3 is 4 guesses, so a lost
    # game ends on the 4th with the game's partial credit (the last guess's closeness), not at 0 by budget
    env.reset(0)
    target = env.game.state.game_state["game_number"]  # type: ignore[attr-defined]
    wrong = [str(n) for n in range(1, 16) if n != target][:4]
    results = [env.step(g) for g in wrong]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].reward == 1 - abs(int(wrong[-1]) - target) / 14 and not results[-1].info["success"]
    # binary_reward: the same game pays 0 for the loss and 1.0 for a win
    binary = envs.make("TA-GuessTheNumber-15", binary_reward=True)
    binary.reset(0)
    assert [binary.step(g).reward for g in wrong] == [0.0, 0.0, 0.0, 0.0]
    binary.reset(0)
    won = binary.step(str(target))
    assert won.done and won.info["success"] and won.reward == 1.0
    for junk in ["0", "16", "-3", "abc", "", "7.5", "x" * 2000]:
        env.reset(1)
        r = env.step(junk)  # out of range or malformed: invalid, no reward, no exception
        assert not r.info["action_is_valid"] and r.reward == 0.0 and not r.info["success"], junk


def test_ta_bad_settings_are_named(ta: None) -> None:
    with pytest.raises(ValueError, match="Did you mean 2048-v0"):
        envs.make("TA-2048", env_id="2048-v9")
    with pytest.raises(ValueError, match="bad game_kwargs"):
        envs.make("TA-2048", game_kwargs={"no_such": 1})
    with pytest.raises(ValueError, match="single-player"):
        envs.make("TA-2048", env_id="TicTacToe-v0", actions=None).reset(0)


def test_the_docs_example_tag_builds_and_scores(rg: None) -> None:
    """docs/environments.md's "Environments from libraries" adds a dataset in one catalogue entry."""
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    section = doc.split("## Environments from libraries", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    ((tag, entry),) = yaml.safe_load(block).items()
    envs.register_tag(envs.EnvSpec(tag=tag, **entry))
    env = envs.make(tag)
    assert "Greatest Common Divisor" in env.reset(0)
    assert env.step(oracle_actions(env, 1, 1, 1)[0]).info["success"]
