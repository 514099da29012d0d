"""WebShop (Yao et al. 2022) as RAGEN plays it: find and buy the product an instruction describes.

Each episode is a goal (chosen by the seed and the ``split``, see :mod:`envs.webshop.shop`); the agent
acts with ``search[keywords]`` (on the search page) and ``click[name]`` (a clickable of the current
page); ``click[buy now]`` ends the episode with the purchase reward (:mod:`envs.webshop.reward`):
RAGEN's 1 for a full match, else 0 (``binary_reward: false`` gives WebShop's score in [0, 1]).

The state shown to the model is RAGEN's render: the page text, ``"."``, RAGEN's render instructions
(verbatim, the run-together pair included), then ``"\\n You must choose from these actions:"`` and
the page's actions. Model text is only ever compared with the page's clickables: an action that is
not ``search[...]`` / ``click[...]`` of this page (no closing bracket, a clickable of another page, a
look-alike character, keywords longer than ``max_query_chars``, a search after ``max_searches``) is
an invalid action that changes nothing. Case is folded for ASCII letters only, so no look-alike
character (the Kelvin sign lower-cases to ``k``) can stand for a clickable.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from envs.base import ANSWER_SLOT, Env, StepResult, invalid_step
from envs.webshop.catalogue import Goal
from envs.webshop.oracle import oracle_plan, oracle_think
from envs.webshop.pages import BACK, BUY, NEXT, PREV, PageState, clickables, page_text
from envs.webshop.reward import RewardParts, binary, purchase_reward
from envs.webshop.search import SEARCH_RETURN_N
from envs.webshop.shop import DEFAULT_N_GOALS, SPLITS, Shop, generated_shop, original_shop

RENDER_INSTRUCTIONS: tuple[str, ...] = (
    "We must buy a product within 10 actions. It doesn't have to match perfectly with description.",
    "Search term should not include details like size, color.",
    "Never search for more than 2 times.",
    "Do not be too strict about the description, it's more important to buy one that is close enough "
    "within action limit.",
    "Prioritize click a product in the current page over going to next page.",
    # RAGEN's list lacks a comma here, so these two lines run together; kept as the paper's models saw it
    "Almost never click[next >] for more than 2 times."
    "Almost never click[< prev] unless you are sure the product is on one of the previous pages.",
    "If you have less than 3 actions left, just buy the first product you see in the current page.",
    "If an matching option exists, make sure to click[size] then click[color], one at a time, before "
    "click[buy now], but don't have to if only 1 action left, in that case you just click[buy now]. "
    "Never click description.",
)
MAX_ACTION_CHARS = 1000
#: what the oracle may know when it picks a product on a results page (envs.webshop.oracle)
ORACLE_SEES = ("goal", "page")
#: RAGEN's listing of the search action; ``<content>`` is also the answer grammar's free-text slot
#: (envs.base.ANSWER_SLOT), so constrained decoding spells ``search[`` and ``]`` around free keywords.
SEARCH_ACTION = f"search[{ANSWER_SLOT}]"
_ACTION = re.compile(r"(search|click)\[(.*)\]", re.DOTALL)
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_lower(s: str) -> str:
    return s.translate(_ASCII_LOWER)


class WebShopEnv(Env):
    """RAGEN's WebShop over a generated catalogue (or WebShop's own files with ``data_dir``)."""

    env_type: ClassVar[str] = "webshop"
    state_actions: ClassVar[bool] = True  # the page's clickables: answer_actions()
    success_means: ClassVar[str] = (
        "the bought product matches the instruction in full: its type, every attribute and option "
        "asked for, and the price bound (WebShop's score is 1)."
    )

    def __init__(
        self,
        num_products: int = 1000,
        catalogue_seed: int = 0,
        n_goals: int = DEFAULT_N_GOALS,
        split: str = "train",
        data_dir: str | None = None,
        human_goals: bool = False,
        binary_reward: bool = True,
        max_searches: int = 2,
        max_query_chars: int = 200,
        render_instructions: bool = True,
        index_dir: str | None = None,
        oracle_sees: str = "goal",
    ) -> None:
        """``data_dir``: WebShop's data folder (``items_shuffle*.json``, ``items_ins_v2*.json``,
        ``items_human_ins.json``) instead of the generated catalogue; ``num_products`` then keeps the
        first products of the file. ``index_dir``: where the search index is cached (default the
        state folder). ``render_instructions: false`` leaves RAGEN's hint lines out of the state
        (shorter prompts for a tiny model). ``oracle_sees``: what the oracle's choice on a results page
        may use, ``goal`` (it opens the goal's product) or ``page`` (the listed title sharing most words
        with the instruction, within its price bound: a choice the policy can learn from the page)."""
        if split not in SPLITS:
            raise ValueError(f"WebShop split must be one of {SPLITS}, got {split!r}")
        if max_searches < 1 or max_query_chars < 1:
            raise ValueError("WebShop max_searches and max_query_chars must be >= 1")
        if oracle_sees not in ORACLE_SEES:
            raise ValueError(f"WebShop oracle_sees must be one of {ORACLE_SEES}, got {oracle_sees!r}")
        if data_dir:
            self.shop: Shop = original_shop(str(data_dir), num_products, human_goals, index_dir)
        else:
            self.shop = generated_shop(num_products, catalogue_seed, n_goals, index_dir)
        self.split = split
        self.binary_reward = binary_reward
        self.max_searches = max_searches
        self.max_query_chars = max_query_chars
        self.render_instructions = render_instructions
        self.oracle_sees = oracle_sees
        self.actions = None  # free text: the answer is the action string, checked against the page
        # (answer_actions() gives constrained decoding the page's clickables)
        self.goal: Goal | None = None
        self.state = PageState()
        self.searches = 0
        self.n_actions = 0
        self.last_reward: RewardParts | None = None
        self._text = ""

    # Env API -------------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.goal = self.shop.goal_for_seed(seed, self.split)
        self.state = PageState()
        self.searches = 0
        self.n_actions = 0
        self.last_reward = None
        self._refresh()
        return self._text

    def render(self) -> str:
        return self._text

    def available_actions(self) -> list[str]:
        """RAGEN's list: ``search[<content>]`` where searching is possible, then ``click[...]``."""
        out = [SEARCH_ACTION] if self._can_search() else []
        return out + [f"click[{c}]" for c in clickables(self.state)]

    def answer_actions(self) -> list[str] | None:
        """The page's ``click[...]`` actions, spelt as this env accepts them; on the search page
        ``search[<content>]``, whose keywords are free text (a slot of the answer grammar), or ``None`` once
        the searches are used up (that turn's answer is free, and invalid whatever it says)."""
        return self.available_actions() or None

    def step(self, action: str) -> StepResult:
        parsed = self._parse(action)
        if parsed is None:
            return invalid_step(self._text)
        before = self._text
        kind, arg = parsed
        self.n_actions += 1
        if kind == "search":
            self._search(arg)
        else:
            done = self._click(arg)
            if done:
                return self._purchase(before)
        self._refresh()
        return StepResult(self._text, 0.0, False, self._info(valid=True, effective=self._text != before))

    # Actions -------------------------------------------------------------------------------------
    def _can_search(self) -> bool:
        return self.state.kind == "search" and self.searches < self.max_searches

    def _parse(self, action: str) -> tuple[str, str] | None:
        """``(kind, argument)`` of a valid action on this page, else ``None``."""
        if self.state.kind == "done" or len(action) > MAX_ACTION_CHARS:
            return None
        m = _ACTION.fullmatch(action.strip())
        if m is None:
            return None
        kind, arg = m.group(1), m.group(2).strip()
        if kind == "search":
            ok = (
                self._can_search()
                and 0 < len(arg) <= self.max_query_chars
                and "[" not in arg
                and "]" not in arg
            )
            return (kind, arg) if ok else None
        key = ascii_lower(arg)
        return (kind, key) if key in clickables(self.state) else None

    def _search(self, keywords: str) -> None:
        self.searches += 1
        self.state = PageState(kind="results", hits=self.shop.search(keywords, SEARCH_RETURN_N))

    def _click(self, name: str) -> bool:
        """Follow a clickable of the current page; True when it bought."""
        st = self.state
        if name == BACK:
            self.state = PageState()
        elif name == NEXT:
            st.page += 1
        elif name == PREV:
            if st.kind == "results":
                st.page -= 1
            elif st.kind == "item":
                st.kind, st.item, st.chosen = "results", None, {}
            else:
                st.kind = "item"
        elif st.kind == "results":
            st.kind, st.item, st.chosen = "item", self.shop.product(name), {}
        elif name == BUY:
            return True
        elif name in ("description", "features", "reviews"):
            st.kind = name
        else:
            self._choose(name)
        return False

    def _choose(self, value: str) -> None:
        item = self.state.item
        assert item is not None
        for opt, values in item.options.items():
            if value in values:
                self.state.chosen[opt] = value
                return

    def _purchase(self, before: str) -> StepResult:
        assert self.goal is not None and self.state.item is not None
        bought = self.state.item.asin
        parts = purchase_reward(self.state.item, self.goal, dict(self.state.chosen))
        self.last_reward = parts
        reward = binary(parts.score) if self.binary_reward else parts.score
        self.state = PageState(kind="done")
        self._refresh()
        info = self._info(valid=True, effective=True)
        info.update(parts.info())
        info.update(success=binary(parts.score) == 1.0, success_purchase=1.0, bought=bought)
        return StepResult(self._text, reward, True, info)

    def _info(self, valid: bool, effective: bool) -> dict[str, Any]:
        return {
            "success": False,
            "action_is_valid": valid,
            "action_is_effective": effective,
            "success_purchase": 0.0,
            "searches_made": float(self.searches),
            "actions_used": float(self.n_actions),
            "end_of_page": float(
                self.state.kind == "results"
                and self.state.page == self.state.last_page()
                and self.state.page > 1
            ),
        }

    def _refresh(self) -> None:
        assert self.goal is not None
        text = page_text(self.state, self.goal.instruction_text) + "."
        if self.render_instructions:
            text += "\n".join(RENDER_INSTRUCTIONS)
        text += "\n You must choose from these actions:" + ", ".join(self.available_actions()) + "."
        self._text = text

    # Hooks -----------------------------------------------------------------------------------------
    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        return oracle_plan(self, actions_left, max_actions)

    def think_text(self, actions: Sequence[str]) -> str:
        return oracle_think(self, actions)

    def random_answer(self, plan: list[str], cap: int, rng: random.Random) -> list[str]:
        """One random valid action of this page (a search uses random words of the instruction)."""
        return [random_valid_action(self, rng)]


def random_valid_action(env: WebShopEnv, rng: random.Random) -> str:
    """A uniformly random action of the page; a search takes 1-4 words of the goal's type and text."""
    acts = env.available_actions()
    if not acts:
        return "click[buy now]"
    a = rng.choice(acts)
    if a == SEARCH_ACTION:
        words = (env.goal.instruction_text if env.goal else "shop").split()
        return "search[" + " ".join(rng.sample(words, min(len(words), rng.randint(1, 4)))) + "]"
    return a
