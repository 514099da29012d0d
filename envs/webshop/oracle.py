"""WebShop's oracle: search with the goal's words, open the best match, choose the options, buy.

* search page: ``search[<attributes> <product type>]`` (no options, no price: RAGEN's hint);
* results page: the goal's product when it is listed; else ``next >`` while the budget still covers
  opening an item, its options and the purchase; else the listed product sharing most words with
  the goal within its price bound. With ``oracle_sees="page"`` it always opens that last one: the
  choice a player can make from what the page shows (titles and prices), so demonstrations never ask
  a policy for the goal's product id, which the results page does not reveal;
* item page: ``click[<value>]`` for each option value the goal asks for that the item offers, then
  ``click[buy now]`` (sooner when the budget runs out); a tab: ``< prev``.

Like the other environments' oracles it knows the episode (here the goal's product), which makes it
a teacher for demonstrations, not a baseline for agents; ``oracle_sees="page"`` is the teacher that
knows only the instruction and the pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from envs.webshop.catalogue import Goal, Product
from envs.webshop.pages import BUY, NEXT, PREV, PageState, clickables
from envs.webshop.search import tokenize


class WebShopEnv(Protocol):
    """What the oracle reads of the environment (its episode and page)."""

    goal: Goal | None
    state: PageState
    searches: int
    max_searches: int
    oracle_sees: str


def goal_type(goal: Goal) -> str:
    """The goal's product type: the last level of its category path, lower case."""
    return goal.product_category.rsplit("›", 1)[-1].strip().lower()


def search_words(goal: Goal) -> str:
    return " ".join([*goal.attributes, goal_type(goal)])


def _overlap(p: Product, goal: Goal) -> int:
    return len(set(tokenize(p.title)) & set(tokenize(search_words(goal))))


def _results_choice(env: WebShopEnv, goal: Goal, actions_left: int) -> str:
    window = env.state.window()
    if env.oracle_sees == "goal":
        target = next((p for p in window if p.asin == goal.asin), None)
        budget = actions_left - 1 >= len(goal.goal_options) + 2
        if target is None and NEXT in clickables(env.state) and budget:
            return f"click[{NEXT}]"
        if target is not None:
            return f"click[{target.asin.lower()}]"
    ok = [p for p in window if p.price <= goal.price_upper] or window
    if not ok:
        return "click[back to search]"
    best = max(ok, key=lambda p: _overlap(p, goal))  # max keeps the first of equals: the higher rank
    return f"click[{best.asin.lower()}]"


def _item_choice(env: WebShopEnv, goal: Goal, actions_left: int) -> list[str]:
    item = env.state.item
    assert item is not None
    offered = {v for vals in item.options.values() for v in vals}
    chosen = set(env.state.chosen.values())
    todo = [v.lower() for v in goal.goal_options.values() if v.lower() in offered and v.lower() not in chosen]
    return [f"click[{v}]" for v in todo[: max(0, actions_left - 1)]] + [f"click[{BUY}]"]


def oracle_plan(env: WebShopEnv, actions_left: int, max_actions: int) -> list[str]:
    goal, kind = env.goal, env.state.kind
    if goal is None or actions_left <= 0 or kind == "done":
        return []
    if kind == "search":
        return [f"search[{search_words(goal)}]"] if env.searches < env.max_searches else []
    if kind == "results":
        if not env.state.hits:
            return ["click[back to search]"] if env.searches < env.max_searches else []
        return [_results_choice(env, goal, actions_left)]
    if kind == "item":
        return _item_choice(env, goal, actions_left)
    return [f"click[{PREV}]"]


def oracle_think(env: WebShopEnv, actions: Sequence[str]) -> str:
    """A short sentence about the page and the chosen actions."""
    goal = env.goal
    first = actions[0] if actions else ""
    if goal is None or not first:
        return "Nothing is left to do."
    kind = env.state.kind
    if kind == "search":
        return f"I need a {goal_type(goal)}; I search without size or color."
    if kind == "results":
        if first == f"click[{NEXT}]":
            return "No product here fits, so I go to the next page."
        return f"{first[6:-1]} fits best and costs under {goal.price_upper:.2f}, so I open it."
    if kind == "item":
        picks = [a[6:-1] for a in actions if a != f"click[{BUY}]"]
        return f"I choose {', '.join(picks)} and buy it." if picks else "I buy it now."
    return "I go back to the item."
