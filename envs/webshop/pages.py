"""WebShop's pages as text: what each shows and which of its elements can be clicked.

The text is WebShop's ``text`` observation mode: the page's visible strings joined by ``[SEP]``.
Clickable names are lower case, as WebShop's ``get_available_actions`` lists them: ``back to
search``, ``next >``, ``< prev``, product asins, option values, ``description``, ``features``,
``reviews``, ``buy now``.

Pages: ``search`` (the instruction and a search box), ``results`` (10 products a page of the top 50
hits, ``< Prev`` / ``Next >``, ``Back to Search``), ``item`` (options, title, price, rating, the
``Description`` / ``Features`` / ``Reviews`` tabs, ``Buy Now``), the three tabs (``< Prev`` returns to
the item), and ``done`` after a purchase. Every page's text is cut at :data:`MAX_PAGE_CHARS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envs.webshop.catalogue import Product

PRODUCT_WINDOW = 10
MAX_PAGE_CHARS = 6000
SEP = " [SEP] "
BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"
TABS = ("description", "features", "reviews")


@dataclass
class PageState:
    """Where the browser is: the page kind and what it shows."""

    kind: str = "search"  # search | results | item | description | features | reviews | done
    hits: list[Product] = field(default_factory=list)
    page: int = 1
    item: Product | None = None
    chosen: dict[str, str] = field(default_factory=dict)

    def window(self) -> list[Product]:
        return self.hits[(self.page - 1) * PRODUCT_WINDOW : self.page * PRODUCT_WINDOW]

    def last_page(self) -> int:
        return max(1, -(-len(self.hits) // PRODUCT_WINDOW))


def clickables(state: PageState) -> list[str]:
    """The page's clickable names, in page order (WebShop's ``text_to_clickable`` keys)."""
    if state.kind == "search" or state.kind == "done":
        return []
    if state.kind == "results":
        out = [BACK]
        if state.page > 1:
            out.append(PREV)
        if state.page < state.last_page():
            out.append(NEXT)
        return out + [p.asin.lower() for p in state.window()]
    if state.kind == "item" and state.item is not None:
        values = [v for vals in state.item.options.values() for v in vals]
        return [BACK, PREV, *dict.fromkeys(values), *TABS, BUY]
    return [BACK, PREV]  # a tab


def _item_text(p: Product) -> list[str]:
    parts: list[str] = []
    for name, values in p.options.items():
        parts += [name, *values]
    return [
        *parts,
        p.title,
        f"Price: {p.price_tag()}",
        f"Rating: {p.rating}",
        "Description",
        "Features",
        "Reviews",
        "Buy Now",
    ]


def _tab_text(kind: str, p: Product) -> list[str]:
    if kind == "description":
        return [p.description]
    if kind == "features":
        return list(p.features)
    return [f"{score} {body}" for score, body in p.reviews] or ["No reviews yet."]


def page_text(state: PageState, instruction: str) -> str:
    """The page as WebShop's text mode shows it, cut at :data:`MAX_PAGE_CHARS`."""
    head = ["Instruction:", instruction]
    if state.kind == "search":
        parts = [*head, "Search"]
    elif state.kind == "results":
        parts = [*head, "Back to Search", f"Page {state.page} (Total results: {len(state.hits)})"]
        if state.page > 1:
            parts.append("< Prev")
        if state.page < state.last_page():
            parts.append("Next >")
        for p in state.window():
            parts += [p.asin, p.title, p.price_tag()]
    elif state.kind == "done":
        parts = ["Thank you for shopping with us!"]
    else:
        assert state.item is not None
        body = _item_text(state.item) if state.kind == "item" else _tab_text(state.kind, state.item)
        parts = [*head, "Back to Search", "< Prev", *body]
    text = SEP.join(parts)
    return text if len(text) <= MAX_PAGE_CHARS else text[: MAX_PAGE_CHARS - 3] + "..."
