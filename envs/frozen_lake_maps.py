"""FrozenLake's maps and dynamics: RAGEN's seeded map generator, redone on the seed's raw PCG64
outputs (:class:`Stream`), the path check, gymnasium's transition table, and the data derived from a
map that every env on it shares (:class:`MapData`), with the caches that serve a group's envs.

See :mod:`envs.frozen_lake` for the behaviour this reproduces (RAGEN's generator call for call,
gymnasium's slips draw for draw).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np

_K = TypeVar("_K")
_V = TypeVar("_V")

LEFT, DOWN, RIGHT, UP = range(4)
_CELL_SYMBOL = {"S": "_", "F": "_", "H": "O", "G": "G"}
_PLAYER_SYMBOL = {"S": "P", "F": "P", "H": "X", "G": "√"}
#: gymnasium's ``success_rate`` default and its ``fail_rate`` as gymnasium computes it (bit-exact).
_SUCCESS_RATE = 1.0 / 3.0
_FAIL_RATE = (1.0 - _SUCCESS_RATE) / 2.0
#: Maps (by seed) and derived map data (by map) kept for reuse, e.g. by the envs of one group.
_CACHE_SIZE = 4096

Transition = tuple[float, int, float, bool]
"""``(probability, next_state, reward, terminated)``, as in gymnasium's ``env.unwrapped.P``."""


#: Cell letters to bits of a row-major mask (read reversed): not a hole, a goal.
_FREE_BIT = str.maketrans("SFGH", "1110")
_GOAL_BIT = str.maketrans("SFGH", "0010")


# Map generation ------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _column_masks(nrow: int, ncol: int) -> tuple[int, int]:
    """Bitmasks (bit ``r * ncol + c``) of the cells not in the first and not in the last column."""
    not_first = not_last = 0
    for r in range(nrow):
        for c in range(ncol):
            if c:
                not_first |= 1 << (r * ncol + c)
            if c != ncol - 1:
                not_last |= 1 << (r * ncol + c)
    return not_first, not_last


def _connected(free: int, start: int, goals: int, nrow: int, ncol: int) -> bool:
    """Whether a 4-connected path inside ``free`` joins bit ``start`` to a bit of ``goals``.

    Flood fill on a row-major bitmask: shifting by 1 moves a column, by ``ncol`` a row; the column
    masks drop what a column shift wraps into the next row. ``free`` must contain ``start``.
    """
    not_first, not_last = _column_masks(nrow, ncol)
    seen = 1 << start
    while not seen & goals:
        grown = (seen | (seen << 1) & not_first | (seen >> 1) & not_last | seen << ncol | seen >> ncol) & free
        if grown == seen:
            return False
        seen = grown
    return True


def has_path(desc: Sequence[str]) -> bool:
    """Whether a 4-connected path of non-hole cells leads from ``S`` to a ``G``."""
    nrow, ncol = len(desc), len(desc[0])
    flat = "".join(desc)
    if "S" not in flat:
        raise ValueError("desc has no start cell 'S'")
    free = int(flat.translate(_FREE_BIT)[::-1], 2)
    goals = int(flat.translate(_GOAL_BIT)[::-1], 2)
    return _connected(free, flat.index("S"), goals, nrow, ncol)


UNIT = 1.0 / 9007199254740992.0  # 2**-53: PCG64's double from a 64-bit output, ``(x >> 11) * UNIT``
_RAW_BLOCK = 32


class Stream:
    """The 64-bit outputs of one ``numpy.random.default_rng(seed)``, read the way numpy reads them.

    numpy's ``Generator`` on PCG64 turns one output ``x`` into ``random()`` as ``(x >> 11) * 2**-53``
    and serves ``integers(0, n)`` (``n < 2**32``) by Lemire's method on 32-bit halves (low half
    first, the high half kept for the next 32-bit request; doubles do not touch that half). Reading
    the outputs in blocks (``bit_generator.random_raw``) and redoing that arithmetic in Python gives
    the same numbers as the generator's calls for a fraction of their per-call cost. Several
    readers at different positions share the outputs list: the map generator and the slip stream
    both start at the seed's first output, as two fresh generators would.
    """

    __slots__ = ("bitgen", "half", "pos", "words")

    def __init__(self, seed: int | None, n: int = _RAW_BLOCK) -> None:
        self.bitgen = np.random.default_rng(seed).bit_generator
        self.words: list[int] = self.bitgen.random_raw(n).tolist()
        self.pos = 0
        self.half: int | None = None

    def fork(self) -> Stream:
        """Another reader of the same outputs, at the first one."""
        other = Stream.__new__(Stream)
        other.bitgen, other.words, other.pos, other.half = self.bitgen, self.words, 0, None
        return other

    def word(self, pos: int) -> int:
        """Output number ``pos`` of the seed's stream (fetched on demand, in order)."""
        words = self.words
        while pos >= len(words):
            words += self.bitgen.random_raw(_RAW_BLOCK).tolist()
        return words[pos]

    def uniforms(self, n: int) -> list[float]:
        """``rng.random(n)``, advancing this reader."""
        pos, self.pos = self.pos, self.pos + n
        self.word(self.pos - 1)
        return [(x >> 11) * UNIT for x in self.words[pos : self.pos]]

    def _uint32(self) -> int:
        half = self.half
        if half is not None:
            self.half = None
            return half
        x = self.word(self.pos)
        self.pos += 1
        self.half = x >> 32
        return x & 0xFFFFFFFF

    def integer(self, n: int) -> int:
        """``rng.integers(0, n)`` for ``1 <= n < 2**32`` (numpy's bounded Lemire on 32 bits)."""
        m = self._uint32() * n
        leftover = m & 0xFFFFFFFF
        if leftover < n:
            threshold = (0x100000000 - n) % n
            while leftover < threshold:
                m = self._uint32() * n
                leftover = m & 0xFFFFFFFF
        return m >> 32


