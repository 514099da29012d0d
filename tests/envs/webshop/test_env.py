"""WebShop's pages, actions, render and hostile input."""

from __future__ import annotations

import dataclasses
import random

import pytest

import envs
from envs.oracles import oracle_actions
from envs.webshop.env import RENDER_INSTRUCTIONS, random_valid_action
from envs.webshop.oracle import search_words
from envs.webshop.pages import MAX_PAGE_CHARS, PRODUCT_WINDOW
from envs.webshop.shop import goal_index, split_bounds


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return envs.make("WebShop", num_products=200, index_dir=str(tmp_path_factory.mktemp("idx")))


def actions_of(text: str) -> list[str]:
    tail = text.rsplit("You must choose from these actions:", 1)[1].rstrip(".")
    return [a.strip() for a in tail.split(", ")] if tail else []


def test_the_catalogue_entry_is_ragens() -> None:
    spec = envs.spec("WebShop")
    assert (spec.max_actions_per_traj, spec.max_turn, spec.max_tokens) == (9, 9, 200)
    assert "Valid answer is search[<keywords>] or click[<clickable>]." in spec.env_instruction


def test_pages_and_their_actions(env) -> None:
    text = env.reset(1600)
    assert text.startswith("Instruction: [SEP] " + env.goal.instruction_text + " [SEP] Search.")
    assert "\n".join(RENDER_INSTRUCTIONS) in text
    assert actions_of(text) == ["search[<content>]"]
    res = env.step(f"search[{env.goal.instruction_text.split(' with ')[0]}]")
    assert res.info["action_is_valid"] and not res.done and res.reward == 0.0
    acts = actions_of(res.observation)
    assert acts[:2] == ["click[back to search]", "click[next >]"]
    assert len(acts) == 2 + PRODUCT_WINDOW and "Page 1 (Total results: 50)" in res.observation
    assert "search[<content>]" not in acts  # the results page has no search box
    page2 = env.step("click[next >]").observation
    assert "click[< prev]" in actions_of(page2) and "Page 2" in page2
    env.step("click[< prev]")
    item = env.step(acts[2])
    item_acts = actions_of(item.observation)
    assert item_acts[:2] == ["click[back to search]", "click[< prev]"]
    assert item_acts[-4:] == ["click[description]", "click[features]", "click[reviews]", "click[buy now]"]
    assert "Price: $" in item.observation and "Buy Now" in item.observation
    desc = env.step("click[description]")
    assert actions_of(desc.observation) == ["click[back to search]", "click[< prev]"]
    assert env.step("click[< prev]").observation == item.observation
    assert actions_of(env.step("click[back to search]").observation) == ["search[<content>]"]


def test_buying_ends_the_episode_with_the_reward_parts(env) -> None:
    env.reset(1601)
    env.step(f"search[{' '.join(env.goal.attributes)}]")
    first = actions_of(env.render())[2]
    env.step(first)
    res = env.step("click[buy now]")
    assert res.done and res.info["success_purchase"] == 1.0 and res.reward in (0.0, 1.0)
    for k in ("webshop_score", "r_type", "r_att", "r_option", "r_price", "searches_made", "actions_used"):
        assert k in res.info, k
    assert res.info["searches_made"] == 1.0 and res.info["actions_used"] == 3.0
    assert res.info["success"] == (res.reward == 1.0)
    assert env.step("click[back to search]").info["action_is_valid"] is False  # nothing after the purchase


HOSTILE = [
    "click[",  # no closing bracket
    "click[buy now",
    "search[" + "x" * 1_000_000 + "]",  # 1 MB of keywords
    "click[buy now]",  # a clickable of another page (the item page)
    "click[next >]",
    "cIick[back to search]",  # capital I for l
    "search[]",
    "search[a] || click[b]",
    "",
    "\x00" * 10,
    "search[[nested]]",
]


