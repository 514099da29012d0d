"""WebShop's purchase reward (``web_agent_site/engine/goal.py``), without spaCy and thefuzz.

``score = (attribute matches + option matches + price_ok) / (n_attrs + n_opts + 1) * r_type``:

* an attribute of the goal matches when a product attribute has a token-set ratio above 85 with it,
  or when it is a substring of the title, the features or the description;
* a chosen option matches when (``size``: exactly; other options: token-set ratio above 85) it is one
  of the goal's option values, or when it is a substring of the title, features or description;
* ``price_ok``: the price is at most the goal's bound;
* ``r_type`` (product type): 1 when the query matches, two category levels match or the titles share
  more than 20% of the goal title's content words; else 0.5; 0.1 below 10% shared words; 0 with none.

Differences from the original, both because its libraries are not dependencies here: the token-set
ratio is computed with :mod:`difflib` (thefuzz uses the Levenshtein ratio: both give 100 for equal
token sets and for a token set inside the other, and close values otherwise), and the title's
content words are its words without stop words, digits and the brand (spaCy keeps the nouns).
RAGEN's reward is 1 when this score is 1, else 0 (:func:`binary`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

from envs.webshop.catalogue import Goal, Product

EXACT_MATCH_OPTS = ("size",)
_WORD = re.compile(r"[a-z0-9][a-z0-9'\-]*")
_ALNUM = re.compile(r"[a-z0-9]+")  # thefuzz's processing: anything else separates words
_STOP = frozenset(
    [
        "a",
        "an",
        "and",
        "the",
        "for",
        "of",
        "with",
        "in",
        "on",
        "to",
        "by",
        "from",
        "or",
        "at",
        "is",
        "are",
        "this",
        "that",
        "as",
        "it",
        "its",
        "your",
        "you",
        "our",
        "men",
        "women",
        "mens",
        "womens",
        "unisex",
    ]
)


def _ratio(a: str, b: str) -> float:
    return 100.0 * SequenceMatcher(None, a, b).ratio() if a or b else 100.0


def token_set_ratio(a: str, b: str) -> float:
    """thefuzz's ``token_set_ratio`` on lower-case word sets, with difflib's ratio."""
    ta, tb = set(_ALNUM.findall(a.lower())), set(_ALNUM.findall(b.lower()))
    if not ta or not tb:
        return 0.0
    sect = " ".join(sorted(ta & tb))
    da = " ".join(sorted(ta - tb))
    db = " ".join(sorted(tb - ta))
    c1 = f"{sect} {da}".strip()
    c2 = f"{sect} {db}".strip()
    return max(_ratio(sect, c1), _ratio(sect, c2), _ratio(c1, c2))


def _in_text(value: str, p: Product) -> bool:
    v = value.lower()
    return v in p.title.lower() or v in " ".join(p.features).lower() or v in p.description.lower()


def attribute_matches(p: Product, goal: Goal) -> int:
    n = 0
    for g in goal.attributes:
        if any(token_set_ratio(a, g) > 85 for a in p.attributes) or _in_text(g, p):
            n += 1
    return n


def option_matches(p: Product, goal: Goal, chosen: dict[str, str]) -> int:
    wanted = [v.lower() for v in goal.goal_options.values()]
    n = 0
    for key, value in chosen.items():
        v = value.lower()
        if key.lower() in EXACT_MATCH_OPTS:
            hit = v in wanted
        else:
            hit = any(token_set_ratio(g, v) > 85 for g in wanted)
        if hit or _in_text(v, p):
            n += 1
    return n


def _content_words(title: str) -> set[str]:
    words = _WORD.findall(title.lower())
    return {w for w in words[1:] if w not in _STOP and not w.isdigit()}  # words[0]: the brand


def type_factor(p: Product, goal: Goal) -> tuple[float, float]:
    """``(r_type, title_score)`` as WebShop's ``get_type_reward``."""
    query_match = p.query == goal.query
    cats_p = {x.strip() for x in p.product_category.split("›")}
    cats_g = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(cats_p & cats_g) >= 2
    desired = _content_words(goal.name)
    title_score = len(_content_words(p.title) & desired) / len(desired) if desired else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, title_score


@dataclass(frozen=True)
class RewardParts:
    """The parts of one purchase's score (also the info of the buying step)."""

    score: float
    r_type: float
    title_score: float
    attr_matches: int
    n_attrs: int
    option_matches: int
    n_options: int
    price_ok: bool

    def info(self) -> dict[str, float]:
        return {
            "webshop_score": self.score,
            "r_type": self.r_type,
            "r_att": self.attr_matches / self.n_attrs if self.n_attrs else 0.0,
            "r_option": self.option_matches / self.n_options if self.n_options else 0.0,
            "r_price": float(self.price_ok),
            "attr_matches": float(self.attr_matches),
            "option_matches": float(self.option_matches),
        }


def purchase_reward(p: Product, goal: Goal, chosen: dict[str, str]) -> RewardParts:
    """The score of buying ``p`` with options ``chosen`` for ``goal``."""
    r_type, title_score = type_factor(p, goal)
    n_att = attribute_matches(p, goal)
    n_opt = option_matches(p, goal, chosen)
    price_ok = p.price <= goal.price_upper
    total = (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.goal_options) + 1)
    return RewardParts(
        score=total * r_type,
        r_type=r_type,
        title_score=title_score,
        attr_matches=n_att,
        n_attrs=len(goal.attributes),
        option_matches=n_opt,
        n_options=len(goal.goal_options),
        price_ok=price_ok,
    )


def binary(score: float) -> float:
    """RAGEN's reward: 1 for a full match, else 0 (a float score of 1 is exact: n/n times 1.0)."""
    return 1.0 if score >= 1.0 - 1e-9 else 0.0