def _draw_map(size: int, p: float, stream: Stream) -> tuple[str, ...]:
    """RAGEN's generator loop on a fresh seed stream (validated ``size`` and ``p``); the map's rows.

    RAGEN's calls, in order, on ``rng = default_rng(seed)``::

        while True:
            board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
            while True:  # start and goal, redrawn until they differ
                start_r, start_c = rng.integers(0, size), rng.integers(0, size)
                goal_r, goal_c = rng.integers(0, size), rng.integers(0, size)
                if (start_r, start_c) != (goal_r, goal_c):
                    break
            ...  # place S and G; keep the board if a path joins them

    ``Generator.choice`` with ``p`` normalises the cumulative probabilities (``cdf = p.cumsum();
    cdf /= cdf[-1]``), draws ``rng.random(shape)`` and takes ``cdf.searchsorted(u, side="right")``:
    a cell is frozen exactly when ``u < p / (p + (1 - p))``. :class:`Stream` reproduces
    ``random`` and ``integers`` from the raw outputs, so this yields RAGEN's map for the seed
    (``tests/envs/test_frozen_lake.py`` checks it against those literal calls).
    """
    n = size * size
    frozen_below = p / (p + (1.0 - p))  # numpy's normalised cdf[0], bit for bit
    while True:
        cells = ["F" if u < frozen_below else "H" for u in stream.uniforms(n)]
        while True:
            start_r, start_c = stream.integer(size), stream.integer(size)
            goal_r, goal_c = stream.integer(size), stream.integer(size)
            if (start_r, start_c) != (goal_r, goal_c):
                break
        start, goal = start_r * size + start_c, goal_r * size + goal_c
        cells[start], cells[goal] = "S", "G"
        flat = "".join(cells)
        free = int(flat.translate(_FREE_BIT)[::-1], 2)  # bit i set: cell i is not a hole
        if _connected(free, start, 1 << goal, size, size):
            return tuple(flat[i : i + size] for i in range(0, n, size))


def check_map_args(size: int, p: float) -> float:
    if size < 2:
        raise ValueError(f"FrozenLake size must be >= 2, got {size}")
    p = min(1.0, float(p))
    if p <= 0.0:
        raise ValueError(f"FrozenLake p (probability of a frozen cell) must be > 0, got {p}")
    return p


class _LRU(Generic[_K, _V]):
    """A small least-recently-used map: ``get`` refreshes an entry, ``put`` evicts the oldest."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[_K, _V] = OrderedDict()

    def get(self, key: _K) -> _V | None:
        value = self._items.get(key)
        if value is not None:  # to the newest end (pop + set: safe if another thread evicted it)
            self._items.pop(key, None)
            self._items[key] = value
        return value

    def put(self, key: _K, value: _V) -> None:
        self._items[key] = value
        if len(self._items) > self.maxsize:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


#: Generated maps by ``(size, p, seed)``: envs of one group reset with the same seed.
_MAPS: _LRU[tuple[int, float, int], tuple[str, ...]] = _LRU(_CACHE_SIZE)


def seeded_map(size: int, p: float, seed: int, stream: Stream | None = None) -> tuple[str, ...]:
    """The map of ``seed`` (cached); ``stream``, if given, is the seed's (its readers are not moved)."""
    key = (size, p, seed)
    desc = _MAPS.get(key)
    if desc is None:
        desc = _draw_map(size, p, Stream(seed) if stream is None else stream.fork())
        _MAPS.put(key, desc)
    return desc


def generate_map(size: int, p: float, seed: int | None) -> list[str]:
    """A random ``size`` x ``size`` map with a random start and goal and a path between them.

    Same numpy calls in the same order as RAGEN's generator, so a seed names the same map.
    ``p`` is the probability that a cell is frozen (RAGEN's docstring says hole; its code says frozen).
    """
    p = check_map_args(size, p)
    if seed is None:
        return list(_draw_map(size, p, Stream(None)))
    return list(seeded_map(size, p, seed))


