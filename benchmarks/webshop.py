"""WebShop: search latency and environment speed, bm25s against a pure-Python BM25 in the same run.

Usage: ``python -m benchmarks.webshop [--quick]`` from the repository root (run as a file, the
folder's ``envs.py`` would shadow the ``envs`` package) (``--quick``: 10k instead of 100k products).

* search p50 (ms) of ``BM25Search`` (bm25s, the index built once) on 1k and 100k generated products,
  for the oracle's queries of 200 goals; the pure-Python BM25 below (the textbook formula over a
  postings dict, same tokenizer, same k1 and b) on the same queries;
* environment steps per second, the oracle playing goals 1500.. of the 1k catalogue, with each
  searcher.

Prints ``BENCH <name> ratio=<ours/reference> target=>=<y> PASS|MISS`` lines (ratio of speeds, so
above 1 means bm25s is faster).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from envs.oracles import oracle_actions
from envs.webshop.catalogue import Product, generate_products
from envs.webshop.env import WebShopEnv
from envs.webshop.oracle import search_words
from envs.webshop.search import SEARCH_RETURN_N, BM25Search, product_text, tokenize
from envs.webshop.shop import DEFAULT_N_GOALS, Shop


class PythonBM25:
    """BM25 (k1=1.5, b=0.75, Lucene's idf as bm25s) in plain Python: postings dict, per-query scores."""

    def __init__(self, products: list[Product], k1: float = 1.5, b: float = 0.75) -> None:
        docs = [tokenize(product_text(p)) for p in products]
        self.n = len(docs)
        avg = sum(map(len, docs)) / max(1, self.n)
        self.postings: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for i, d in enumerate(docs):
            norm = k1 * (1 - b + b * len(d) / avg)
            for w, tf in Counter(d).items():
                self.postings[w].append((i, tf * (k1 + 1) / (tf + norm)))
        self.idf = {
            w: math.log(1 + (self.n - len(p) + 0.5) / (len(p) + 0.5)) for w, p in self.postings.items()
        }

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for w in tokenize(query):
            for i, s in self.postings.get(w, ()):
                scores[i] += self.idf[w] * s
        return sorted(scores, key=lambda i: (-scores[i], i))[:k]


def p50_ms(searcher: BM25Search | PythonBM25, queries: list[str]) -> float:
    times = []
    for q in queries:
        t = time.perf_counter()
        searcher.search(q, SEARCH_RETURN_N)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def steps_per_second(shop: Shop, episodes: int) -> float:
    env = WebShopEnv(num_products=100)  # the shop is replaced below; 100 products builds fast
    env.shop = shop
    steps, t = 0, time.perf_counter()
    for seed in range(1500, 1500 + episodes):
        env.reset(seed)
        left = 9
        while left > 0:
            acts = oracle_actions(env, left, max_actions=1)
            if not acts:
                break
            res = env.step(acts[0])
            steps, left = steps + 1, left - 1
            if res.done:
                break
    return steps / (time.perf_counter() - t)


def bench(name: str, ratio: float, target: float) -> None:
    print(f"BENCH {name} ratio={ratio:.2f} target=>={target:g} {'PASS' if ratio >= target else 'MISS'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="10k products instead of 100k")
    args = ap.parse_args()
    big = 10_000 if args.quick else 100_000
    cache = Path(tempfile.mkdtemp())
    for n in (1000, big):
        products = generate_products(n, seed=0)
        shop = Shop(products=products, searcher=BM25Search(products, cache), n_goals=DEFAULT_N_GOALS)
        queries = [search_words(shop.goal(i)) for i in range(1500, 1700)]
        t = time.perf_counter()
        ref = PythonBM25(products)
        print(f"{n} products: pure-Python index built in {time.perf_counter() - t:.1f} s")
        ours, theirs = p50_ms(shop.searcher, queries), p50_ms(ref, queries)  # type: ignore[arg-type]
        print(f"{n} products: search p50 bm25s {ours:.2f} ms, pure Python {theirs:.2f} ms")
        label = f"{n // 1000}k"
        bench(f"webshop_search_p50_{label}", theirs / ours, 1.0)
        if n == 1000:
            fast = steps_per_second(shop, 300)
            slow = steps_per_second(Shop(products=products, searcher=ref, n_goals=DEFAULT_N_GOALS), 300)
            print(f"env steps/s (oracle, 1k products): bm25s {fast:.0f}, pure Python {slow:.0f}")
            bench("webshop_env_steps_1k", fast / slow, 1.0)


if __name__ == "__main__":
    main()
