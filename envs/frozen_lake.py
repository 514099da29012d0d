"""FrozenLake: a multi-turn, stochastic grid walk to a goal between holes.

Behaviour follows RAGEN (see docs/architecture.md, "Environment API"), which wraps gymnasium's
``FrozenLake-v1``; the dynamics are re-implemented here so that ``envs`` needs only numpy (gymnasium
is a test-only reference).

* **Map from the seed**, RAGEN's generator call for call: a ``numpy.random.default_rng(seed)`` draws
  a board of frozen (``F``, probability ``p``) and hole (``H``) cells, then a start and a goal cell
  uniformly (redrawn until they differ); the board is kept if a 4-connected path from start to goal
  avoids the holes, else everything is drawn again. The same seed gives RAGEN's map.
* **Slips from the seed**: a second ``default_rng(seed)``, consumed exactly as gymnasium does (one
  uniform draw at reset for the start state, one per step, sampled through the cumulative
  probabilities), so a seed and an action sequence give the trajectory RAGEN/gymnasium give.
* **Cheap resets** (random play ends an episode every few steps, so resets dominate): both streams
  are read from one block of the seed's raw PCG64 outputs, redoing numpy's ``random``/``integers``
  arithmetic (:class:`_Stream`; same numbers, tested against the literal calls); maps are cached by
  seed and everything derived from a map (render text, the transition table for the oracle) by map,
  built on first use and shared by the envs on that map (RAGEN's groups reset with one seed).
  Slippery moves go in the intended direction or either perpendicular one, 1/3 each; bumping into
  the border stays. Holes and the goal are absorbing; reward 1.0 on entering the goal.
* **Actions** ``Left, Down, Right, Up`` (RAGEN's 1..4 = gymnasium's 0..3).
* **Render**: ``P`` player, ``_`` frozen (the start cell too), ``O`` hole, ``G`` goal, ``X`` player
  in a hole, ``√`` (U+221A) player on the goal; rows joined by newlines, no separators.

The oracle (:func:`optimal_policy`, :func:`solve`) is finite-horizon value iteration: it maximises
the probability of reaching the goal within the episode's action budget (10 for the ``FrozenLake``
tag) and the policy depends on the number of actions left. ``success_prob`` is that probability
for the returned policy, so it is directly comparable with a measured success rate.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

from envs.base import Env, StepResult, cell_label, invalid_step

ACTIONS: list[str] = ["Left", "Down", "Right", "Up"]
LEFT, DOWN, RIGHT, UP = range(4)
_ACTION_INDEX = {name: i for i, name in enumerate(ACTIONS)}
GRID_VOCAB: dict[str, str] = {
    "P": "player",
    "_": "empty",
    "O": "hole",
    "G": "goal",
    "X": "player in hole",
    "√": "player on goal",
}
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


_UNIT = 1.0 / 9007199254740992.0  # 2**-53: PCG64's double from a 64-bit output, ``(x >> 11) * _UNIT``
_RAW_BLOCK = 32


class _Stream:
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

    def fork(self) -> _Stream:
        """Another reader of the same outputs, at the first one."""
        other = _Stream.__new__(_Stream)
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
        return [(x >> 11) * _UNIT for x in self.words[pos : self.pos]]

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


def _draw_map(size: int, p: float, stream: _Stream) -> tuple[str, ...]:
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
    a cell is frozen exactly when ``u < p / (p + (1 - p))``. :class:`_Stream` reproduces
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


def _check_map_args(size: int, p: float) -> float:
    if size < 2:
        raise ValueError(f"FrozenLake size must be >= 2, got {size}")
    p = min(1.0, float(p))
    if p <= 0.0:
        raise ValueError(f"FrozenLake p (probability of a frozen cell) must be > 0, got {p}")
    return p


class _LRU:
    """A small least-recently-used map: ``get`` refreshes an entry, ``put`` evicts the oldest."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        value = self._items.get(key)
        if value is not None:  # to the newest end (pop + set: safe if another thread evicted it)
            self._items.pop(key, None)
            self._items[key] = value
        return value

    def put(self, key: Any, value: Any) -> None:
        self._items[key] = value
        if len(self._items) > self.maxsize:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


#: Generated maps by ``(size, p, seed)``: envs of one group reset with the same seed.
_MAPS = _LRU(_CACHE_SIZE)