def _state_transitions(desc: Sequence[str], s: int, is_slippery: bool) -> dict[int, list[Transition]]:
    """gymnasium's ``P[s]`` for ``desc``: ``{action: [(prob, next_state, reward, terminated), ...]}``."""
    nrow, ncol = len(desc), len(desc[0])
    r, c = divmod(s, ncol)
    if desc[r][c] in "GH":
        return {a: [(1.0, s, 0.0, True)] for a in range(4)}

    def outcome(a: int) -> tuple[int, float, bool]:
        if a == LEFT:
            nr, nc = r, max(c - 1, 0)
        elif a == DOWN:
            nr, nc = min(r + 1, nrow - 1), c
        elif a == RIGHT:
            nr, nc = r, min(c + 1, ncol - 1)
        else:
            nr, nc = max(r - 1, 0), c
        letter = desc[nr][nc]
        return nr * ncol + nc, 1.0 if letter == "G" else 0.0, letter in "GH"

    if not is_slippery:
        return {a: [(1.0, *outcome(a))] for a in range(4)}
    return {
        a: [(_SUCCESS_RATE if b == a else _FAIL_RATE, *outcome(b)) for b in ((a - 1) % 4, a, (a + 1) % 4)]
        for a in range(4)
    }


def build_transitions(
    desc: Sequence[str], is_slippery: bool = True
) -> dict[int, dict[int, list[Transition]]]:
    """gymnasium's transition table ``P`` for ``desc`` (same structure, order and floats)."""
    return {s: _state_transitions(desc, s, is_slippery) for s in range(len(desc) * len(desc[0]))}


@lru_cache(maxsize=64)
def _moves(nrow: int, ncol: int) -> list[tuple[int, int, int, int]]:
    """Per state, the cell each of ``Left, Down, Right, Up`` leads to (bumping the border stays)."""
    out = []
    for r in range(nrow):
        for c in range(ncol):
            out.append(
                (
                    r * ncol + max(c - 1, 0),
                    min(r + 1, nrow - 1) * ncol + c,
                    r * ncol + min(c + 1, ncol - 1),
                    max(r - 1, 0) * ncol + c,
                )
            )
    return out


#: Sampling a slippery move exactly as the table does: cumulative (fail, success, fail) thresholds.
SLIP_FIRST = _FAIL_RATE
SLIP_SECOND = _FAIL_RATE + _SUCCESS_RATE
_CELL_TEXT = str.maketrans(_CELL_SYMBOL)


class MapData:
    """Everything derived from one map, shared by every env on that map (read-only for them).

    Reset only looks the map up (a new random map per episode is the common case, and episodes are
    short), so it holds just the cell letters: ``step`` samples a move from the geometry, the text
    is one base string with the player spliced in (memoised per state), and the full transition
    table (``transition_table``, the oracle) is built the first time it is asked for.
    """

    __slots__ = (
        "base",
        "desc",
        "flat",
        "goal_states",
        "is_slippery",
        "moves",
        "ncol",
        "oracle",
        "renders",
        "start_state",
        "table",
        "terminal",
    )

    def __init__(self, desc: tuple[str, ...], is_slippery: bool) -> None:
        self.desc = list(desc)
        self.is_slippery = is_slippery
        self.ncol = len(desc[0])
        self.flat = flat = "".join(desc)
        self.start_state = flat.index("S")
        self.goal_states = frozenset(i for i, ch in enumerate(flat) if ch == "G")
        self.terminal = [ch in "GH" for ch in flat]
        self.moves = _moves(len(desc), self.ncol)
        self.base = "\n".join(desc).translate(_CELL_TEXT)
        self.renders: dict[int, str] = {}
        self.table: dict[int, dict[int, list[Transition]]] | None = None
        self.oracle: tuple[list[list[int]], float] | None = None

    def full_table(self) -> dict[int, dict[int, list[Transition]]]:
        if self.table is None:
            self.table = build_transitions(self.desc, self.is_slippery)
        return self.table

    def render(self, state: int) -> str:
        text = self.renders.get(state)
        if text is None:
            k = state + state // self.ncol  # one newline per row above
            text = self.base[:k] + _PLAYER_SYMBOL[self.flat[state]] + self.base[k + 1 :]
            self.renders[state] = text
        return text


#: Map data by ``(rows, is_slippery)``.
_MAP_DATA: _LRU[tuple[tuple[str, ...], bool], MapData] = _LRU(_CACHE_SIZE)


def map_data(desc: tuple[str, ...], is_slippery: bool) -> MapData:
    key = (desc, is_slippery)
    data = _MAP_DATA.get(key)
    if data is None:
        data = MapData(desc, is_slippery)
        _MAP_DATA.put(key, data)
    return data


def clear_caches() -> None:
    """Forget the cached maps and map data (benchmarks use it to time the uncached path)."""
    _MAPS.clear()
    _MAP_DATA.clear()
