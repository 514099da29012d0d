"""The learnability probe: its figures, its verdict, and the preflight check that runs it (tiny policies;
the real model's verdicts are tested in test_model_import.py)."""

from __future__ import annotations

import logging

import pytest

from ragen_core.config import load_config
from ragen_core.run.preflight import PreflightError, learnability_check
from ragen_core.run.probe import MIN_VARIED_GROUPS, probe, varied_group_share

# An untrained tiny policy (no warm start) on FrozenLake: it writes no valid answer.
UNTRAINED = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "model.corpus_seeds=2",
    "train.tags=[FrozenLake]",
    "train.n_groups=[4]",
    "train.group_size=4",
    "val.tags=[FrozenLake]",
    "agent.max_turn=2",
    "agent.enable_think=false",
    "rollout.max_new_tokens=8",
    "learner.optim.mini_batch_size=4",
    "learner.optim.micro_batch_size=4",
    "sft=null",
]


def test_varied_group_share_is_one_minus_the_chance_that_a_group_scores_alike():
    assert varied_group_share([0.0] * 10, 8) == 0.0
    assert varied_group_share([0.0, 1.0], 2) == pytest.approx(1 - 2 * 0.5**2)
    assert varied_group_share([0.0, 0.0, 0.0, 1.0], 8) == pytest.approx(1 - 0.75**8 - 0.25**8)
    assert varied_group_share([], 8) == 0.0


def test_an_untrained_policy_is_a_no_go_that_advises_constrained_decoding():
    result = probe(load_config(None, UNTRAINED), groups=2)
    m = result.metrics
    assert not result.go and m["probe/go"] == 0.0
    assert m["probe/valid_answer_share"] < 0.2 and m["probe/varied_group_share"] == 0.0
    assert 0.0 <= m["probe/action_mass"] < 0.2
    assert "RL has nothing to reinforce" in result.reason
    assert any("agent.action_decoding=constrained" in a for a in result.advice)
    assert result.lines()[0].startswith("NO-GO")


def test_constrained_decoding_makes_every_answer_valid_and_the_groups_vary():
    result = probe(load_config(None, [*UNTRAINED, "agent.action_decoding=constrained"]), groups=2)
    m = result.metrics
    assert m["probe/valid_answer_share"] == 1.0
    assert result.go == (m["probe/varied_groups_per_iteration"] >= MIN_VARIED_GROUPS)
    assert not any("constrained" in a for a in result.advice)


def test_preflight_probe_warns_or_stops_as_the_config_asks(caplog):
    with pytest.raises(
        PreflightError, match=r"(?s)no-go \(trainer\.probe=error\).*RL has nothing to reinforce"
    ):
        learnability_check(load_config(None, [*UNTRAINED, "trainer.probe=error"]))
    with caplog.at_level(logging.WARNING, logger="ragen.progress"):
        learnability_check(load_config(None, UNTRAINED))  # warn: logs, does not raise
    assert "learnability probe (trainer.probe=warn" in caplog.text
    assert "random valid answers" not in caplog.text  # chance is `ragen probe`'s alone: no run start pays it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ragen.progress"):
        learnability_check(load_config(None, [*UNTRAINED, "trainer.probe=off"]))
        # a warm start changes the policy the probe would judge: never probed
        learnability_check(load_config(None, [*UNTRAINED[:-1], "sft.tags=[FrozenLake]"]))
    assert caplog.text == ""


def test_preflight_names_an_action_the_tokenizer_cannot_spell():
    from ragen_core.run.preflight import spelling_problems

    class NoRight:
        """A tokenizer without the letters of 'Right' (its encoding is the unknown token)."""

        unk_token_id = 0
        eos_token = "<|im_end|>"

        def convert_tokens_to_ids(self, token):
            return 1

        def encode(self, text, add_special_tokens=False):
            return [0] if "Right" in text else [5 + len(text)]

    cfg = load_config(None, [*UNTRAINED, "agent.action_decoding=constrained"])
    (problem,) = spelling_problems(cfg, NoRight())
    assert problem.startswith(
        "FrozenLake: agent.action_decoding=constrained: the tokenizer cannot spell 'Right'"
    )
    assert spelling_problems(load_config(None, UNTRAINED), NoRight()) == []  # free decoding: no check


