"""Exact Sokoban solver on the host: vectorised breadth-first search over (boxes, player) states.

A search state is the sorted array of box cells plus the player cell (flat indices ``r * W + c``). Its
int64 key is ``rank(boxes) * N + player`` where ``N = H * W`` and ``rank`` is the combinatorial number
system ``sum_k C(b_k, k + 1)`` over the sorted box cells — the same key the jitted step computes with a
cumulative sum (``rules.state_key``), and it fits int32 for every room ``parse`` accepts.

``solve_board`` runs a layered BFS in primitive moves and stops at the first solved layer (shortest
solution length, −1 if none). ``distance_table`` enumerates every state reachable from the start,
then relaxes exact distances-to-solution backwards; it keeps only solvable states, sorted by key, so
a state reachable from the start is dead exactly when its key is missing from the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from envs.sokoban.text import BOX, BOX_T, PLAYER, PLAYER_T, TARGET, WALL

DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # moves 1 up, 2 down, 3 left, 4 right
_UNREACHED = np.iinfo(np.int32).max


@dataclass(frozen=True)
class Room:
    """Static facts of a room: walls, targets, shape, and the binomial table for state keys."""

    walls: np.ndarray  # bool [N]
    targets: np.ndarray  # bool [N]
    height: int
    width: int
    num_boxes: int
    binom: np.ndarray  # int64 [N, num_boxes + 1], binom[c, k] = C(c, k)

    @property
    def cells(self) -> int:
        return self.height * self.width


def binomial_table(cells: int, num_boxes: int) -> np.ndarray:
    """``C(c, k)`` for ``c < cells`` and ``k <= num_boxes`` (int64)."""
    return np.array([[comb(c, k) for k in range(num_boxes + 1)] for c in range(cells)], dtype=np.int64)


def room_of(board: np.ndarray) -> Room:
    board = np.asarray(board)
    flat = board.reshape(-1)
    nb = int(np.isin(flat, (BOX, BOX_T)).sum())
    return Room(
        walls=flat == WALL,
        targets=np.isin(flat, (TARGET, BOX_T, PLAYER_T)),
        height=int(board.shape[0]),
        width=int(board.shape[1]),
        num_boxes=nb,
        binom=binomial_table(flat.size, nb),
    )


def start_of(board: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The board's search state as ``(boxes [1, nb], player [1])``."""
    flat = np.asarray(board).reshape(-1)
    boxes = np.flatnonzero(np.isin(flat, (BOX, BOX_T)))[None, :].astype(np.int64)
    player = np.flatnonzero(np.isin(flat, (PLAYER, PLAYER_T)))[:1].astype(np.int64)
    return boxes, player


def keys_of(room: Room, boxes: np.ndarray, player: np.ndarray) -> np.ndarray:
    """int64 keys of sorted box arrays ``[S, nb]`` and player cells ``[S]``."""
    return encode(boxes, player, room.cells, room.binom)


def encode(boxes: np.ndarray, player: np.ndarray, cells: int, binom: np.ndarray | None = None) -> np.ndarray:
    """int64 keys ``rank(sorted boxes) * cells + player`` (``rules.state_key`` on the host); ``binom`` is
    ``binomial_table(cells, nb)`` when the caller already has it."""
    boxes = np.asarray(boxes, np.int64)
    nb = boxes.shape[-1]
    table = binomial_table(cells, nb) if binom is None else binom
    rank = table[boxes, np.arange(1, nb + 1)].sum(axis=-1)
    return rank * cells + np.asarray(player, np.int64)


