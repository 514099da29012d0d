"""The shop behind every WebShop env instance: products, goals, search, and the seed splits.

A rollout holds hundreds of env instances of one tag; they share one :class:`Shop` per catalogue
(built on first use and kept for the process), so the catalogue is generated (or read) and the
search index loaded once.

Splits by seed, as RAGEN's ``WebShopEnv.reset``: ``test``: goal ``seed % 500``; ``val``:
``seed % 1000 + 500``; ``train``: ``seed % (n_goals - 1500) + 1500``; the goal index then goes
through a fixed permutation (``random.Random(42)`` shuffle), as there. Catalogues with fewer than
2,000 goals keep the proportions (a quarter test, half validation, the rest train).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from envs.webshop.catalogue import Goal, Product, generate_goal, generate_products
from envs.webshop.search import BM25Search, Searcher

SPLITS = ("train", "val", "test")
#: WebShop's instruction count: the number of goals of a generated catalogue unless configured
DEFAULT_N_GOALS = 12_087


def split_bounds(n_goals: int) -> tuple[int, int]:
    """End of the test range and of the validation range of goal indices."""
    if n_goals >= 2000:
        return 500, 1500
    if n_goals < 3:
        raise ValueError(f"WebShop needs at least 3 goals for its train/val/test splits, got {n_goals}")
    test_end = max(1, n_goals // 4)
    return test_end, max(test_end + 1, (3 * n_goals) // 4)


def goal_index(seed: int, split: str, n_goals: int) -> int:
    """RAGEN's goal index of ``seed`` in ``split`` (before the permutation)."""
    test_end, val_end = split_bounds(n_goals)
    if split == "test":
        return seed % test_end
    if split == "val":
        return seed % (val_end - test_end) + test_end
    if split == "train":
        return seed % (n_goals - val_end) + val_end
    raise ValueError(f"WebShop split must be one of {SPLITS}, got {split!r}")


@dataclass
class Shop:
    """Products, their search, and goals by index (generated lazily or loaded)."""

    products: list[Product]
    searcher: Searcher
    n_goals: int
    catalogue_seed: int = 0
    loaded_goals: list[Goal] | None = None
    by_asin: dict[str, int] = field(init=False)
    _perm: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.by_asin = {p.asin.lower(): i for i, p in enumerate(self.products)}
        self._perm = list(range(self.n_goals))
        random.Random(42).shuffle(self._perm)
        self._goal_cache: dict[int, Goal] = {}

    def goal(self, index: int) -> Goal:
        if self.loaded_goals is not None:
            return self.loaded_goals[index]
        if index not in self._goal_cache:
            self._goal_cache[index] = generate_goal(self.products, index, self.catalogue_seed)
        return self._goal_cache[index]

    def goal_for_seed(self, seed: int, split: str) -> Goal:
        return self.goal(self._perm[goal_index(int(seed), split, self.n_goals)])

    def product(self, asin: str) -> Product | None:
        i = self.by_asin.get(asin.lower())
        return None if i is None else self.products[i]

    def search(self, query: str, k: int) -> list[Product]:
        return [self.products[i] for i in self.searcher.search(query, k)]


@lru_cache(maxsize=4)
def generated_shop(num_products: int, seed: int, n_goals: int, cache_root: str | None = None) -> Shop:
    products = generate_products(num_products, seed)
    searcher = BM25Search(products, Path(cache_root) if cache_root else None)
    return Shop(products=products, searcher=searcher, n_goals=n_goals, catalogue_seed=seed)


@lru_cache(maxsize=2)
def original_shop(
    data_dir: str, num_products: int | None, human: bool, cache_root: str | None = None
) -> Shop:
    from envs.webshop.loader import load_original

    products, goals = load_original(data_dir, num_products, human)
    searcher = BM25Search(products, Path(cache_root) if cache_root else None)
    return Shop(products=products, searcher=searcher, n_goals=len(goals), loaded_goals=goals)
