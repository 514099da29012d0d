"""Product search: BM25 over each product's text with ``bm25s`` (no Java), cached on disk.

WebShop searches a Lucene index (pyserini) of every product's text and shows the top 50 hits. Here
the same ranking function (BM25, Lucene's default; ``k1=1.5, b=0.75`` as bm25s' default, Lucene
uses ``k1=0.9, b=0.4``) runs in-process through ``bm25s``. Text is lower-cased and cut into words of
letters and digits, without English stop words; there is no stemming.

The index is built once per catalogue: its folder under ``<state folder>/webshop/`` is named by the
sha256 of everything indexed (and the tokenizer and library versions), so a changed catalogue gets a
new index and an unchanged one is loaded, never rebuilt. A folder that fails to load is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from envs.webshop.catalogue import Product

SEARCH_RETURN_N = 50
TOKENIZER_VERSION = "1"
_WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
        "i",
        "me",
        "my",
        "we",
        "you",
        "your",
        "need",
        "want",
        "looking",
        "find",
        "would",
        "like",
        "am",
    ]
)


def tokenize(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def product_text(p: Product) -> str:
    """What a product is found by: title, type, attributes, features and description."""
    return " ".join((p.title, p.query, " ".join(p.attributes), " ".join(p.features), p.description))


class Searcher(Protocol):
    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[int]:
        """Indices of the best-matching products (score > 0), best first."""
        ...


def state_dir() -> Path:
    """The state folder (``$RAGEN_STATE_DIR``, default ``.state``), as ``ragen_core`` resolves it."""
    return Path(os.environ.get("RAGEN_STATE_DIR", ".state"))


def _digest(docs: Sequence[list[str]]) -> str:
    import bm25s

    h = hashlib.sha256(f"bm25s={bm25s.__version__};tok={TOKENIZER_VERSION}\n".encode())
    for d in docs:
        h.update(" ".join(d).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


class BM25Search:
    """``bm25s`` over a catalogue; :meth:`search` returns product indices."""

    def __init__(self, products: Sequence[Product], cache_root: Path | None = None) -> None:
        import bm25s

        docs = [tokenize(product_text(p)) for p in products]
        self.n = len(docs)
        self.digest = _digest(docs)
        root = (cache_root if cache_root is not None else state_dir()) / "webshop"
        self.path = root / f"bm25-{self.digest[:16]}"
        self.loaded_from_cache = False
        retriever = self._load(bm25s) if (self.path / "params.index.json").is_file() else None
        if retriever is None:
            retriever = bm25s.BM25()
            retriever.index(docs, show_progress=False)
            self._save(retriever, root)
        else:
            self.loaded_from_cache = True
        self._bm25: Any = retriever
        self._vocab: dict[str, int] = dict(retriever.vocab_dict)

    def _load(self, bm25s: Any) -> Any:
        try:
            meta = json.loads((self.path / "digest.json").read_text())
            if meta.get("sha256") != self.digest:
                return None
            return bm25s.BM25.load(str(self.path))
        except (OSError, ValueError, KeyError):
            return None

    def _save(self, retriever: Any, root: Path) -> None:
        """Write to a temporary folder, then rename: a reader never sees half an index."""
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".bm25-"))
            retriever.save(str(tmp))
            (tmp / "digest.json").write_text(json.dumps({"sha256": self.digest, "n_docs": self.n}))
            if self.path.exists():
                shutil.rmtree(self.path, ignore_errors=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only state folder: the index lives in memory only, searching still works

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[int]:
        words = [w for w in tokenize(query) if w in self._vocab]
        if not words or self.n == 0:
            return []
        docs, scores = self._bm25.retrieve([words], k=min(k, self.n), show_progress=False, n_threads=0)
        return [int(d) for d, s in zip(docs[0], scores[0], strict=True) if s > 0]
