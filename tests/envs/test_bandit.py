"""Bandit: exact prompt, seeded arm order and payout, success, matching.

See docs/architecture.md, "Environment API", and in "Deliberate differences from RAGEN" the items
"Bandit low arm" and "Reward text".
"""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.bandit import BanditEnv, format_reward, solve


def expected_prompt(a: str, b: str) -> str:
    """RAGEN's text written out by hand (trailing spaces after "pull.", "Rules:", "names.")."""
    return (
        "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
        "Game Rules: \n"
        f"1. There are 2 arms, named {a} and {b}\n"
        "2. Each arm has its own reward distribution, related to their names. \n"
        "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution"
        " might behave.\n"
        "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give"
        f" higher rewards on average? Choose between {a} and {b}, and output like <answer> {a} </answer>"
        f" or <answer> {b} </answer>.\n"
    )


def lo_first(seed: int) -> bool:
    """RAGEN's rule: the first uniform draw of the seeded generator below 0.5 lists the low arm first."""
    return bool(np.random.default_rng(seed).random() < 0.5)


def test_exact_prompt_for_both_orders() -> None:
    env = envs.make("Bandit")
    seed_lo = next(s for s in range(100) if lo_first(s))
    seed_hi = next(s for s in range(100) if not lo_first(s))
    assert env.reset(seed_lo) == expected_prompt("Phoenix", "Dragon")
    assert env.actions == ["Phoenix", "Dragon"]
    assert env.render() == expected_prompt("Phoenix", "Dragon")
    assert env.reset(seed_hi) == expected_prompt("Dragon", "Phoenix")
    assert env.actions == ["Dragon", "Phoenix"]
    test_env = envs.make("BanditTest")
    assert test_env.reset(seed_lo) == expected_prompt("Trader", "Librarian")
    assert test_env.hi_arm == "Librarian"


def test_arm_order_follows_the_seed_and_is_balanced() -> None:
    env = BanditEnv()
    firsts = []
    for seed in range(2000):
        env.reset(seed)
        assert (env.actions == ["phoenix", "dragon"]) == lo_first(seed)
        firsts.append(env.actions[0] == "phoenix")
    assert abs(np.mean(firsts) - 0.5) < 0.04
    # Same seed, same order in a fresh instance.
    other = BanditEnv()
    for seed in (3, 17, 99):
        env.reset(seed)
        other.reset(seed)
        assert env.actions == other.actions


def test_payoffs() -> None:
    env = envs.make("Bandit")
    hi_rewards = []
    for seed in range(4000):
        env.reset(seed)
        lo = env.step("Phoenix")
        assert lo.reward == 0.1 and lo.observation == "Phoenix: 0.1 points"
        env.reset(seed)
        hi = env.step("Dragon")
        assert hi.reward in (0.0, 1.0)
        assert hi.observation == f"Dragon: {hi.reward:.1f} points"
        # The payout is the second draw of the seeded generator.
        rng = np.random.default_rng(seed)
        rng.random()
        assert hi.reward == (1.0 if rng.random() < 0.25 else 0.0)
        assert hi.reward == env.hi_arm_payout
        hi_rewards.append(hi.reward)
    assert abs(np.mean(hi_rewards) - 0.25) < 0.025


def test_success_means_choosing_the_high_arm() -> None:
    env = envs.make("Bandit")
    for seed in range(50):
        env.reset(seed)
        hi = env.step("Dragon")
        assert hi.done and hi.info == {"success": True, "action_is_valid": True, "action_is_effective": True}
        env.reset(seed)
        lo = env.step("Phoenix")
        assert lo.done and lo.info == {"success": False, "action_is_valid": True, "action_is_effective": True}
        assert env.render() == lo.observation


def test_case_insensitive_match_and_invalid_action() -> None:
    env = envs.make("BanditTest")
    prompt = env.reset(5)
    bad = env.step("unicorn")
    assert bad.reward == 0.0 and not bad.done and bad.observation == prompt
    assert bad.info == {"success": False, "action_is_valid": False, "action_is_effective": False}
    assert env.step("Trader Librarian").info["action_is_valid"] is False
    res = env.step("  lIbRaRiAn ")
    assert res.done and res.info["success"] and res.observation.startswith("Librarian: ")
    # The game is over after one pull: a second one changes and pays nothing.
    again = env.step("trader")
    assert again.done and again.reward == 0.0 and not again.info["action_is_effective"]
    assert env.render() == res.observation


def test_configurable_low_arm_and_reward_format() -> None:
    env = envs.make("Bandit", lo_arm_score=0.15)  # the paper's value
    env.reset(0)
    res = env.step("phoenix")
    assert res.reward == 0.15 and res.observation == "Phoenix: 0.15 points"
    assert [format_reward(x) for x in (0.1, 1.0, 0.0, 0.15, 0.1 + 0.2, 2 / 3, -0.001, 10)] == [
        "0.1",
        "1.0",
        "0.0",
        "0.15",
        "0.3",
        "0.67",
        "0.0",
        "10.0",
    ]
    with pytest.raises(ValueError):
        BanditEnv(lo_arm_name="Dragon", hi_arm_name="dragon")


def test_oracle_always_succeeds() -> None:
    env = envs.make("Bandit")
    for seed in range(100):
        env.reset(seed)
        assert solve(env) == ["Dragon"] == [env.oracle_action()]
        assert env.step(solve(env)[0]).info["success"]