@pytest.mark.parametrize("action", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_actions_are_invalid_turns(env, action) -> None:
    before = env.reset(1602)
    res = env.step(action)
    assert (res.info["action_is_valid"], res.reward, res.done) == (False, 0.0, False)
    assert res.observation == before and len(res.observation) <= MAX_PAGE_CHARS + 3000


def test_look_alikes_and_other_pages_clickables_on_the_results_page(env) -> None:
    env.reset(1603)
    obs = env.step("search[shampoo]").observation
    assert env.step("click[\u212aback to search]").info["action_is_valid"] is False  # Kelvin sign
    assert env.step("click[back to seаrch]").info["action_is_valid"] is False  # Cyrillic a
    assert env.step("click[description]").info["action_is_valid"] is False  # an item page's
    assert env.step("search[shampoo]").info["action_is_valid"] is False  # no search box here
    assert env.render() == obs
    assert env.step("CLICK[Back To Search]").info["action_is_valid"] is False  # the verb is lower case
    assert env.step("click[Back To Search]").info["action_is_valid"] is True  # ASCII case folds


def test_search_after_the_limit_is_invalid(env) -> None:
    env.reset(1604)
    for _ in range(2):
        assert env.step("search[tea]").info["action_is_valid"]
        env.step("click[back to search]")
    res = env.step("search[tea]")
    assert res.info["action_is_valid"] is False
    assert "search[<content>]" not in actions_of(res.observation)


def test_page_text_is_bounded_for_huge_products(tmp_path) -> None:
    from envs.webshop.catalogue import Product
    from envs.webshop.pages import PageState, page_text

    huge = Product(
        "B0HUGE0001",
        "t" * 50_000,
        "x",
        "x",
        "a › b",
        ("a",),
        {"color": ("c",) * 500},
        1.0,
        "d" * 10**6,
        ("f" * 10**5,) * 50,
    )
    for kind in ("item", "description", "features", "reviews"):
        assert len(page_text(PageState(kind=kind, item=huge), "i" * 10**5)) <= MAX_PAGE_CHARS


def test_random_actions_never_raise(env) -> None:
    rng = random.Random(0)
    for seed in range(1700, 1760):
        env.reset(seed)
        for _ in range(9):
            if not env.available_actions():  # the search page once the searches are spent
                break
            a = random_valid_action(env, rng)
            res = env.step(a)
            assert res.info["action_is_valid"], a
            if res.done:
                break


def test_splits_follow_ragen() -> None:
    n = 12_087
    assert split_bounds(n) == (500, 1500)
    assert goal_index(1234, "test", n) == 234
    assert goal_index(123, "val", n) == 623
    assert goal_index(10_000, "train", n) == 10_000 % (n - 1500) + 1500
    assert all(500 <= goal_index(s, "val", n) < 1500 for s in range(0, 5000, 37))
    with pytest.raises(ValueError, match="split"):
        goal_index(1, "dev", n)
    with pytest.raises(ValueError, match="split"):
        envs.make("WebShop", num_products=100, split="dev")


def test_val_and_train_goals_differ(tmp_path) -> None:
    train = envs.make("WebShop", num_products=100, index_dir=str(tmp_path))
    val = envs.make("WebShop", num_products=100, index_dir=str(tmp_path), split="val")
    train.reset(123)
    val.reset(123)
    assert train.goal != val.goal


def oracle_success(env, seed: int) -> float:
    """The oracle's episode on goal ``seed``, one action a turn: 1.0 when it bought the right product."""
    env.reset(seed)
    for left in range(9, 0, -1):
        plan = oracle_actions(env, left, 1)
        if not plan:
            break
        res = env.step(plan[0])
        if res.done:
            return float(res.info["success"])
    return 0.0


def test_an_oracle_that_sees_only_the_pages(tmp_path) -> None:
    """``oracle_sees: page`` opens the listed title sharing most words with the instruction, so its
    choice is the same whichever product the goal is; the default oracle opens the goal's own product."""
    idx = str(tmp_path)
    page = envs.make("WebShop", num_products=100, index_dir=idx, split="val", oracle_sees="page")
    goal = envs.make("WebShop", num_products=100, index_dir=idx, split="val")
    seeds = range(60)
    assert sum(oracle_success(goal, s) for s in seeds) == len(seeds)
    # fewer successes than the teacher that knows the product, far more than none
    assert 0.6 * len(seeds) <= sum(oracle_success(page, s) for s in seeds) < len(seeds)
    # the same pages with another goal product: the page-only oracle still opens the same item
    for s in seeds[:20]:
        page.reset(s)
        page.step(f"search[{search_words(page.goal)}]")
        before = oracle_actions(page, 8, 1)
        page.goal = dataclasses.replace(page.goal, asin="NOT-LISTED")
        assert oracle_actions(page, 8, 1) == before and before[0] != "click[next >]"
    with pytest.raises(ValueError, match="oracle_sees"):
        envs.make("WebShop", num_products=100, index_dir=idx, oracle_sees="all")
