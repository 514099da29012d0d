"""The generated catalogue's vocabularies: WebShop's five categories, their product types,
attributes, options and price ranges.

The structure is WebShop's (each product has a category path, a search query naming its type,
attributes, customisation options and a price); the words are ours. The option values are chosen so
that WebShop's option matching (size: exact; other options: fuzzy token-set ratio, then a substring
of the title, features or description) can tell them apart: no value is a token subset of another
value of the same option, and none is a substring of the generated text (a test checks both).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CategorySpec:
    """One WebShop category: its path prefix, product types, attribute pool and options."""

    name: str
    path: str
    types: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price: tuple[float, float]
    audiences: tuple[str, ...]


_COLORS = (
    "black",
    "white",
    "navy blue",
    "grey",
    "beige",
    "olive green",
    "pink",
    "brown",
    "crimson",
    "charcoal",
    "ivory",
    "teal",
)

CATEGORIES: tuple[CategorySpec, ...] = (
    CategorySpec(
        name="fashion",
        path="Clothing, Shoes & Jewelry › {audience} › Clothing",
        types=("t-shirt", "hoodie", "sweatshirt", "jeans", "dress", "sneakers", "jacket", "shorts"),
        attributes=(
            "machine wash",
            "wash cold",
            "long sleeve",
            "short sleeve",
            "slim fit",
            "cotton spandex",
            "button closure",
            "elastic waistband",
            "tumble dry",
            "hand wash",
            "relaxed fit",
            "drawstring closure",
        ),
        options=(("color", _COLORS), ("size", ("small", "medium", "large", "x-large", "xx-large"))),
        price=(9.0, 70.0),
        audiences=("Men", "Women"),
    ),
    CategorySpec(
        name="beauty",
        path="Beauty & Personal Care › {audience}",
        types=(
            "shampoo",
            "conditioner",
            "lipstick",
            "eyeshadow palette",
            "face serum",
            "body lotion",
            "nail polish",
            "hair oil",
        ),
        attributes=(
            "paraben free",
            "cruelty free",
            "long lasting",
            "natural ingredients",
            "sulfate free",
            "dry skin",
            "sensitive skin",
            "tea tree",
            "hyaluronic acid",
            "vitamin c",
            "easy apply",
            "travel size",
        ),
        options=(
            ("scent", ("lavender", "rose", "coconut", "unscented", "citrus", "eucalyptus", "vanilla")),
            ("size", ("2 fl oz", "4 fl oz", "8 fl oz", "16 fl oz", "pack of 2")),
        ),
        price=(5.0, 45.0),
        audiences=("Hair Care", "Skin Care", "Makeup"),
    ),
    CategorySpec(
        name="electronics",
        path="Electronics › {audience}",
        types=(
            "wireless earbuds",
            "bluetooth speaker",
            "phone case",
            "charging cable",
            "hdmi cable",
            "power bank",
            "wireless charger",
            "watch band",
        ),
        attributes=(
            "fast charging",
            "high definition",
            "noise cancelling",
            "water resistant",
            "easy install",
            "long battery life",
            "hands free",
            "usb port",
            "heavy duty",
            "high speed",
            "plug play",
            "light weight",
        ),
        options=(("color", _COLORS), ("length", ("3 ft", "6 ft", "10 ft", "15 ft"))),
        price=(8.0, 90.0),
        audiences=("Accessories & Supplies", "Portable Audio", "Cell Phones"),
    ),
    CategorySpec(
        name="furniture",
        path="Home & Kitchen › Furniture › {audience}",
        types=(
            "bar stool",
            "nightstand",
            "bookshelf",
            "pillow cover",
            "area rug",
            "office chair",
            "coffee table",
            "curtain panel",
        ),
        attributes=(
            "easy assemble",
            "solid wood",
            "living room",
            "storage space",
            "non slip",
            "easy clean",
            "wood finish",
            "metal legs",
            "bedroom",
            "mid century",
            "hand painted",
            "pu leather",
        ),
        options=(("color", _COLORS), ("size", ("16x16 inch", "18x18 inch", "20x20 inch", "24x24 inch"))),
        price=(15.0, 180.0),
        audiences=("Living Room Furniture", "Bedroom Furniture", "Home Office Furniture"),
    ),
    CategorySpec(
        name="food",
        path="Grocery & Gourmet Food › {audience}",
        types=(
            "green tea",
            "coffee beans",
            "protein bar",
            "beef jerky",
            "trail mix",
            "olive oil",
            "granola",
            "hot sauce",
        ),
        attributes=(
            "gluten free",
            "non gmo",
            "low sugar",
            "sugar free",
            "keto friendly",
            "high protein",
            "usda organic",
            "individually wrapped",
            "low carb",
            "dairy free",
            "ready eat",
            "plant based",
        ),
        options=(
            ("flavor", ("mint", "honey", "sea salt", "peanut butter", "smoky", "cinnamon", "lemon")),
            ("size", ("pack of 1", "pack of 3", "pack of 6", "pack of 12")),
        ),
        price=(4.0, 40.0),
        audiences=("Snack Foods", "Beverages", "Pantry Staples"),
    ),
)

BRAND_SYLLABLES: tuple[str, ...] = (
    "lu",
    "mo",
    "ra",
    "ve",
    "zo",
    "ki",
    "na",
    "tel",
    "por",
    "quin",
    "sa",
    "dor",
    "fi",
    "gan",
    "hex",
)

#: Generic sentences of descriptions and features; free of every option value (see the module doc).
FILLERS: tuple[str, ...] = (
    "Designed for everyday use and built to last.",
    "Makes a thoughtful gift for family and friends.",
    "Our customer service team answers within one day.",
    "Each item is checked by hand before it ships.",
    "Packed with care in recyclable packaging.",
    "Loved by thousands of happy customers.",
    "A simple choice you can count on.",
    "Easy to store when not in use.",
)

REVIEW_BODIES: tuple[str, ...] = (
    "Works as described, would buy again.",
    "Good value for the money.",
    "Not what I expected, but it does the job.",
    "Arrived quickly and well packed.",
    "Quality could be better.",
    "My second one, still happy with it.",
)

OPENERS: tuple[str, ...] = ("i need", "i want", "i am looking for", "find me", "i would like")