def decode_keys(keys: np.ndarray, cells: int, num_boxes: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``encode``: sorted box cells int64 [S, num_boxes] and player cells int64 [S]."""
    keys = np.asarray(keys, np.int64)
    rank, player = np.divmod(keys, cells)
    binom = binomial_table(cells, num_boxes)
    boxes = np.zeros((len(keys), num_boxes), np.int64)
    for k in range(num_boxes, 0, -1):  # colex unranking: the largest c with C(c, k) <= rank
        c = np.searchsorted(binom[:, k], rank, side="right") - 1
        boxes[:, k - 1] = c
        rank = rank - binom[c, k]
    return boxes, player


def is_solved(room: Room, boxes: np.ndarray) -> np.ndarray:
    return room.targets[boxes].all(axis=1)


def successors(room: Room, boxes: np.ndarray, player: np.ndarray):
    """For each of the 4 moves: ``(boxes', player', changed)`` stacked move-major as ``[4 * S, …]``."""
    h, w = room.height, room.width
    r, c = player // w, player % w
    out_b, out_p, out_ch = [], [], []
    for dr, dc in DELTAS:
        r1, c1, r2, c2 = r + dr, c + dc, r + 2 * dr, c + 2 * dc
        in1 = (r1 >= 0) & (r1 < h) & (c1 >= 0) & (c1 < w)
        in2 = (r2 >= 0) & (r2 < h) & (c2 >= 0) & (c2 < w)
        i1 = np.where(in1, r1 * w + c1, 0)
        i2 = np.where(in2, r2 * w + c2, 0)
        free1 = in1 & ~room.walls[i1]
        free2 = in2 & ~room.walls[i2]
        hit1 = boxes == i1[:, None]
        box1 = hit1.any(axis=1) & in1
        box2 = (boxes == i2[:, None]).any(axis=1) & in2
        walk = free1 & ~box1
        push = box1 & free2 & ~box2
        nb = np.where(hit1 & push[:, None], i2[:, None], boxes)
        nb.sort(axis=1)
        out_b.append(nb)
        out_p.append(np.where(walk | push, i1, player))
        out_ch.append(walk | push)
    return np.concatenate(out_b), np.concatenate(out_p), np.concatenate(out_ch)


def _new_layer(room: Room, boxes, player, visited: np.ndarray):
    nb, npl, ch = successors(room, boxes, player)
    nb, npl = nb[ch], npl[ch]
    k = keys_of(room, nb, npl)
    k, first = np.unique(k, return_index=True)
    fresh = ~_contains(visited, k)
    return nb[first][fresh], npl[first][fresh], k[fresh]


def _contains(sorted_keys: np.ndarray, k: np.ndarray) -> np.ndarray:
    pos = np.searchsorted(sorted_keys, k)
    pos = np.minimum(pos, len(sorted_keys) - 1)
    return sorted_keys[pos] == k


def solve_board(board: np.ndarray, max_states: int = 5_000_000) -> int:
    """Length of a shortest solution in primitive moves (0 if solved already), −1 if unsolvable."""
    room = room_of(board)
    boxes, player = start_of(board)
    if is_solved(room, boxes)[0]:
        return 0
    visited = keys_of(room, boxes, player)
    depth = 0
    while len(boxes):
        boxes, player, k = _new_layer(room, boxes, player, visited)
        depth += 1
        if len(boxes) and is_solved(room, boxes).any():
            return depth
        visited = np.union1d(visited, k)
        if len(visited) > max_states:
            raise RuntimeError(f"solver gave up after {max_states} states")
    return -1


def reachable_states(board: np.ndarray, max_states: int = 5_000_000):
    """Every state reachable from the board: ``(room, boxes [V, nb], player [V], keys [V] sorted)``."""
    room = room_of(board)
    boxes, player = start_of(board)
    all_b, all_p = [boxes], [player]
    visited = keys_of(room, boxes, player)
    while len(boxes):
        boxes, player, k = _new_layer(room, boxes, player, visited)
        all_b.append(boxes)
        all_p.append(player)
        visited = np.union1d(visited, k)
        if len(visited) > max_states:
            raise RuntimeError(f"state enumeration gave up after {max_states} states")
    b, p = np.concatenate(all_b), np.concatenate(all_p)
    k = keys_of(room, b, p)
    order = np.argsort(k)
    return room, b[order], p[order], k[order]


def distance_table(board: np.ndarray, max_states: int = 5_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Sorted int32 keys and int16 exact distances-to-solution of the solvable states reachable from
    the board (states missing from the table are dead)."""
    room, boxes, player, keys = reachable_states(board, max_states)
    v = len(keys)
    nb, npl, _ = successors(room, boxes, player)
    succ = np.searchsorted(keys, keys_of(room, nb, npl)).reshape(4, v)
    dist = np.where(is_solved(room, boxes), 0, _UNREACHED).astype(np.int64)
    while True:
        best = dist[succ].min(axis=0) + 1
        new = np.minimum(dist, best)
        if np.array_equal(new, dist):
            break
        dist = new
    keep = dist < _UNREACHED
    if keep.any() and dist[keep].max() > np.iinfo(np.int16).max:
        raise RuntimeError("distance exceeds int16")
    return keys[keep].astype(np.int32), dist[keep].astype(np.int16)