def _seeded_map(size: int, p: float, seed: int, stream: _Stream | None = None) -> tuple[str, ...]:
    """The map of ``seed`` (cached); ``stream``, if given, is the seed's (its readers are not moved)."""
    key = (size, p, seed)
    desc = _MAPS.get(key)
    if desc is None:
        desc = _draw_map(size, p, _Stream(seed) if stream is None else stream.fork())
        _MAPS.put(key, desc)
    return desc


def generate_map(size: int, p: float, seed: int | None) -> list[str]:
    """A random ``size`` x ``size`` map with a random start and goal and a path between them.

    Same numpy calls in the same order as RAGEN's generator, so a seed names the same map.
    ``p`` is the probability that a cell is frozen (RAGEN's docstring says hole; its code says frozen).
    """
    p = _check_map_args(size, p)
    if seed is None:
        return list(_draw_map(size, p, _Stream(None)))
    return list(_seeded_map(size, p, seed))


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
_SLIP_FIRST = _FAIL_RATE
_SLIP_SECOND = _FAIL_RATE + _SUCCESS_RATE
_CELL_TEXT = str.maketrans(_CELL_SYMBOL)


class _MapData:
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
_MAP_DATA = _LRU(_CACHE_SIZE)


def _map_data(desc: tuple[str, ...], is_slippery: bool) -> _MapData:
    key = (desc, is_slippery)
    data = _MAP_DATA.get(key)
    if data is None:
        data = _MapData(desc, is_slippery)
        _MAP_DATA.put(key, data)
    return data


def clear_caches() -> None:
    """Forget the cached maps and map data (benchmarks use it to time the uncached path)."""
    _MAPS.clear()
    _MAP_DATA.clear()


