"""Env groups (RAGEN's es_manager): layout, seeds, budget, termination, metrics.

See docs/architecture.md, "Env groups and seeds" and "Agent text protocol".
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from pydantic import ValidationError

from envs.base import Env, StepResult, invalid_step
from envs.registry import EnvSpec
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig, GroupsConfig
from ragen_core.protocol import ProtocolConfig


class LineEnv(Env):
    """A corridor ``0..9``; start ``seed % 8``; goal at 9. Each move -0.1, +1 more on the goal
    (done, success). ``Fall`` ends the episode without success; ``Stay`` does nothing."""

    env_type: ClassVar[str] = "line"
    GOAL = 9

    def __init__(self) -> None:
        self.actions = ["Left", "Right", "Stay", "Fall"]
        self.grid_vocab = {"P": "player", "G": "goal", "_": "floor"}
        self.pos = 0
        self.done = False
        self.steps: list[str] = []

    def reset(self, seed: int) -> str:
        self.pos, self.done, self.steps = seed % 8, False, []
        return self.render()

    def step(self, action: str) -> StepResult:
        i = self.match_action(action)
        if i is None:
            return invalid_step(self.render())
        name = self.actions[i]
        self.steps.append(name)
        if name == "Fall":
            self.done = True
            return StepResult(
                "fell", -1.0, True, {"success": False, "action_is_valid": True, "action_is_effective": True}
            )
        old = self.pos
        self.pos = min(self.GOAL, max(0, self.pos + {"Left": -1, "Right": 1, "Stay": 0}[name]))
        reward = -0.1 + (1.0 if self.pos == self.GOAL else 0.0)
        self.done = self.pos == self.GOAL
        info = {
            "success": self.done,
            "action_is_valid": True,
            "action_is_effective": self.pos != old,
            "extra": 2,
        }
        return StepResult(self.render(), reward, self.done, info)

    def render(self) -> str:
        return "".join("P" if i == self.pos else ("G" if i == self.GOAL else "_") for i in range(10))


class EchoEnv(Env):
    """Free text: success iff the answer is ``str(seed % 10)``; one answer per episode."""

    env_type: ClassVar[str] = "echo"

    def __init__(self) -> None:
        self.actions = None
        self.seed = 0
        self.obs = ""

    def reset(self, seed: int) -> str:
        self.seed, self.obs = seed, f"Say {seed % 10}"
        return self.obs

    def step(self, action: str) -> StepResult:
        ok = action.strip() == str(self.seed % 10)
        self.obs = "right" if ok else "wrong"
        return StepResult(
            self.obs,
            1.0 if ok else 0.0,
            True,
            {"success": ok, "action_is_valid": True, "action_is_effective": True},
        )

    def render(self) -> str:
        return self.obs


SPECS = {
    "Line": EnvSpec(
        tag="Line", env_type="line", env_instruction="Walk right.", max_actions_per_traj=4, max_tokens=50
    ),
    "Echo": EnvSpec(
        tag="Echo", env_type="echo", env_instruction="Echo.", max_actions_per_traj=1, max_tokens=20
    ),
}


def make_fake(tag: str, **overrides: Any) -> Env:
    env: Env = LineEnv() if SPECS[tag].env_type == "line" else EchoEnv()
    env.tag = tag  # type: ignore[attr-defined]
    env.spec = SPECS[tag]  # type: ignore[attr-defined]
    return env


def groups(
    tags: list[str],
    n_groups: list[int],
    group_size: int,
    mode: str = "train",
    seed: int | None = None,
    **proto: Any,
) -> EnvGroups:
    cfg = EnvGroupsConfig(tags=tags, n_groups=n_groups, group_size=group_size, seed=seed)
    return EnvGroups(cfg, ProtocolConfig(**proto), mode=mode, make_env=make_fake)  # type: ignore[arg-type]


def answer(*actions: str) -> str:
    return "<think>ok</think><answer>" + " || ".join(actions) + "</answer>"


# ------------------------------------------------------------------------------- config
def test_config_defaults_are_ragen_train() -> None:
    c = EnvGroupsConfig()
    assert (c.tags, c.n_groups, c.group_size, c.num_groups, c.num_envs) == (
        ["SimpleSokoban"],
        [8],
        16,
        8,
        128,
    )
    assert c.base_seed("train") == 10000 and c.base_seed("val") == 123
    assert EnvGroupsConfig(seed=7).base_seed("val") == 7
    assert GroupsConfig is EnvGroupsConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tags": ["A", "B"], "n_groups": [1]},
        {"tags": [], "n_groups": []},
        {"group_size": 0},
        {"n_groups": [0]},
        {"env_groups": 9},
        {"env_overrides": {"Other": {}}},
        {"bogus": 1},
    ],
)
def test_config_rejects(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        EnvGroupsConfig(**kwargs)


def test_unknown_tag_names_the_catalogue() -> None:
    with pytest.raises(KeyError, match="Known tags"):
        EnvGroups(EnvGroupsConfig(tags=["NoSuchTag"], n_groups=[1], group_size=1))


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        groups(["Line"], [1], 1, mode="test")


# ------------------------------------------------------------------------------- layout, seeds
def test_layout_is_contiguous_by_tag() -> None:
    g = groups(["Line", "Echo"], [2, 1], 3)
    assert len(g) == 9 and g.env_ids == list(range(9))
    assert [g.tag(i) for i in range(9)] == ["Line"] * 6 + ["Echo"] * 3
    assert [g.group_id(i) for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({id(g.env(i)) for i in range(9)}) == 9  # one instance per env, built once
    envs_before = [g.env(i) for i in range(9)]
    g.reset(0)
    g.reset(1)
    assert [g.env(i) for i in range(9)] == envs_before


def test_train_seeds_per_iteration() -> None:
    g = groups(["Line", "Echo"], [2, 1], 2)  # P = 3
    assert g.reset(0) == [10000, 10000, 10001, 10001, 10002, 10002]
    assert g.reset(5) == [10015, 10015, 10016, 10016, 10017, 10017]
    assert g.reset() == [10018, 10018, 10019, 10019, 10020, 10020]  # counter continues from 5
    g2 = groups(["Line"], [2], 2)
    assert g2.reset() == [10000, 10000, 10001, 10001]
    assert g2.reset() == [10002, 10002, 10003, 10003]
    assert g2.seeds_for(10) == [10020, 10020, 10021, 10021]
    with pytest.raises(ValueError):
        g2.reset(-1)


def test_val_seeds_are_fixed() -> None:
    g = groups(["Line"], [3], 1, mode="val")
    assert g.reset(0) == [123, 124, 125]
    assert g.reset(7) == [123, 124, 125]
    assert g.reset() == [123, 124, 125]
    assert groups(["Line"], [2], 2, seed=40, mode="val").reset(3) == [40, 40, 41, 41]


def test_group_members_share_the_initial_state() -> None:
    g = groups(["Line"], [2], 3)
    g.reset(0)
    states = [g.history(i)[0].state for i in g.env_ids]
    assert states[0] == states[1] == states[2] != states[3] == states[4] == states[5]


# ------------------------------------------------------------------------------- turns
def test_first_prompt() -> None:
    g = groups(["Line"], [1], 1, seed=2)
    g.reset(0)
    msgs = g.messages(0)
    assert msgs[0] == {"role": "system", "content": "You're a helpful assistant. "}
    assert msgs[1]["content"] == (
        "Walk right.\nThe meaning of each symbol in the state is:\nP: player, G: goal, _: floor"
        '\nYour available actions are:\nLeft, Right, Stay, Fall\nYou can make up to 4 actions, separated by the action separator " || "\n'
        "\nTurn 1:\nState:\n__P______G\nYou have 4 actions left. Always output: <think> [Your thoughts] </think> "
        "<answer> [your answer] </answer> with no extra text. Strictly follow this format. Max response length: 50 words (tokens).\n"
    )
    assert g.prefix(0).startswith("Walk right.") and g.max_tokens(0) == 50


def test_budget_truncation_and_drop_out() -> None:
    g = groups(["Line"], [1], 2, seed=0)  # start 0: the goal is 9 moves away, budget 4
    g.reset(0)
    out = g.step({0: answer("Right", "Right", "Right"), 1: answer("Stay")})
    assert out[0].actions == ["Right"] * 3 and out[0].actions_left == 1 and not out[0].done
    assert out[0].reward == pytest.approx(-0.3) and out[0].penalty == 0.0
    assert g.active_ids() == [0, 1]
    out = g.step({0: answer("Right", "Right", "Right"), 1: answer("Stay")})
    assert out[0].actions == ["Right"]  # truncated to the remaining budget
    assert out[0].done and out[0].end_reason == "budget" and not out[0].success
    assert g.env(0).steps == ["Right"] * 4
    assert g.active_ids() == [1]
    with pytest.raises(ValueError, match="not active"):
        g.step({0: answer("Right")})
    with pytest.raises(ValueError, match="not active"):
        g.step({5: answer("Right")})
    (summary,) = [s for s in g.trajectories() if s.env_id == 0]
    assert summary.truncated and not summary.terminated and summary.num_actions == 4 and summary.turns == 2
    assert summary.actions == [["Right"] * 3, ["Right"]]


def test_stop_at_first_done_and_success() -> None:
    g = groups(["Line"], [1], 1, seed=7)  # start 7: two Rights reach the goal
    g.reset(0)
    out = g.step({0: answer("Right", "Right", "Left", "Right")})[0]
    assert out.actions == ["Right", "Right"] and out.done and out.success and out.end_reason == "done"
    assert out.reward == pytest.approx(-0.1 + 0.9)
    assert out.info["success"] is True
    assert g.env(0).steps == ["Right", "Right"]
    s = g.trajectories()[0]
    assert s.success and s.terminated and not s.truncated and s.score == pytest.approx(0.8)
    # the final observation is recorded, and training messages end with the last assistant turn
    assert g.history(0)[-1].state == "_________P" and g.history(0)[-1].actions_left == 2
    assert g.messages(0, for_generation=False)[-1] == {
        "role": "assistant",
        "content": "<think>ok</think><answer>Right || Right || Left || Right</answer>",
    }


def test_env_done_without_success() -> None:
    g = groups(["Line"], [1], 1, seed=3)
    g.reset(0)
    out = g.step({0: answer("Fall", "Right")})[0]
    assert out.actions == ["Fall"] and out.done and not out.success and out.reward == -1.0
    s = g.trajectories()[0]
    assert s.terminated and not s.truncated and not s.success


def test_format_penalty_and_invalid_names() -> None:
    g = groups(["Line"], [1], 4, seed=0, format_penalty=-0.25)
    g.reset(0)
    out = g.step(
        {
            0: answer("Right", "Jump"),  # unknown name: skipped, penalty charged, Right still runs
            1: "<think>no answer",  # nothing parsable
            2: answer("right", "RIGHT"),  # case-insensitive, fine
            3: answer(),  # empty answer
        }
    )
    assert out[0].actions == ["Right"] and out[0].penalty == -0.25 and out[0].parsed.n_dropped == 1
    assert out[1].actions == [] and out[1].penalty == -0.25 and out[1].info == {}
    assert out[2].actions == ["Right", "Right"] and out[2].penalty == 0.0
    assert out[3].actions == [] and out[3].penalty == -0.25
    assert g.history(1)[0].response == "<think>no answer"  # raw text kept when nothing matched
    assert g.history(1)[0].raw_response == "<think>no answer"
    assert g.history(0)[0].format_ok is False and g.history(2)[0].format_ok is True
    assert [s.format_penalty for s in g.trajectories()] == [-0.25, -0.25, 0.0, -0.25]
    # a turn that executed nothing leaves the budget and the state alone
    assert g.history(1)[1].actions_left == 4 and g.history(1)[1].state == g.history(1)[0].state


def test_max_turn_ends_the_episode() -> None:
    g = groups(["Line"], [1], 1, seed=0, max_turn=2)
    g.reset(0)
    assert not g.step({0: answer("Stay")})[0].done
    out = g.step({0: answer("Stay")})[0]
    assert out.done and out.end_reason == "max_turn" and out.turn == 2
    assert g.active_ids() == []
    s = g.trajectories()[0]
    assert s.truncated and not s.success and s.turns == 2


def test_step_before_reset() -> None:
    g = groups(["Line"], [1], 1)
    with pytest.raises(RuntimeError):
        g.step({0: answer("Right")})


def test_reset_clears_the_episode() -> None:
    g = groups(["Line"], [1], 1, seed=7)
    g.reset(0)
    g.step({0: answer("Right", "Right")})
    assert g.active_ids() == []
    g.reset(0)
    assert g.active_ids() == [0] and len(g.history(0)) == 1 and g.trajectories()[0].turns == 0


def test_free_text_env() -> None:
    g = groups(["Echo"], [2], 1, seed=4, enable_think=False)  # seeds 4, 5
    g.reset(0)
    out = g.step({0: "<answer> 4 </answer>", 1: "<answer>4</answer>"})
    assert out[0].success and out[0].reward == 1.0 and out[0].actions == ["4"]
    assert not out[1].success and out[1].done
    assert g.active_ids() == []
    assert g.messages(0)[-1]["content"].startswith("Reward:\n1.0\n\nTurn 2:\nState:\nright\n")


def test_context_window_messages() -> None:
    g = groups(["Line"], [1], 1, seed=0, max_context_window=1)
    g.reset(0)
    g.step({0: answer("Right")})
    msgs = g.messages(0)
    assert len(msgs) == 2  # the window holds only the pending turn, numbered 1
    assert msgs[1]["content"].endswith(
        "\nTurn 1:\nState:\n_P_______G\n" + msgs[1]["content"].split("G\n", 1)[1]
    )
    assert "\nTurn 1:\nState:\n_P_______G\nYou have 3 actions left" in msgs[1]["content"]
    assert "Reward" not in msgs[1]["content"]


# ------------------------------------------------------------------------------- metrics
def test_metrics_hand_made() -> None:
    """Line: 2 groups x 2 (starts 7 and 0). Echo: 1 group x 2 (seed 9 -> answer '9')."""
    g = groups(["Line", "Echo"], [2, 1], 2, seed=7)  # Line seeds 7, 8 (start 7, 0); Echo seed 9
    g.reset(0)
    # env 0: solves in one turn (2 actions). env 1: Stay then Jump-only turn, then max_turn.
    # env 2, 3 (start 0): two turns of Right, Right -> budget exhausted.
    out = g.step(
        {
            0: answer("Right", "Right"),
            1: answer("Stay"),
            2: answer("Right", "Right"),
            3: answer("Right", "Jump"),
            4: answer("9"),
            5: answer("1"),
        }
    )
    assert out[0].success and out[4].success and not out[5].success
    assert sorted(g.active_ids()) == [1, 2, 3]
    g.step({1: answer("Jump"), 2: answer("Right", "Right"), 3: answer("Right", "Right", "Right")})
    assert g.active_ids() == [1]
    metrics = g.metrics()
    # per env: success, num_actions, action_is_valid = sum/turns, action_is_effective = sum/turns
    # env0: 1, 2, 1/1, 1/1       env1: 0, 1, 1/2 (Jump turn ran nothing), 0/2 (Stay)
    # env2: 0, 4, 2/2, 2/2       env3: 0, 4 (1 + 3 truncated), 2/2, 2/2
    assert metrics["Line/success"] == pytest.approx(0.25)
    assert metrics["Line/num_actions"] == pytest.approx((2 + 1 + 4 + 4) / 4)
    assert metrics["Line/action_is_valid"] == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    assert metrics["Line/action_is_effective"] == pytest.approx((1 + 0 + 1 + 1) / 4)
    assert metrics["Line/extra"] == pytest.approx((2 + 1 + 2 + 2) / 4)
    assert metrics["Line/pass@2"] == pytest.approx(0.5)  # group 0 has a success, group 1 none
    assert metrics["Line/format_penalty"] == pytest.approx((0 - 0.1 - 0 - 0.1) / 4)
    assert metrics["Echo/success"] == pytest.approx(0.5)
    assert metrics["Echo/pass@2"] == pytest.approx(1.0)
    assert metrics["Echo/num_actions"] == pytest.approx(1.0)
    assert metrics["success"] == pytest.approx(2 / 6)
    assert "Line/success" in metrics and not any("/success/" in k for k in metrics)
    s = {t.env_id: t for t in g.trajectories()}
    assert (
        s[3].num_actions == 4 and s[3].actions == [["Right"], ["Right"] * 3] and s[3].end_reason == "budget"
    )
    assert s[3].turn_rewards == pytest.approx([-0.1, -0.3]) and s[3].turn_penalties == [-0.1, 0.0]
    assert s[1].infos[1] == {} and s[1].to_dict()["group_id"] == 0


def test_metrics_before_any_turn() -> None:
    g = groups(["Line"], [1], 2)
    g.reset(0)
    m = g.metrics()
    assert m["Line/success"] == 0.0 and m["Line/action_is_valid"] == 0.0 and m["Line/pass@2"] == 0.0


# ------------------------------------------------------------------------------- real envs
def _real(
    tags: list[str], n_groups: list[int], group_size: int, mode: str = "train", **proto: Any
) -> EnvGroups:
    cfg = EnvGroupsConfig(tags=tags, n_groups=n_groups, group_size=group_size)
    return EnvGroups(cfg, ProtocolConfig(**proto), mode=mode)  # type: ignore[arg-type]


def test_real_bandit_oracle_and_random() -> None:
    g = _real(["Bandit", "BanditTest"], [2, 2], 2)
    g.reset(0)
    responses = {}
    for i in g.active_ids():
        env = g.env(i)
        arm = env.oracle_action() if i % 2 == 0 else next(a for a in env.actions if a != env.oracle_action())
        responses[i] = answer(arm.lower())
    out = g.step(responses)
    assert all(o.done for o in out.values()) and g.active_ids() == []
    assert [o.success for o in out.values()] == [i % 2 == 0 for i in range(8)]
    m = g.metrics()
    assert m["Bandit/success"] == 0.5 and m["Bandit/pass@2"] == 1.0 and m["BanditTest/success"] == 0.5


def test_real_sokoban_oracle_within_budget() -> None:
    from envs.sokoban_solver import solve

    g = _real(["SimpleSokoban"], [4], 1, mode="val")
    g.reset(0)
    plans = {i: solve(g.env(i)) for i in g.env_ids}
    while g.active_ids():
        g.step({i: answer(*plans[i][:5]) if plans[i] else answer("Up") for i in g.active_ids()})
        for i in list(plans):
            if plans[i]:
                plans[i] = plans[i][5:]
    for s in g.trajectories():
        if s.success:
            assert s.reward == pytest.approx(11 - 0.1 * s.num_actions)
            assert s.end_reason == "done" and s.num_actions <= 10
        assert s.format_penalty == 0.0
        assert g.messages(s.env_id, for_generation=False)[-1]["role"] == "assistant"
    assert any(s.success for s in g.trajectories())


def test_real_countdown_oracle() -> None:
    g = _real(["Countdown"], [2], 1, enable_think=False)
    g.reset(0)
    out = g.step({i: f"<answer>{g.env(i).solution}</answer>" for i in g.env_ids})
    assert all(o.success and o.reward == 1.0 for o in out.values())
    assert g.metrics()["Countdown/success"] == 1.0


def test_protocol_can_set_the_episode_budget_for_every_tag() -> None:
    """The actions-per-turn ablation (paper table 3) sets the budget to 5 x actions per turn."""
    import pytest
    from pydantic import ValidationError

    g = EnvGroups(
        EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[1], group_size=1),
        ProtocolConfig(max_actions_per_traj=15),
    )
    g.reset(0)
    assert g.history(0)[0].actions_left == 15 and "up to 15 actions" in g.prefix(0)
    with pytest.raises(ValidationError):
        ProtocolConfig(max_actions_per_traj=0)
