"""A tiny WebShop data folder in the original files' exact format, and the goals it gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the goal product, its dearer twin (same type, attributes and options), and a product of another type
SHAMPOO, TWIN, CABLE = "B000SHAMP1", "B000SHAMP2", "B000CABLE1"


def _item(asin: str, name: str, query: str, category: str, pricing: str, options: Any) -> dict[str, Any]:
    return {
        "asin": asin,
        "name": name,
        "category": "beauty" if "Beauty" in category else "electronics",
        "query": query,
        "product_category": category,
        "full_description": f"{name}. Made with care.",
        "small_description": ["Gentle every day.", "Ships fast."],
        "pricing": pricing,
        "images": ["https://example.invalid/a.jpg"],
        "customization_options": options,
        "brand": "dropped by the engine",
    }


def items() -> list[dict[str, Any]]:
    shampoo_options = {
        "Scent": [{"value": "Lavender", "image": None}, {"value": "Rose", "image": None}],
        "Size": [{"value": "8 fl oz", "image": None}, {"value": "16 fl oz", "image": None}],
    }
    hair = "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos"
    return [
        _item(SHAMPOO, "Herbia Sulfate Free Tea Tree Shampoo", "shampoo", hair, "$12.99", shampoo_options),
        _item(
            TWIN,
            "Herbia Sulfate Free Tea Tree Shampoo Salon Edition",
            "shampoo",
            hair,
            "$99.99",
            shampoo_options,
        ),
        _item(
            CABLE,
            "Cablex HDMI Cable",
            "hdmi cable",
            "Electronics › Accessories › Cables › HDMI Cables",
            "$7.50 - $9.50",
            None,
        ),
        {"asin": "nan", "name": "skipped: a bad asin"},
    ]


def attributes() -> dict[str, Any]:
    return {
        SHAMPOO: {
            "attributes": ["sulfate free", "tea tree", "paraben free"],
            "instruction": "i need a sulfate free tea tree shampoo",
            "instruction_attributes": ["sulfate free", "tea tree"],
        },
        TWIN: {"attributes": ["sulfate free", "tea tree", "paraben free"]},
        CABLE: {"attributes": ["high speed"]},
    }


def human() -> dict[str, Any]:
    return {
        SHAMPOO: [
            {
                "asin": SHAMPOO,
                "instruction": "I want a tea tree shampoo that is sulfate free, in lavender.",
                "instruction_attributes": ["tea tree", "sulfate free"],
                "instruction_options": ["lavender"],
            }
        ]
    }


def write_fixture(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "items_shuffle_1000.json").write_text(json.dumps(items()))
    (root / "items_ins_v2_1000.json").write_text(json.dumps(attributes()))
    (root / "items_human_ins.json").write_text(json.dumps(human()))
    return root