# The environment -----------------------------------------------------------------------------------
class FrozenLakeEnv(Env):
    """RAGEN's FrozenLake: random map, start and goal per seed; slippery ice; budgeted by the runner."""

    env_type: ClassVar[str] = "frozen_lake"
    success_means: ClassVar[str] = (
        "the player reaches the goal within the action budget; slips count, and falling into a hole "
        "ends the episode as a failure."
    )

    def __init__(
        self,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = True,
        map_seed: int | None = None,
        desc: Sequence[str] | None = None,
        think_holes: bool = False,
        coordinates: bool = False,
    ) -> None:
        """``map_seed`` fixes the map for every episode (``reset(seed)`` then only drives the slips);
        ``desc`` (rows of ``S``/``F``/``H``/``G``, exactly one ``S``) fixes a hand-made map. By default the
        map comes from the episode seed, as in RAGEN. ``think_holes`` adds the holes next to the player
        to the demonstrations' think text (:meth:`think_text`). ``coordinates`` adds the board's size and the
        goal's, the player's and the holes' (row, column) under the grid, as RAGEN's grid-plus-coordinates
        observation does: a small language model reads a position more easily than a 2-D layout."""
        if desc is not None:
            desc = [str(row) for row in desc]
            if len({len(row) for row in desc}) != 1 or "".join(desc).count("S") != 1:
                raise ValueError("desc must be equal-length rows with exactly one 'S'")
            if set("".join(desc)) - set("SFHG"):
                raise ValueError("desc may only contain S, F, H, G")
        elif size < 2:
            raise ValueError(f"FrozenLake size must be >= 2, got {size}")
        self.size = len(desc) if desc is not None else size
        self.p = p
        self.is_slippery = is_slippery
        self.map_seed = map_seed
        self.think_holes = think_holes
        self.coordinates = coordinates
        self._fixed_desc: tuple[str, ...] | None = tuple(desc) if desc is not None else None
        self.actions = list(ACTIONS)
        self.grid_vocab = dict(GRID_VOCAB)
        self.desc: list[str] = []
        self.nrow = self.ncol = 0
        self.state = 0
        self.start_state = 0
        self.goal_states: frozenset[int] = frozenset()
        self._data: _MapData | None = None
        self._stream: _Stream | None = None
        self._slip_pos = 0  # the slip stream's next output

    # Map ------------------------------------------------------------------------------------------
    def _set_map(self, data: _MapData) -> None:
        if data is self._data:
            return
        self._data = data
        self.desc = data.desc  # shared by every env on this map: read-only
        self.nrow, self.ncol = len(data.desc), data.ncol
        self.start_state = data.start_state
        self.goal_states = data.goal_states

    def match_action(self, action: str) -> int | None:
        """``Env.match_action``, with a dictionary hit first for the exact action names."""
        i = _ACTION_INDEX.get(action)
        if i is not None and self.actions == ACTIONS:
            return i
        return super().match_action(action)

    @property
    def _table(self) -> dict[int, dict[int, list[Transition]]]:
        return self._data.full_table() if self._data is not None else {}

    def transition_table(self) -> dict[int, dict[int, list[Transition]]]:
        """``{state: {action: [(prob, next_state, reward, terminated), ...]}}`` like gymnasium's ``P``."""
        return {s: {a: list(ts) for a, ts in row.items()} for s, row in self._table.items()}

    # Env API --------------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        """New map (unless fixed) and a fresh slip stream, both from ``seed``.

        Cheap: one block of the seed's raw outputs serves both the map (looked up, or drawn from
        the block's start) and the slips (also from its start); nothing else is built for the map
        until it is needed.
        """
        stream = _Stream(seed)
        if self._fixed_desc is not None:
            desc = self._fixed_desc
        elif self.map_seed is not None:
            desc = _seeded_map(self.size, _check_map_args(self.size, self.p), self.map_seed)
        else:
            desc = _seeded_map(self.size, _check_map_args(self.size, self.p), seed, stream)
        self._set_map(_map_data(desc, self.is_slippery))
        self._stream = stream
        self._slip_pos = 1  # gymnasium samples the (one-hot) start distribution: one uniform
        self.state = self.start_state
        return self.render()

    def step(self, action: str) -> StepResult:
        """Move (maybe slipping); unknown names change nothing. Every valid step consumes one draw.

        Samples the move exactly as gymnasium samples ``P[s][a]`` (the uniform against the cumulative
        probabilities of the (left-of, intended, right-of) moves); holes and the goal are absorbing.
        """
        data, stream = self._data, self._stream
        if stream is None or data is None:
            raise RuntimeError("FrozenLakeEnv.step() before reset(seed)")
        a = self.match_action(action)
        if a is None:
            return invalid_step(self.render())
        pos = self._slip_pos
        self._slip_pos = pos + 1
        u = ((stream.words[pos] if pos < len(stream.words) else stream.word(pos)) >> 11) * _UNIT
        prev = self.state
        if data.terminal[prev]:
            state, reward = prev, 0.0
        else:
            if data.is_slippery:
                a = (a - 1) % 4 if u < _SLIP_FIRST else a if u < _SLIP_SECOND else (a + 1) % 4
            state = data.moves[prev][a]
            reward = 1.0 if data.flat[state] == "G" else 0.0
        self.state = state
        info = {
            "success": state in data.goal_states,
            "action_is_valid": True,
            "action_is_effective": state != prev,
        }
        return StepResult(self._observation(data, state), reward, data.terminal[state], info)

    def render(self) -> str:
        """Grid text: ``P``/``X``/``√`` for the player, ``_`` frozen (start too), ``O`` hole, ``G`` goal."""
        if self._data is None:
            raise RuntimeError("FrozenLakeEnv.render() before reset(seed)")
        return self._observation(self._data, self.state)

    def _observation(self, data: _MapData, state: int) -> str:
        """The grid, and with ``coordinates`` the positions under it (zero-indexed (row, column))."""
        grid = data.render(state)
        if not self.coordinates:
            return grid
        ncol = data.ncol

        def cells(indices: Sequence[int]) -> str:
            return ", ".join(f"({i // ncol}, {i % ncol})" for i in indices)

        tile = data.flat[state]
        player = {"G": "Player on goal", "H": "Player in hole"}.get(tile, "Player")
        holes = [i for i, ch in enumerate(data.flat) if ch == "H"]
        lines = [
            f"Board size: {len(data.desc)} rows x {ncol} cols (zero-indexed).",
            f"Goal: {cells(sorted(data.goal_states))}",
            f"{player}: {cells([state])}",
        ]
        if holes:
            lines.append(f"Holes: {cells(holes)}")
        return grid + "\n" + "\n".join(lines)

    @property
    def done(self) -> bool:
        """Whether the player stands in a hole or on the goal (absorbing)."""
        return self._data is not None and self._data.terminal[self.state]

    @property
    def success(self) -> bool:
        return self.state in self.goal_states

    # Oracle ---------------------------------------------------------------------------------------
    def oracle_action(self, steps_left: int = 10) -> str:
        """The action that maximises P(reach the goal within ``steps_left`` actions) from here."""
        data = self._data
        if data is None:
            raise RuntimeError("FrozenLakeEnv.oracle_action() before reset(seed)")
        if data.oracle is None or len(data.oracle[0]) < steps_left:
            data.oracle = optimal_policy(self, horizon=max(steps_left, 10))
        return ACTIONS[policy_action(data.oracle[0], self.state, steps_left)]

    def oracle_actions(self, actions_left: int, max_actions: int, turns_left: int) -> list[str]:
        """The optimal policy followed along the intended (non-slip) moves, ``ceil(actions_left /
        turns_left)`` actions at most, so that the whole budget can be used over the turns left.

        FrozenLake is stochastic, so its oracle is a closed-loop policy; one turn commits to several
        actions, planned as if no slip happened, and the next turn plans again from wherever the
        player ended up. Stops early at a hole or the goal along the intended moves.
        """
        per_turn = math.ceil(actions_left / max(turns_left, 1))
        cap = max(0, min(max_actions, actions_left))
        table, _ = optimal_policy(self, horizon=max(actions_left, 1))
        intended = build_transitions(self.desc, is_slippery=False)
        state, out = self.state, []
        for k in range(min(per_turn, cap)):
            a = policy_action(table, state, actions_left - k)
            out.append(ACTIONS[a])
            _, state, _, terminal = intended[state][a][0]
            if terminal:
                break
        return out

    def think_text(self, actions: Sequence[str]) -> str:
        """``Player (r,c), goal (r,c). I should go Left.`` (0-based cells); with ``think_holes``,
        ``Player (r,c), goal (r,c). Holes: Down Up. I should go Left.`` (``Holes: none.`` when no
        neighbour is one).

        The holes are named as the moves that fall into them, in ``ACTIONS`` order: a policy that has
        written them can learn to avoid them by matching its answer against its own think text, where
        from the grid alone it must work out which neighbours of its position are holes (which the
        tiny policy on frozenlake-tiny did not learn from the reward: most failures were a first or
        second move into a hole).
        """
        first = actions[0] if actions else ""
        goals = " and ".join(cell_label(g, self.ncol) for g in sorted(self.goal_states))
        text = f"Player {cell_label(self.state, self.ncol)}, goal {goals}."
        if self.think_holes:
            holes = " ".join(ACTIONS[a] for a in self.hole_moves())
            text += f" Holes: {holes or 'none'}."
        return f"{text} I should go {first}."

    def hole_moves(self) -> list[int]:
        """The actions (indices into ``ACTIONS``) whose intended move from the player's cell enters a
        hole; a move off the board stays put, so it never does."""
        if not self.desc:
            raise RuntimeError("FrozenLakeEnv.hole_moves() before reset(seed)")
        r, c = divmod(self.state, self.ncol)
        steps = {LEFT: (0, -1), DOWN: (1, 0), RIGHT: (0, 1), UP: (-1, 0)}
        out = []
        for a, (dr, dc) in steps.items():
            rr, cc = r + dr, c + dc
            if 0 <= rr < self.nrow and 0 <= cc < self.ncol and self.desc[rr][cc] == "H":
                out.append(a)
        return out


# Oracle ------------------------------------------------------------------------------------------
def _table_of(
    env_or_desc: FrozenLakeEnv | Sequence[str], is_slippery: bool
) -> tuple[dict[int, dict[int, list[Transition]]], int]:
    if isinstance(env_or_desc, FrozenLakeEnv):
        if not env_or_desc.desc:
            raise RuntimeError("optimal_policy(env) before env.reset(seed)")
        return env_or_desc._table, env_or_desc.start_state
    desc = list(env_or_desc)
    return build_transitions(desc, is_slippery), "".join(desc).index("S")


def optimal_policy(
    env_or_desc: FrozenLakeEnv | Sequence[str],
    horizon: int | None = 10,
    *,
    gamma: float = 1.0,
    is_slippery: bool = True,
    tol: float = 1e-12,
    max_iter: int = 100_000,
) -> tuple[list[list[int]], float]:
    """Value iteration for the policy that best reaches the goal; returns ``(table, success_prob)``.

    ``table[k - 1][s]`` is the action index (into ``ACTIONS``) to take in state ``s`` with ``k``
    actions left (use :func:`policy_action`, which clamps ``k`` to the table). With ``horizon=H``
    (default 10, the ``FrozenLake`` action budget) this is finite-horizon value iteration and
    ``success_prob`` is the exact probability of reaching the goal within ``H`` actions from the
    start under that policy (with ``gamma=1``: the maximum achievable). ``horizon=None`` solves the
    unbounded problem with discount ``gamma < 1`` (needed to prefer short paths: undiscounted,
    bumping a wall forever ties with progress) and returns a one-row stationary table; its
    ``success_prob`` is then the undiscounted probability of ever reaching the goal.
    ``is_slippery`` only applies when a map (rather than an env) is given. Among equally good
    actions the one that reaches the goal soonest wins (a secondary value discounted by 0.9), then
    the lowest action index: with slack in the budget the oracle still walks straight, which
    matters when its trajectories become SFT data.
    """
    table, start = _table_of(env_or_desc, is_slippery)
    n = len(table)
    tie_discount = 0.9 * gamma

    def backup(values: list[float], tie_values: list[float]) -> tuple[list[int], list[float], list[float]]:
        """One Bellman step; among actions within 1e-12 of the best value, prefer the fastest one
        (highest value under the extra discount ``tie_values``), so the oracle never dawdles."""
        actions, new, new_tie = [], [], []
        for s in range(n):
            qs = []
            for a in range(4):
                q = w = 0.0
                for prob, ns, reward, term in table[s][a]:
                    q += prob * (reward + (0.0 if term else gamma * values[ns]))
                    w += prob * (reward + (0.0 if term else tie_discount * tie_values[ns]))
                qs.append((q, w))
            best_q = max(q for q, _ in qs)
            best_a = max((a for a in range(4) if qs[a][0] >= best_q - 1e-12), key=lambda a: (qs[a][1], -a))
            actions.append(best_a)
            new.append(qs[best_a][0])
            new_tie.append(qs[best_a][1])
        return actions, new, new_tie

    def evaluate(policy_rows: list[list[int]], steps: int | None) -> float:
        """Undiscounted P(reach goal) of a (possibly time-dependent) policy from the start."""
        values = [0.0] * n
        k = 0
        while True:
            k += 1
            row = policy_rows[min(k, len(policy_rows)) - 1]
            new = [
                sum(
                    prob * (reward + (0.0 if term else values[ns]))
                    for prob, ns, reward, term in table[s][row[s]]
                )
                for s in range(n)
            ]
            delta = max(abs(x - y) for x, y in zip(new, values, strict=True))
            values = new
            if (steps is not None and k >= steps) or (steps is None and (delta < tol or k >= max_iter)):
                return values[start]

    values, tie_values = [0.0] * n, [0.0] * n
    if horizon is not None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        rows: list[list[int]] = []
        for _ in range(horizon):
            row, values, tie_values = backup(values, tie_values)
            rows.append(row)
        return rows, (values[start] if gamma == 1.0 else evaluate(rows, horizon))
    if not 0.0 < gamma < 1.0:
        raise ValueError("horizon=None needs a discount 0 < gamma < 1 (undiscounted ties never end)")
    for _ in range(max_iter):
        row, new, tie_values = backup(values, tie_values)
        done = max(abs(x - y) for x, y in zip(new, values, strict=True)) < tol
        values = new
        if done:
            break
    return [row], evaluate([row], None)


def policy_action(table: list[list[int]], state: int, steps_left: int) -> int:
    """Action index of ``table`` (from :func:`optimal_policy`) in ``state`` with ``steps_left`` left."""
    k = min(max(steps_left, 1), len(table))
    return table[k - 1][state]


def solve(env: FrozenLakeEnv, budget: int = 10) -> Callable[[int], str]:
    """Closed-loop oracle for the env's current map: ``act(steps_left) -> action name``.

    FrozenLake is stochastic, so the oracle is a policy, not a fixed sequence; it reads the env's
    current state at each call and plans again when the env has moved to another map, e.g.
    ``act = solve(env, 10); for k in range(10, 0, -1): res = env.step(act(k))``.
    """
    plan: dict[str, Any] = {"desc": env.desc, "table": optimal_policy(env, horizon=budget)[0]}

    def act(steps_left: int) -> str:
        if env.desc is not plan["desc"]:  # the env moved to another map: plan again
            plan["desc"], plan["table"] = env.desc, optimal_policy(env, horizon=budget)[0]
        return ACTIONS[policy_action(plan["table"], env.state, steps_left)]

    return act
