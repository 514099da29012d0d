"""Reading WebShop's original data files (Princeton's ``data/`` folder), as its engine does.

* ``items_shuffle*.json``: a JSON list of products (``asin``, ``name``, ``category``, ``query``,
  ``product_category``, ``full_description``, ``small_description``, ``pricing`` like ``"$12.99"``
  or ``"$5.99 - $12.99"``, ``customization_options`` ``{name: [{"value": ..., "image": ...}]}``);
* ``items_ins_v2*.json``: ``{asin: {"attributes": [...], "instruction": ..., "instruction_attributes":
  [...]}}``, the attributes of every product and the synthetic instructions;
* ``items_human_ins.json``: ``{asin: [{"instruction": ..., "instruction_attributes": [...],
  "instruction_options": [...]}]}``, the human instructions;
* ``reviews.json`` (optional): ``[{"asin": ..., "reviews": [{"score"|"stars": n, "body"|"review": s}],
  "average_rating": r}]``.

Goals follow ``goal.py``: synthetic goals (RAGEN's ``human_goals=False``) are one per combination
of a product's options, human goals one per human instruction; the price bound is drawn as there,
and the goals are shuffled with ``random.seed(233)`` as WebShop's server does. Prices given as a
range take a value drawn uniformly in it, as ``generate_product_prices`` does (seeded by the asin).
A missing or malformed file raises :class:`WebShopDataError` naming it.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

from envs.webshop.catalogue import Goal, Product, price_bound

#: Bounds on what one product brings to a page (the original data has products with huge texts).
MAX_TITLE, MAX_TEXT, MAX_FEATURES, MAX_OPTION_VALUES = 200, 1500, 8, 20
_PRICE = re.compile(r"[^\d.]")


class WebShopDataError(ValueError):
    """A WebShop data file is missing or not in WebShop's format."""


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise WebShopDataError(
            f"WebShop {what} file not found: {path}. Point env_config.data_dir at WebShop's data "
            "folder (see docs/environments.md, 'Training on the original data')."
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WebShopDataError(f"WebShop {what} file {path} is not valid JSON: {exc}") from exc


def _find(data_dir: Path, pattern: str, what: str) -> Path:
    hits = sorted(data_dir.glob(pattern))
    if not hits:
        raise WebShopDataError(f"no WebShop {what} file ({pattern}) in {data_dir}")
    return hits[0]


def _price(raw: Any, asin: str) -> float:
    if not raw:
        return 100.0
    values = [float(_PRICE.sub("", part)) for part in str(raw).split("$")[1:] if _PRICE.sub("", part)]
    if not values:
        return 100.0
    if len(values) == 1:
        return values[0]
    return random.Random(asin).uniform(values[0], values[1])


def _options(raw: Any) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, contents in (raw or {}).items():
        if contents is None:
            continue
        values = [str(c["value"]).strip().replace("/", " | ").lower() for c in contents]
        out[str(name).lower()] = tuple(values[:MAX_OPTION_VALUES])
    return out


def _product(raw: dict[str, Any], attrs: dict[str, Any], reviews: dict[str, Any]) -> Product:
    asin = str(raw["asin"])
    small = raw.get("small_description") or []
    features = small if isinstance(small, list) else [small]
    rev = reviews.get(asin, {})
    body = [
        (int(r.get("score", r.get("stars", 0))), str(r.get("body", r.get("review", ""))))
        for r in rev.get("reviews", [])
    ]
    return Product(
        asin=asin,
        title=str(raw["name"])[:MAX_TITLE],
        category=str(raw["category"]),
        query=str(raw["query"]).lower().strip(),
        product_category=str(raw["product_category"]),
        attributes=tuple(attrs.get(asin, {}).get("attributes") or ["DUMMY_ATTR"]),
        options=_options(raw.get("customization_options")),
        price=_price(raw.get("pricing"), asin),
        description=str(raw.get("full_description") or "")[:MAX_TEXT],
        features=tuple(str(f)[:MAX_TITLE] for f in features[:MAX_FEATURES]),
        reviews=tuple(body[:3]),
        rating=str(rev.get("average_rating", "N.A.")),
    )


def load_products(data_dir: Path, num_products: int | None = None) -> tuple[list[Product], dict[str, Any]]:
    """The products (first ``num_products`` of the shuffled file, duplicates and bad asins skipped)
    and the ``items_ins_v2`` attribute table."""
    items_path = _find(data_dir, "items_shuffle*.json", "products")
    attrs_path = _find(data_dir, "items_ins_v2*.json", "attributes")
    raw_items = _read_json(items_path, "products")
    attrs = _read_json(attrs_path, "attributes")
    if not isinstance(raw_items, list) or not isinstance(attrs, dict):
        raise WebShopDataError(
            f"{items_path} must hold a JSON list of products and {attrs_path} a JSON object by asin"
        )
    reviews_path = data_dir / "reviews.json"
    reviews = {r["asin"]: r for r in _read_json(reviews_path, "reviews")} if reviews_path.is_file() else {}
    products: list[Product] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_items[:num_products] if num_products else raw_items):
        try:
            asin = str(raw["asin"])
            if asin == "nan" or len(asin) > 10 or asin in seen:
                continue
            seen.add(asin)
            products.append(_product(raw, attrs, reviews))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WebShopDataError(f"{items_path}: product #{i} is malformed ({exc!r})") from exc
    if not products:
        raise WebShopDataError(f"{items_path} holds no usable product")
    return products, attrs


