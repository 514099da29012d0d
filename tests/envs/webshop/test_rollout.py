"""WebShop through the real rollout runner: scripted shoppers, rewards computed by hand, Parquet rows."""

from __future__ import annotations

import pytest
import torch

import envs
from envs.registry import EnvSpec
from envs.webshop.env import WebShopEnv
from envs.webshop.oracle import oracle_plan
from ragen_core.config.learner import AlgorithmConfig, LearnerConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.learner.batch import to_token_batch
from ragen_core.learner.update import Learner
from ragen_core.models.policies import train_tokenizer
from ragen_core.protocol import ProtocolConfig
from ragen_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts
from ragen_core.trajectory import read_trajectories, to_table, write_trajectories
from tests.envs.webshop.fixture import CABLE, TWIN, write_fixture
from tests.tiny_policy import smallest_policy

#: env_id -> what that shopper does. Every goal of the fixture asks for 2 attributes and 2 options,
#: so a score is (attribute matches + option matches + price ok) / 5 times the type factor:
#: full match (2 + 2 + 1) / 5 = 1; the other scent (2 + 1 + 1) / 5 = 0.8; the $99.99 twin over the
#: bound (2 + 2 + 0) / 5 = 0.8; the HDMI cable: no title word of the goal's, type factor 0, so 0.
EXPECTED = {0: ("oracle", 1.0), 1: ("wrong option", 0.8), 2: ("over budget", 0.8), 3: ("wrong type", 0.0)}


def script(env: WebShopEnv, who: str) -> list[str]:
    goal = env.goal
    scent, size = goal.goal_options["scent"], goal.goal_options["size"]
    other = "rose" if scent == "lavender" else "lavender"
    if who == "wrong option":
        return [
            "search[tea tree shampoo]",
            f"click[{goal.asin.lower()}]",
            f"click[{other}]",
            f"click[{size}]",
            "click[buy now]",
        ]
    if who == "over budget":
        return [
            "search[salon edition shampoo]",
            f"click[{TWIN.lower()}]",
            f"click[{scent}]",
            f"click[{size}]",
            "click[buy now]",
        ]
    return ["search[hdmi cable]", f"click[{CABLE.lower()}]", "click[buy now]"]


class ShopperEngine(RolloutEngine):
    """Answers each active env with its shopper's next action (the oracle asks the env itself)."""

    def __init__(self, groups: EnvGroups, tokenizer) -> None:
        self.groups, self.tok, self.turn = groups, tokenizer, {}

    def generate(self, prompts, params, seeds=None, **_):
        out = []
        for env_id in self.groups.active_ids():
            env = self.groups.env(env_id)
            who = EXPECTED[env_id][0]
            t = self.turn.get(env_id, 0)
            self.turn[env_id] = t + 1
            action = oracle_plan(env, 9, 1)[0] if who == "oracle" else script(env, who)[t]
            text = f"{env.think_text([action])}</think><answer>{action}</answer>"
            ids = [*self.tok.encode(text), self.tok.convert_tokens_to_ids("<|im_end|>")]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out

    def update_weights(self, state_dict) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def shop_tag(tmp_path_factory) -> str:
    """The tag ``WebShopFixture``: WebShop over the fixture's files, with WebShop's fractional score."""
    tmp = tmp_path_factory.mktemp("ws")
    data = write_fixture(tmp / "data")
    envs.register_tag(
        EnvSpec(
            tag="WebShopFixture",
            env_type="webshop",
            env_instruction=envs.spec("WebShop").env_instruction,
            max_actions_per_traj=9,
            max_tokens=200,
            max_turn=9,
            env_config={"data_dir": str(data), "binary_reward": False, "index_dir": str(tmp)},
        )
    )
    return "WebShopFixture"


