"""Products and goals: the records the shop serves, a seeded catalogue generator and its goals.

A :class:`Product` carries what WebShop's engine keeps of an Amazon item (``load_products``): asin,
title, category, search query, category path, attributes, options, price, description, features
(bullet points), reviews and rating. A :class:`Goal` is what WebShop's ``goal.py`` builds: the
instruction text and what the reward checks (attributes, options, price bound, and the target's
query, category path and title for the product-type factor).

:func:`generate_products` draws a catalogue from a seed (same seed and size, same catalogue, in any
process); :func:`generate_goal` draws goal ``i`` of such a catalogue from its own seeded stream, so
any goal index is available without building the others. Each goal names a product of the
catalogue, some of its attributes, one value of each of its options and a price bound above its
price, so that product satisfies the goal in full.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from envs.webshop.vocab import (
    BRAND_SYLLABLES,
    CATEGORIES,
    FILLERS,
    OPENERS,
    REVIEW_BODIES,
    CategorySpec,
)

MIN_PRODUCTS, MAX_PRODUCTS = 100, 100_000
#: WebShop's price bounds: a goal's bound is drawn from the first four of these above the price
PRICE_STEPS: tuple[float, ...] = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_BOUND = 1_000_000.0


@dataclass(frozen=True)
class Product:
    """One item of the shop (the fields WebShop's engine reads)."""

    asin: str
    title: str
    category: str
    query: str
    product_category: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: float
    description: str
    features: tuple[str, ...]
    reviews: tuple[tuple[int, str], ...] = ()
    rating: str = "N.A."

    def price_tag(self) -> str:
        return f"${self.price:.2f}"


@dataclass(frozen=True)
class Goal:
    """An instruction and what the reward checks against."""

    asin: str
    instruction_text: str
    attributes: tuple[str, ...]
    goal_options: dict[str, str]
    price_upper: float
    query: str
    product_category: str
    name: str
    extra: dict[str, Any] = field(default_factory=dict)


def check_size(n: int) -> int:
    if not MIN_PRODUCTS <= int(n) <= MAX_PRODUCTS:
        raise ValueError(
            f"WebShop num_products must be in {MIN_PRODUCTS}..{MAX_PRODUCTS}, got {n}; "
            "set env_config.num_products in that range"
        )
    return int(n)


def _brand(rng: random.Random) -> str:
    return "".join(rng.choice(BRAND_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _options(spec: CategorySpec, rng: random.Random) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, values in spec.options:
        k = rng.randint(2, min(5, len(values)))
        picked = set(rng.sample(range(len(values)), k))
        out[name] = tuple(v for i, v in enumerate(values) if i in picked)  # the vocabulary's order
    return out


def _texts(ptype: str, brand: str, attrs: tuple[str, ...], rng: random.Random) -> tuple[str, tuple[str, ...]]:
    fillers = rng.sample(FILLERS, 3)
    description = (
        f"This {ptype} from {brand} is {', '.join(attrs[:-1])} and {attrs[-1]}. " + " ".join(fillers[:2])
        if len(attrs) > 1
        else f"This {ptype} from {brand} is {attrs[0]}. " + " ".join(fillers[:2])
    )
    features = (*tuple(f"{a.capitalize()}: a {ptype} you can rely on." for a in attrs), fillers[2])
    return description, features


def _reviews(rng: random.Random) -> tuple[tuple[tuple[int, str], ...], str]:
    reviews = tuple((rng.randint(1, 5), rng.choice(REVIEW_BODIES)) for _ in range(rng.randint(0, 3)))
    rating = f"{sum(s for s, _ in reviews) / len(reviews):.1f}" if reviews else "N.A."
    return reviews, rating


def _product(i: int, rng: random.Random, taken: set[str]) -> Product:
    spec = CATEGORIES[i % len(CATEGORIES)]
    ptype = rng.choice(spec.types)
    audience = rng.choice(spec.audiences)
    brand = _brand(rng)
    attrs = tuple(rng.sample(spec.attributes, rng.randint(3, 5)))
    shown = " ".join(a.title() for a in attrs[: rng.randint(1, 2)])
    title = f"{brand} {shown} {ptype.title()}"
    if spec.name == "fashion":
        title += f" for {audience}"
    lo, hi = spec.price
    price = math.floor(rng.uniform(lo, hi)) + 0.99
    description, features = _texts(ptype, brand, attrs, rng)
    reviews, rating = _reviews(rng)
    return Product(
        asin=_asin(rng, taken),
        title=title,
        category=spec.name,
        query=f"{audience.lower()} {ptype}" if spec.name == "fashion" else ptype,
        product_category=spec.path.format(audience=audience) + f" › {ptype.title()}",
        attributes=attrs,
        options=_options(spec, rng),
        price=price,
        description=description,
        features=features,
        reviews=reviews,
        rating=rating,
    )


def generate_products(n: int, seed: int = 0) -> list[Product]:
    """``n`` products (100..100,000) drawn from ``seed``; the categories take turns."""
    n = check_size(n)
    rng = random.Random(f"webshop-catalogue:{seed}")
    taken: set[str] = set()
    return [_product(i, rng, taken) for i in range(n)]


def price_bound(price: float, rng: random.Random) -> float:
    """WebShop's bound: the larger of two of the first four steps above the price (none if <2)."""
    steps = [p for p in PRICE_STEPS if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_BOUND
    return max(rng.sample(steps, 2))


def instruction(
    opener: str, ptype: str, attrs: tuple[str, ...], options: dict[str, str], upper: float
) -> str:
    """WebShop's synthetic instruction: text, then `` with k: v, and k: v``, then the price bound."""
    text = f"{opener} {' and '.join(attrs)} {ptype}"
    if options:
        text += " with " + ", and ".join(f"{k}: {v}" for k, v in options.items())
    if upper < NO_PRICE_BOUND:
        text += f", and price lower than {upper:.2f} dollars"
    return text


def product_type(p: Product) -> str:
    """The product type words of a generated product: its query without the audience."""
    return p.product_category.rsplit("›", 1)[-1].strip().lower()


def generate_goal(products: list[Product], index: int, seed: int = 0) -> Goal:
    """Goal ``index`` of a generated catalogue: a product, 1-3 of its attributes, one value of each of
    its options, and a price bound it meets. Only goal ``index``'s own stream is drawn."""
    rng = random.Random(f"webshop-goal:{seed}:{index}")
    p = products[rng.randrange(len(products))]
    attrs = tuple(rng.sample(p.attributes, rng.randint(1, min(3, len(p.attributes)))))
    options = {name: rng.choice(values) for name, values in p.options.items() if values}
    upper = price_bound(p.price, rng)
    text = instruction(rng.choice(OPENERS), product_type(p), attrs, options, upper)
    return Goal(
        asin=p.asin,
        instruction_text=text,
        attributes=attrs,
        goal_options=options,
        price_upper=upper,
        query=p.query,
        product_category=p.product_category,
        name=p.title,
    )