def _goal(p: Product, text: str, attributes: list[str], options: dict[str, str], rng: random.Random) -> Goal:
    upper = price_bound(p.price, rng)
    if upper < 1_000_000:
        text += f", and price lower than {upper:.2f} dollars"
    return Goal(
        asin=p.asin,
        instruction_text=text,
        attributes=tuple(attributes),
        goal_options=options,
        price_upper=upper,
        query=p.query,
        product_category=p.product_category,
        name=p.title,
    )


def synthetic_goals(products: list[Product], attrs: dict[str, Any], rng: random.Random) -> list[Goal]:
    goals: list[Goal] = []
    for p in products:
        entry = attrs.get(p.asin) or {}
        text, goal_attrs = entry.get("instruction"), entry.get("instruction_attributes")
        if not text or not goal_attrs:
            continue
        names = sorted(p.options)
        for combo in itertools.product(*(p.options[n] for n in names)):
            options = dict(zip(names, combo, strict=True))
            option_text = ", and ".join(f"{k}: {v}" for k, v in options.items())
            full = f"{text}{' with ' + option_text if option_text else ''}"
            goals.append(_goal(p, full, goal_attrs, options, rng))
    return goals


def human_goals(products: list[Product], data_dir: Path, rng: random.Random) -> list[Goal]:
    path = data_dir / "items_human_ins.json"
    human = _read_json(path, "human instructions")
    if not isinstance(human, dict):
        raise WebShopDataError(f"{path} must be a JSON object by asin")
    goals: list[Goal] = []
    try:
        for p in products:
            for ins in human.get(p.asin, []):
                if not ins["instruction_attributes"]:
                    continue
                opts = {str(i): str(v) for i, v in enumerate(ins["instruction_options"])}
                goals.append(
                    _goal(p, str(ins["instruction"]).strip("."), ins["instruction_attributes"], opts, rng)
                )
    except (KeyError, TypeError) as exc:
        raise WebShopDataError(f"{path}: an instruction is malformed ({exc!r})") from exc
    return goals


def load_original(
    data_dir: str | Path, num_products: int | None = None, human: bool = False
) -> tuple[list[Product], list[Goal]]:
    """Products and goals from WebShop's files in ``data_dir``, in WebShop's goal order."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise WebShopDataError(f"WebShop data folder not found: {root}; set env_config.data_dir to it")
    products, attrs = load_products(root, num_products)
    rng = random.Random(233)
    goals = human_goals(products, root, rng) if human else synthetic_goals(products, attrs, rng)
    if not goals:
        raise WebShopDataError(f"no goal could be built from the files in {root}")
    random.Random(233).shuffle(goals)
    return products, goals