@pytest.fixture(scope="module")
def rows(shop_tag, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rows")
    tok = train_tokenizer(
        ["search click buy now shampoo tea tree sulfate free lavender rose"] * 4, vocab_size=400
    )
    groups = EnvGroups(
        EnvGroupsConfig(tags=[shop_tag], n_groups=[4], group_size=1),
        ProtocolConfig(max_turn=9, max_actions_per_turn=1),
    )
    trajs = run_rollouts(groups, ShopperEngine(groups, tok), tok, SamplingParams(), seed=0)
    path = write_trajectories(trajs, tmp / "rollouts.parquet")
    return read_trajectories(path)


def test_rewards_match_the_hand_computed_ones(rows) -> None:
    assert len(rows) == 4
    for row in rows:
        who, score = EXPECTED[row.env_id]
        assert row.reward == pytest.approx(score), who
        assert row.success == (score == 1.0), who
        assert row.turn_count == (5 if who in ("oracle", "wrong option", "over budget") else 3), who


def test_reward_parts_are_in_the_parquet_rows(rows) -> None:
    parts = {
        "oracle": dict(r_att=1.0, r_option=1.0, r_price=1.0, r_type=1.0),
        "wrong option": dict(r_att=1.0, r_option=0.5, r_price=1.0, r_type=1.0),
        "over budget": dict(r_att=1.0, r_option=1.0, r_price=0.0, r_type=1.0),
        "wrong type": dict(r_att=0.0, r_option=0.0, r_price=1.0, r_type=0.0),
    }
    for row in rows:
        who, score = EXPECTED[row.env_id]
        last = row.info["infos"][-1]
        assert last["webshop_score"] == pytest.approx(score) and last["success_purchase"] == 1.0
        assert {k: last[k] for k in parts[who]} == pytest.approx(parts[who]), who
        assert last["searches_made"] == 1.0
        assert all(i["action_is_valid"] for i in row.info["infos"])


def test_binary_reward_is_ragens(tmp_path) -> None:
    env = envs.make("WebShop", data_dir=str(write_fixture(tmp_path / "d")), index_dir=str(tmp_path))
    env.reset(0)
    scent, size = env.goal.goal_options["scent"], env.goal.goal_options["size"]
    other = "rose" if scent == "lavender" else "lavender"
    for a in [
        "search[tea tree shampoo]",
        f"click[{env.goal.asin.lower()}]",
        f"click[{other}]",
        f"click[{size}]",
    ]:
        env.step(a)
    res = env.step("click[buy now]")
    assert (
        res.info["webshop_score"] == pytest.approx(0.8) and res.reward == 0.0 and res.info["success"] is False
    )


def test_constrained_decoding_spells_the_clickables_of_each_page(shop_tag) -> None:
    """WebShop's actions change with the page: a constrained turn samples only the shown page's
    clickables (every click valid, product ids spelt exactly) or, on the search page, ``search[``, free
    keywords and ``]``; the learner reproduces the behaviour log-probs under each turn's own allowed sets."""
    model, tok = smallest_policy()
    groups = EnvGroups(
        EnvGroupsConfig(
            tags=[shop_tag],
            n_groups=[3],
            group_size=2,
            env_overrides={shop_tag: {"render_instructions": False}},
        ),
        ProtocolConfig(
            enable_think=False,
            max_turn=4,
            max_actions_per_turn=1,
            max_context_window=1,  # this tokenizer never saw WebShop's pages: they are long in it
            action_decoding="constrained",
        ),
    )
    engine = HFEngine(model, tok)
    trajs = run_rollouts(groups, engine, tok, SamplingParams(max_new_tokens=24), seed=1, run_id="t")
    clicks = searches = 0
    for t in trajs:
        assert t.info["turn_decoding"] == ["constrained"] * t.turn_count
        for acts, info in zip(t.actions, t.info["infos"], strict=True):
            # keywords are free text: an end-of-turn token among them leaves the answer unparsed
            # (no action), and the env may refuse some ("[", too long); every click is valid
            assert len(acts) <= 1
            for action in acts:
                if action.startswith("search["):
                    searches += 1
                else:
                    assert action.startswith("click[") and info["action_is_valid"], action
                    clicks += 1
    assert searches >= 6 and clicks >= 3  # random keywords find pages, whose clicks were all valid

    batch = to_token_batch(to_table(trajs))
    assert batch.allowed_token_ids is not None
    learner = Learner(model, LearnerConfig(algorithm=AlgorithmConfig(adv_estimator="grpo")))
    with torch.no_grad():
        masked, _ = learner._logprobs(
            model, batch.input_ids, batch.loss_mask.bool(), allowed=batch.allowed_token_ids
        )
    constrained = (batch.allowed_token_ids >= 0).any(-1)
    assert int(constrained.sum()) > 0
    assert (masked - batch.rollout_logprobs)[constrained].abs().max().item() <= 1e-4
