"""Sokoban positions: the cell codes, the action names and :class:`SokobanState`, shared by the
environment (``envs.sokoban``), its generator and the solver (``envs.sokoban_solver``), so that neither of
those two imports the other for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Cell codes of gym_sokoban (room arrays); 6 exists only in renders.
WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)

DEFAULT_GRID_LOOKUP: dict[int, str] = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
CELL_MEANINGS: tuple[str, ...] = (
    "wall",
    "empty",
    "target",
    "box on target",
    "box",
    "player",
    "player on target",
)
ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
#: (row, column) step of each action, in the order of ``ACTIONS``
DIRECTIONS: tuple[tuple[int, int], ...] = ((-1, 0), (1, 0), (0, -1), (0, 1))


@dataclass(frozen=True)
class SokobanState:
    """A compact, hashable Sokoban position: what the generator, the env and the solver share.

    Cells are row-major flat indices (``r * width + c``). ``floor`` has 1 for every walkable cell
    (floor or target) and 0 for walls; the room must be enclosed by walls so that neighbour
    arithmetic never leaves the grid. ``boxes`` and ``targets`` are sorted.
    """

    height: int
    width: int
    floor: bytes
    targets: tuple[int, ...]
    boxes: tuple[int, ...]
    player: int

    def __post_init__(self) -> None:
        h, w = self.height, self.width
        if len(self.floor) != h * w:
            raise ValueError(f"floor has {len(self.floor)} cells, expected {h}x{w}")
        border = [*range(w), *range((h - 1) * w, h * w), *range(0, h * w, w), *range(w - 1, h * w, w)]
        if any(self.floor[i] for i in border):
            raise ValueError("a Sokoban room must be enclosed by walls")
        if len(self.boxes) != len(self.targets) or not self.boxes:
            raise ValueError(f"need as many boxes as targets (>0): {len(self.boxes)} vs {len(self.targets)}")
        cells = [*self.boxes, self.player]
        if len(set(cells)) != len(cells) or len(set(self.targets)) != len(self.targets):
            raise ValueError("boxes, targets and the player must occupy distinct cells")
        if not all(self.floor[i] for i in (*cells, *self.targets)):
            raise ValueError("boxes, targets and the player must stand on floor")

    @property
    def solved(self) -> bool:
        return set(self.boxes) == set(self.targets)

    # Conversions --------------------------------------------------------------------------------
    def room_fixed(self) -> np.ndarray:
        """gym_sokoban's ``room_fixed``: 0 wall, 1 floor, 2 target."""
        room = np.frombuffer(self.floor, dtype=np.uint8).astype(np.int64)
        room[list(self.targets)] = TARGET
        return room.reshape(self.height, self.width)

    def room_state(self) -> np.ndarray:
        """gym_sokoban's ``room_state``: as ``room_fixed`` plus 3/4 boxes on/off target, 5 player."""
        room = self.room_fixed().reshape(-1)
        targets = set(self.targets)
        for b in self.boxes:
            room[b] = BOX_ON_TARGET if b in targets else BOX
        room[self.player] = PLAYER
        return room.reshape(self.height, self.width)

    @classmethod
    def from_arrays(cls, room_fixed: np.ndarray, room_state: np.ndarray) -> SokobanState:
        """Build from gym_sokoban's arrays (``room_fixed`` 0/1/2, ``room_state`` 0..5)."""
        fixed = np.asarray(room_fixed).astype(np.int64)
        state = np.asarray(room_state).astype(np.int64)
        h, w = fixed.shape
        flat_f, flat_s = fixed.reshape(-1), state.reshape(-1)
        players = np.flatnonzero(flat_s == PLAYER)
        if len(players) != 1:
            raise ValueError(f"room_state must hold exactly one player, found {len(players)}")
        return cls(
            height=h,
            width=w,
            floor=bytes((flat_f != WALL).astype(np.uint8).tolist()),
            targets=tuple(int(i) for i in np.flatnonzero(flat_f == TARGET)),
            boxes=tuple(int(i) for i in np.flatnonzero((flat_s == BOX) | (flat_s == BOX_ON_TARGET))),
            player=int(players[0]),
        )

    @classmethod
    def from_text(
        cls, text: str | Sequence[str], grid_lookup: Mapping[int, str] | None = None
    ) -> SokobanState:
        """Parse a render (rows of single-character symbols), e.g. a hand-built test room."""
        lookup = dict(DEFAULT_GRID_LOOKUP if grid_lookup is None else grid_lookup)
        code_of = {sym: code for code, sym in lookup.items()}
        if any(len(sym) != 1 for sym in code_of):
            raise ValueError("from_text needs single-character symbols")
        rows = text.strip("\n").split("\n") if isinstance(text, str) else list(text)
        h, w = len(rows), len(rows[0])
        if any(len(r) != w for r in rows):
            raise ValueError("all rows must have the same length")
        floor, targets, boxes, players = bytearray(h * w), [], [], []
        for r, row in enumerate(rows):
            for c, sym in enumerate(row):
                if sym not in code_of:
                    raise ValueError(f"unknown symbol {sym!r} at row {r}, column {c}")
                code, i = code_of[sym], r * w + c
                floor[i] = code != WALL
                if code in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                    targets.append(i)
                if code in (BOX, BOX_ON_TARGET):
                    boxes.append(i)
                if code in (PLAYER, PLAYER_ON_TARGET):
                    players.append(i)
        if len(players) != 1:
            raise ValueError(f"the room must hold exactly one player, found {len(players)}")
        return cls(h, w, bytes(floor), tuple(targets), tuple(boxes), players[0])

    def render(self, grid_lookup: Mapping[int, str] | None = None) -> str:
        """Rows of symbols without separators, joined by newlines (RAGEN's text render)."""
        lookup = DEFAULT_GRID_LOOKUP if grid_lookup is None else grid_lookup
        return render_room(self.height, self.width, self.floor, self.targets, self.boxes, self.player, lookup)


def render_room(
    h: int,
    w: int,
    floor: bytes,
    targets: Iterable[int],
    boxes: Iterable[int],
    player: int,
    lookup: Mapping[int, str],
) -> str:
    target_set = set(targets)
    cells = [lookup[FLOOR] if f else lookup[WALL] for f in floor]
    for t in target_set:
        cells[t] = lookup[TARGET]
    for b in boxes:
        cells[b] = lookup[BOX_ON_TARGET] if b in target_set else lookup[BOX]
    cells[player] = lookup[PLAYER_ON_TARGET] if player in target_set else lookup[PLAYER]
    return "\n".join("".join(cells[r * w : (r + 1) * w]) for r in range(h))
