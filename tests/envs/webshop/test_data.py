"""The catalogue generator, its goals, the reward, the loader of the original files, the search index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envs.webshop.catalogue import generate_goal, generate_products
from envs.webshop.loader import WebShopDataError, load_original
from envs.webshop.reward import binary, purchase_reward, token_set_ratio
from envs.webshop.search import BM25Search
from envs.webshop.vocab import CATEGORIES
from tests.envs.webshop.fixture import CABLE, SHAMPOO, TWIN, write_fixture

ROOT = Path(__file__).resolve().parents[3]


def test_the_generator_is_deterministic_across_processes() -> None:
    a = generate_products(150, seed=4)
    assert a == generate_products(150, seed=4) and a != generate_products(150, seed=5)
    code = (
        "from envs.webshop.catalogue import generate_products, generate_goal as g; "
        "p = generate_products(150, seed=4); print(repr((p[17], g(p, 9001, 4))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "7"},
    ).stdout.strip()
    assert out == repr((a[17], generate_goal(a, 9001, 4)))


def test_catalogue_structure_and_size_bounds() -> None:
    products = generate_products(500, seed=0)
    assert len({p.asin for p in products}) == 500
    assert {p.category for p in products} == {c.name for c in CATEGORIES}
    for p in products:
        assert len(p.asin) == 10 and p.price > 0 and p.features and p.description and p.attributes
        assert all(len(v) >= 2 for v in p.options.values()) and " › " in p.product_category
    for bad in (99, 100_001):
        with pytest.raises(ValueError, match="num_products"):
            generate_products(bad)


def test_option_values_are_told_apart_by_the_reward() -> None:
    """No option value is in the generated text, nor (sizes match exactly) a fuzzy match of another
    value of its option."""
    products = generate_products(2000, seed=1)
    for c in CATEGORIES:
        for name, values in c.options:
            for v in values if name != "size" else ():
                others = [w for w in values if w != v]
                assert all(token_set_ratio(v, w) <= 85 for w in others), (name, v)
    for p in products:
        text = " ".join((p.title, *p.features, p.description)).lower()
        for values in p.options.values():
            assert not [v for v in values if v in text], p.asin


def test_every_goal_is_met_in_full_by_its_product() -> None:
    products = generate_products(300, seed=2)
    by_asin = {p.asin: p for p in products}
    for i in range(0, 3000, 7):
        g = generate_goal(products, i, seed=2)
        p = by_asin[g.asin]
        assert 1 <= len(g.attributes) <= 3 and set(g.goal_options) == set(p.options)
        assert (
            p.price < g.price_upper and f"price lower than {g.price_upper:.2f} dollars" in g.instruction_text
        )
        assert all(a in g.instruction_text for a in g.attributes)
        parts = purchase_reward(p, g, dict(g.goal_options))
        assert parts.score == 1.0 and binary(parts.score) == 1.0


def test_the_loader_reads_the_original_format(tmp_path) -> None:
    products, goals = load_original(write_fixture(tmp_path / "data"))
    assert [p.asin for p in products] == [SHAMPOO, TWIN, CABLE]  # the "nan" asin is skipped
    shampoo, _, cable = products
    assert shampoo.options == {"scent": ("lavender", "rose"), "size": ("8 fl oz", "16 fl oz")}
    assert shampoo.price == 12.99 and 7.5 <= cable.price <= 9.5 and cable.options == {}
    assert shampoo.attributes == ("sulfate free", "tea tree", "paraben free")
    assert cable.features == ("Gentle every day.", "Ships fast.")
    assert len(goals) == 4 and {g.asin for g in goals} == {SHAMPOO}  # one goal per option combination
    texts = sorted(g.instruction_text.split(", and price")[0] for g in goals)
    assert texts[0] == "i need a sulfate free tea tree shampoo with scent: lavender, and size: 16 fl oz"
    assert all(g.price_upper in (20.0, 30.0, 40.0, 50.0) and g.price_upper > 20 for g in goals)
    _, human = load_original(tmp_path / "data", human=True)
    assert [g.goal_options for g in human] == [{"0": "lavender"}]
    assert human[0].instruction_text.startswith("I want a tea tree shampoo that is sulfate free, in lavender")


def test_a_missing_or_malformed_file_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(WebShopDataError, match="data folder not found"):
        load_original(tmp_path / "nowhere")
    data = write_fixture(tmp_path / "data")
    (data / "items_ins_v2_1000.json").unlink()
    with pytest.raises(WebShopDataError, match=r"items_ins_v2\*\.json"):
        load_original(data)
    data = write_fixture(tmp_path / "data2")
    (data / "items_shuffle_1000.json").write_text("[{not json")
    with pytest.raises(WebShopDataError, match=r"items_shuffle_1000\.json is not valid JSON"):
        load_original(data)
    (data / "items_shuffle_1000.json").write_text(json.dumps([{"asin": "B01"}]))
    with pytest.raises(WebShopDataError, match=r"items_shuffle_1000\.json: product #0 is malformed"):
        load_original(data)
    data = write_fixture(tmp_path / "data3")
    (data / "items_human_ins.json").unlink()
    with pytest.raises(WebShopDataError, match=r"items_human_ins\.json"):
        load_original(data, human=True)


def test_an_original_data_folder_plays_through_the_env(tmp_path) -> None:
    import envs

    env = envs.make("WebShop", data_dir=str(write_fixture(tmp_path / "d")), index_dir=str(tmp_path))
    env.reset(0)
    assert env.goal.asin == SHAMPOO
    assert "b000shamp1" in env.step("search[tea tree shampoo]").observation


def test_the_index_is_cached_by_digest_and_rebuilt_on_change(tmp_path) -> None:
    products = generate_products(100, seed=0)
    first = BM25Search(products, tmp_path)
    assert not first.loaded_from_cache and (first.path / "digest.json").is_file()
    again = BM25Search(products, tmp_path)
    assert again.loaded_from_cache and again.path == first.path
    assert again.search("gluten free protein bar") == first.search("gluten free protein bar")
    changed = BM25Search(generate_products(100, seed=1), tmp_path)
    assert not changed.loaded_from_cache and changed.path != first.path
    (first.path / "digest.json").write_text("{}")  # a damaged cache is rebuilt, not trusted
    assert not BM25Search(products, tmp_path).loaded_from_cache
    hits = first.search("gluten free protein bar", k=50)
    assert hits and all(products[i].category == "food" for i in hits[:3])
    assert first.search("zzzz qqqq") == [] and first.search("") == []
