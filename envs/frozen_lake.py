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
  arithmetic (:class:`~envs.frozen_lake_maps.Stream`; same numbers, tested against the literal calls); maps are cached by
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
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from envs.base import (
    Env,
    StepResult,
    cell_label,
    cell_separator_setting,
    invalid_step,
    moves_between,
    observation_flag,
    separate_cells,
)
from envs.frozen_lake_maps import (
    SLIP_FIRST,
    SLIP_SECOND,
    UNIT,
    MapData,
    Stream,
    Transition,
    build_transitions,
    check_map_args,
    map_data,
    seeded_map,
)

ACTIONS: list[str] = ["Left", "Down", "Right", "Up"]
_ACTION_INDEX = {name: i for i, name in enumerate(ACTIONS)}
GRID_VOCAB: dict[str, str] = {
    "P": "player",
    "_": "empty",
    "O": "hole",
    "G": "goal",
    "X": "player in hole",
    "√": "player on goal",
}


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
        cell_separator: str = "",
        directions: bool = False,
    ) -> None:
        """``map_seed`` fixes the map for every episode (``reset(seed)`` then only drives the slips);
        ``desc`` (rows of ``S``/``F``/``H``/``G``, exactly one ``S``) fixes a hand-made map. By default the
        map comes from the episode seed, as in RAGEN. ``think_holes`` adds the holes next to the player
        to the demonstrations' think text (:meth:`think_text`). ``coordinates`` adds the board's size and the
        goal's, the player's and the holes' (row, column) under the grid, as RAGEN's grid-plus-coordinates
        observation does: a small language model reads a position more easily than a 2-D layout.
        ``cell_separator`` goes between the cells of each row (``" "``: one token per cell for a BPE
        tokenizer, which otherwise merges runs like ``GP__``); ``""`` is RAGEN's rendering. ``directions`` adds
        the board as the player sees it (not RAGEN's): how many moves Down/Up and Right/Left the goal is,
        and which moves fall into a hole, so that a policy can act on the text without locating cells in
        the grid."""
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
        self.coordinates = observation_flag("coordinates", coordinates)
        self.cell_separator = cell_separator_setting(cell_separator)
        self.directions = observation_flag("directions", directions)
        self._fixed_desc: tuple[str, ...] | None = tuple(desc) if desc is not None else None
        self.actions = list(ACTIONS)
        self.grid_vocab = dict(GRID_VOCAB)
        self.desc: list[str] = []
        self.nrow = self.ncol = 0
        self.state = 0
        self.start_state = 0
        self.goal_states: frozenset[int] = frozenset()
        self._data: MapData | None = None
        self._stream: Stream | None = None
        self._slip_pos = 0  # the slip stream's next output

    # Map ------------------------------------------------------------------------------------------
    def _set_map(self, data: MapData) -> None:
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
        stream = Stream(seed)
        if self._fixed_desc is not None:
            desc = self._fixed_desc
        elif self.map_seed is not None:
            desc = seeded_map(self.size, check_map_args(self.size, self.p), self.map_seed)
        else:
            desc = seeded_map(self.size, check_map_args(self.size, self.p), seed, stream)
        self._set_map(map_data(desc, self.is_slippery))
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
        u = ((stream.words[pos] if pos < len(stream.words) else stream.word(pos)) >> 11) * UNIT
        prev = self.state
        if data.terminal[prev]:
            state, reward = prev, 0.0
        else:
            if data.is_slippery:
                a = (a - 1) % 4 if u < SLIP_FIRST else a if u < SLIP_SECOND else (a + 1) % 4
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

    def _observation(self, data: MapData, state: int) -> str:
        """The grid, then with ``coordinates`` the positions (zero-indexed (row, column)) and with
        ``directions`` the goal and the holes as moves from the player."""
        lines = [separate_cells(data.render(state), self.cell_separator)]
        if self.coordinates:
            lines += _coordinate_lines(data, state)
        if self.directions:
            lines += _direction_lines(data, state)
        return "\n".join(lines)

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
        if self._data is None:
            raise RuntimeError("FrozenLakeEnv.hole_moves() before reset(seed)")
        return _hole_moves(self._data, self.state)


def _hole_moves(data: MapData, state: int) -> list[int]:
    # the map's own move table (what step() moves by); a bump into the border stays on ``state``
    return [a for a, cell in enumerate(data.moves[state]) if cell != state and data.flat[cell] == "H"]


def _coordinate_lines(data: MapData, state: int) -> list[str]:
    """RAGEN's grid-plus-coordinates lines: the board's size, the goal, the player and the holes."""
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
    return lines


def _direction_lines(data: MapData, state: int) -> list[str]:
    """``Goal: 2 Down, 1 Left.`` and ``Holes next to you: Right.`` (moves in ``ACTIONS`` order, or
    ``none``); ``Goal: reached.`` and ``You fell into a hole.`` once the episode has ended."""
    if data.flat[state] == "G":
        return ["Goal: reached."]
    if data.flat[state] == "H":
        return ["You fell into a hole."]
    holes = " ".join(ACTIONS[a] for a in _hole_moves(data, state))
    goal = moves_between(state, min(data.goal_states), data.ncol)
    return [f"Goal: {goal}.", f"Holes next to you: {holes or 'none'}."]


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
    values, tie_values = [0.0] * n, [0.0] * n
    if horizon is not None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        rows: list[list[int]] = []
        for _ in range(horizon):
            row, values, tie_values = _backup(table, values, tie_values, gamma)
            rows.append(row)
        if gamma == 1.0:
            return rows, values[start]
        return rows, _success_prob(table, start, rows, horizon, tol, max_iter)
    if not 0.0 < gamma < 1.0:
        raise ValueError("horizon=None needs a discount 0 < gamma < 1 (undiscounted ties never end)")
    for _ in range(max_iter):
        row, new, tie_values = _backup(table, values, tie_values, gamma)
        done = max(abs(x - y) for x, y in zip(new, values, strict=True)) < tol
        values = new
        if done:
            break
    return [row], _success_prob(table, start, [row], None, tol, max_iter)


def _backup(
    table: dict[int, dict[int, list[Transition]]], values: list[float], tie_values: list[float], gamma: float
) -> tuple[list[int], list[float], list[float]]:
    """One Bellman step; among actions within 1e-12 of the best value, prefer the fastest one
    (highest value under the extra discount ``tie_values``), so the oracle never dawdles."""
    tie_discount = 0.9 * gamma
    actions, new, new_tie = [], [], []
    for s in range(len(table)):
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


def _success_prob(
    table: dict[int, dict[int, list[Transition]]],
    start: int,
    policy_rows: list[list[int]],
    steps: int | None,
    tol: float,
    max_iter: int,
) -> float:
    """Undiscounted P(reach goal) of a (possibly time-dependent) policy from ``start``: over ``steps``
    actions, or (``None``) until the values move less than ``tol`` or after ``max_iter`` sweeps."""
    n = len(table)
    values = [0.0] * n
    k = 0
    while True:
        k += 1
        row = policy_rows[min(k, len(policy_rows)) - 1]
        new = [
            sum(
                prob * (reward + (0.0 if term else values[ns])) for prob, ns, reward, term in table[s][row[s]]
            )
            for s in range(n)
        ]
        delta = max(abs(x - y) for x, y in zip(new, values, strict=True))
        values = new
        if (steps is not None and k >= steps) or (steps is None and (delta < tol or k >= max_iter)):
            return values[start]


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
