"""FrozenLake: a multi-turn, stochastic grid walk to a goal between holes.

Behaviour follows RAGEN (spec 2.4), which wraps gymnasium's ``FrozenLake-v1``; the dynamics are
re-implemented here so that ``envs`` needs only numpy (gymnasium is a test-only reference).

* **Map from the seed**, RAGEN's generator call for call: a ``numpy.random.default_rng(seed)`` draws
  a board of frozen (``F``, probability ``p``) and hole (``H``) cells, then a start and a goal cell
  uniformly (redrawn until they differ); the board is kept if a 4-connected path from start to goal
  avoids the holes, else everything is drawn again. The same seed gives RAGEN's map.
* **Slips from the seed**: a second ``default_rng(seed)``, consumed exactly as gymnasium does (one
  uniform draw at reset for the start state, one per step, sampled through the cumulative
  probabilities), so a seed and an action sequence give the trajectory RAGEN/gymnasium give.
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

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, ClassVar

import numpy as np

from envs.base import Env, StepResult, invalid_step

ACTIONS: list[str] = ["Left", "Down", "Right", "Up"]
LEFT, DOWN, RIGHT, UP = range(4)
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
_DRAW_BATCH = 32

Transition = tuple[float, int, float, bool]
"""``(probability, next_state, reward, terminated)``, as in gymnasium's ``env.unwrapped.P``."""


# Map generation ------------------------------------------------------------------------------------
def has_path(desc: Sequence[str]) -> bool:
    """Whether a 4-connected path of non-hole cells leads from ``S`` to ``G``."""
    nrow, ncol = len(desc), len(desc[0])
    start = next((r, c) for r in range(nrow) for c in range(ncol) if desc[r][c] == "S")
    stack, seen = [start], {start}
    while stack:
        r, c = stack.pop()
        if desc[r][c] == "G":
            return True
        for nr, nc in ((r + 1, c), (r, c + 1), (r - 1, c), (r, c - 1)):
            if 0 <= nr < nrow and 0 <= nc < ncol and (nr, nc) not in seen and desc[nr][nc] != "H":
                seen.add((nr, nc))
                stack.append((nr, nc))
    return False


def generate_map(size: int, p: float, seed: int | None) -> list[str]:
    """A random ``size`` x ``size`` map with a random start and goal and a path between them.

    Same numpy calls in the same order as RAGEN's generator, so a seed names the same map.
    ``p`` is the probability that a cell is frozen (RAGEN's docstring says hole; its code says frozen).
    """
    if size < 2:
        raise ValueError(f"FrozenLake size must be >= 2, got {size}")
    p = min(1.0, float(p))
    if p <= 0.0:
        raise ValueError(f"FrozenLake p (probability of a frozen cell) must be > 0, got {p}")
    rng = np.random.default_rng(seed)
    cells = np.array(["F", "H"])
    while True:
        board = rng.choice(cells, (size, size), p=[p, 1 - p])
        while True:
            start_r, start_c = rng.integers(0, size), rng.integers(0, size)
            goal_r, goal_c = rng.integers(0, size), rng.integers(0, size)
            if (start_r, start_c) != (goal_r, goal_c):
                break
        board[start_r, start_c] = "S"
        board[goal_r, goal_c] = "G"
        desc = ["".join(row) for row in board.tolist()]
        if has_path(desc):
            return desc


def build_transitions(desc: Sequence[str], is_slippery: bool = True) -> dict[int, dict[int, list[Transition]]]:
    """gymnasium's transition table ``P`` for ``desc`` (same structure, order and floats)."""
    nrow, ncol = len(desc), len(desc[0])

    def move(r: int, c: int, a: int) -> tuple[int, int]:
        if a == LEFT:
            return r, max(c - 1, 0)
        if a == DOWN:
            return min(r + 1, nrow - 1), c
        if a == RIGHT:
            return r, min(c + 1, ncol - 1)
        return max(r - 1, 0), c

    def outcome(r: int, c: int, a: int) -> tuple[int, float, bool]:
        nr, nc = move(r, c, a)
        letter = desc[nr][nc]
        return nr * ncol + nc, 1.0 if letter == "G" else 0.0, letter in "GH"

    table: dict[int, dict[int, list[Transition]]] = {}
    for r in range(nrow):
        for c in range(ncol):
            s = r * ncol + c
            table[s] = {}
            for a in range(4):
                if desc[r][c] in "GH":
                    table[s][a] = [(1.0, s, 0.0, True)]
                elif is_slippery:
                    table[s][a] = [
                        (_SUCCESS_RATE if b == a else _FAIL_RATE, *outcome(r, c, b))
                        for b in ((a - 1) % 4, a, (a + 1) % 4)
                    ]
                else:
                    table[s][a] = [(1.0, *outcome(r, c, a))]
    return table