def test_a_go_without_any_success_says_the_rewards_differ_by_step_rewards_alone():
    from ragen_core.run.probe import ProbeResult

    metrics = {
        "probe/valid_answer_share": 1.0,
        "probe/turns": 48.0,
        "probe/varied_group_share": 0.75,
        "probe/varied_group_share_pooled": 0.56,
        "probe/groups": 4.0,
        "probe/group_size": 4.0,
        "probe/varied_groups_per_iteration": 12.0,
        "probe/n_groups": 16.0,
        "probe/success": 0.0,
        "probe/score_mean": -0.8,
    }
    assert any(
        line.startswith("  caution: no episode succeeded") for line in ProbeResult(metrics, True, "r").lines()
    )
    metrics["probe/success"] = 0.1
    assert not any("caution" in line for line in ProbeResult(metrics, True, "r").lines())


def test_chance_success_plays_random_valid_answers_through_the_turns_and_the_parser():
    """A reference walk of the same boards: each turn, every live env in order draws its random answer
    from the one generator and steps it action by action, until a hole or the goal or the last turn."""
    import random

    import envs
    from ragen_core.env_groups import EnvGroups
    from ragen_core.run.probe import chance_success

    cfg = load_config(None, [*UNTRAINED, "agent.max_turn=3", "agent.max_actions_per_turn=3"])
    groups = EnvGroups(cfg.val.model_copy(update={"n_groups": [3], "group_size": 2}), cfg.agent, mode="val")
    seeds = groups.seeds_for(0)
    rng, wins, played = random.Random(5), 0, 0
    for _ in range(40):  # 40 plays of 6 envs: 240 episodes
        lakes = [envs.make("FrozenLake", **cfg.val.env_overrides.get("FrozenLake", {})) for _ in seeds]
        for lake, seed in zip(lakes, seeds, strict=True):
            lake.reset(seed)
        live = list(range(len(lakes)))
        for _ in range(3):
            for i in list(live):
                for action in lakes[i].random_answer([], 3, rng):
                    if lakes[i].step(action).done:
                        live.remove(i)
                        break
        wins += sum(lake.success for lake in lakes)
        played += len(lakes)
    assert chance_success(groups, episodes=240, seed=5) == wins / played
    assert 0.0 < wins / played < 0.5  # random walks sometimes reach the goal, mostly not
    assert chance_success(groups, episodes=240, seed=5) == chance_success(groups, episodes=240, seed=5)


def test_a_policy_no_better_than_random_answers_is_told_it_does_not_read_the_state():
    from ragen_core.run.probe import ProbeResult

    metrics = {
        "probe/valid_answer_share": 1.0,
        "probe/turns": 48.0,
        "probe/varied_group_share": 0.5,
        "probe/varied_group_share_pooled": 0.6,
        "probe/groups": 4.0,
        "probe/group_size": 4.0,
        "probe/varied_groups_per_iteration": 8.0,
        "probe/n_groups": 16.0,
        "probe/success": 0.0625,
        "probe/score_mean": 0.0625,
        "probe/chance_success": 0.106,
        "probe/chance_success_val": 0.124,
    }
    lines = ProbeResult(metrics, True, "r").lines()
    assert (
        "  chance               0.106 success of random valid answers on these episodes, 0.124 on the "
        "validation episodes" in lines
    )
    assert any(
        line.startswith("  caution: the policy succeeds no more often than random valid answers")
        for line in lines
    )
    metrics["probe/success"] = 0.25
    assert not any("caution" in line for line in ProbeResult(metrics, True, "r").lines())