# The environment -----------------------------------------------------------------------------------
class FrozenLakeEnv(Env):
    """RAGEN's FrozenLake: random map, start and goal per seed; slippery ice; budgeted by the runner."""

    env_type: ClassVar[str] = "frozen_lake"

    def __init__(
        self,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = True,
        map_seed: int | None = None,
        desc: Sequence[str] | None = None,
    ) -> None:
        """``map_seed`` fixes the map for every episode (``reset(seed)`` then only drives the slips);
        ``desc`` (rows of ``S``/``F``/``H``/``G``, exactly one ``S``) fixes a hand-made map. By default the
        map comes from the episode seed, as in RAGEN."""
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
        self._fixed_desc: list[str] | None = list(desc) if desc is not None else None
        self.actions = list(ACTIONS)
        self.grid_vocab = dict(GRID_VOCAB)
        self.desc: list[str] = []
        self.nrow = self.ncol = 0
        self.state = 0
        self.start_state = 0
        self.goal_states: frozenset[int] = frozenset()
        self._map_key: tuple[Any, ...] | None = None
        self._table: dict[int, dict[int, list[Transition]]] = {}
        # Per (state, action): (cumulative thresholds, next states, rewards, terminals) for fast sampling.
        self._fast: list[list[tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...], tuple[bool, ...]]]] = []
        self._terminal: list[bool] = []
        self._rng: np.random.Generator | None = None
        self._draws: list[float] = []
        self._oracle: tuple[list[list[int]], float] | None = None
        self._renders: dict[int, str] = {}

    # Map ------------------------------------------------------------------------------------------
    def _set_map(self, desc: list[str]) -> None:
        """Install a map and precompute everything ``step`` needs (lists, not numpy: faster per step)."""
        self.desc = desc
        self.nrow, self.ncol = len(desc), len(desc[0])
        self._table = build_transitions(desc, self.is_slippery)
        flat = "".join(desc)
        self.start_state = flat.index("S")
        self.goal_states = frozenset(i for i, ch in enumerate(flat) if ch == "G")
        self._terminal = [ch in "GH" for ch in flat]
        self._fast = [
            [
                (
                    tuple(accumulate(t[0] for t in self._table[s][a])),
                    tuple(t[1] for t in self._table[s][a]),
                    tuple(t[2] for t in self._table[s][a]),
                    tuple(t[3] for t in self._table[s][a]),
                )
                for a in range(4)
            ]
            for s in range(len(flat))
        ]
        self._oracle = None
        self._renders = {}

    def transition_table(self) -> dict[int, dict[int, list[Transition]]]:
        """``{state: {action: [(prob, next_state, reward, terminated), ...]}}`` like gymnasium's ``P``."""
        return {s: {a: list(ts) for a, ts in row.items()} for s, row in self._table.items()}

    # Env API --------------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        """New map (unless fixed) and a fresh slip stream, both from ``seed``."""
        if self._fixed_desc is not None:
            key: tuple[Any, ...] = ("desc",)
        elif self.map_seed is not None:
            key = ("map_seed", self.map_seed)
        else:
            key = ("seed", seed)
        if key != self._map_key:
            if self._fixed_desc is not None:
                desc = self._fixed_desc
            else:
                desc = generate_map(self.size, self.p, self.map_seed if self.map_seed is not None else seed)
            self._set_map(list(desc))
            self._map_key = key
        self._rng = np.random.default_rng(seed)
        self._draws = []
        self._next_draw()  # gymnasium samples the (one-hot) start distribution: one draw
        self.state = self.start_state
        return self.render()

    def _next_draw(self) -> float:
        """Next uniform of the slip stream; drawn in batches (same values as one at a time)."""
        if not self._draws:
            assert self._rng is not None
            self._draws = self._rng.random(_DRAW_BATCH).tolist()
            self._draws.reverse()
        return self._draws.pop()

    def step(self, action: str) -> StepResult:
        """Move (maybe slipping); unknown names change nothing. Every valid step consumes one draw."""
        if self._rng is None:
            raise RuntimeError("FrozenLakeEnv.step() before reset(seed)")
        a = self.match_action(action)
        if a is None:
            return invalid_step(self.render())
        cum, nexts, rewards, terms = self._fast[self.state][a]
        u = self._next_draw()
        i = 0
        while i < len(cum) - 1 and not cum[i] > u:
            i += 1
        prev, self.state = self.state, nexts[i]
        info = {
            "success": self.state in self.goal_states,
            "action_is_valid": True,
            "action_is_effective": self.state != prev,
        }
        return StepResult(self.render(), rewards[i], terms[i], info)

    def render(self) -> str:
        """Grid text: ``P``/``X``/``√`` for the player, ``_`` frozen (start too), ``O`` hole, ``G`` goal."""
        cached = self._renders.get(self.state)
        if cached is not None:
            return cached
        if not self.desc:
            raise RuntimeError("FrozenLakeEnv.render() before reset(seed)")
        r, c = divmod(self.state, self.ncol)
        rows = []
        for i, row in enumerate(self.desc):
            cells = [_CELL_SYMBOL[ch] for ch in row]
            if i == r:
                cells[c] = _PLAYER_SYMBOL[row[c]]
            rows.append("".join(cells))
        text = self._renders[self.state] = "\n".join(rows)
        return text

    @property
    def done(self) -> bool:
        """Whether the player stands in a hole or on the goal (absorbing)."""
        return bool(self._terminal) and self._terminal[self.state]

    @property
    def success(self) -> bool:
        return self.state in self.goal_states

    # Oracle ---------------------------------------------------------------------------------------
    def oracle_action(self, steps_left: int = 10) -> str:
        """The action that maximises P(reach the goal within ``steps_left`` actions) from here."""
        if self._oracle is None or len(self._oracle[0]) < steps_left:
            self._oracle = optimal_policy(self, horizon=max(steps_left, 10))
        return ACTIONS[policy_action(self._oracle[0], self.state, steps_left)]


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
                sum(prob * (reward + (0.0 if term else values[ns])) for prob, ns, reward, term in table[s][row[s]])
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
