"""Per-process shares of a multi-process run: whole task groups per process, agreed microbatches.

Every process derives the same task stream and seeds; each runs the trials of its own contiguous block of
tasks (all trials of a task on one process, so group-normalized advantages are exact) and plans its
minibatches (one optimizer step each) of microbatches. All processes first agree on the number of steps (the
most any process has), then, step by step, on one list of (length, rows) microbatches: a process without a
chunk of some bucket contributes all-zero rows (zero weight), so every process calls the update equally
often with equal shapes, and the global microbatch j of step i is the union of every process's chunk j.
Weights are rescaled so the global step sees the same objective as one process holding every task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_MICROBATCHES = 512
_DTYPES = {"input_ids": np.int32, "targets": np.int32, "attention_mask": bool, "old_logprobs": np.float32,
           "adv": np.float32, "weight": np.float32, "exec_mask": bool, "ref_mask": bool}
# learn.layout packed | tree (retrojax.learn.layout): node arrays [rows, length], term arrays [rows, width]
_FOREST_DTYPES = {"input_ids": np.int32, "positions": np.int32, "tree_exit": np.int32, "term_node": np.int32,
                  "targets": np.int32, "old_logprobs": np.float32, "adv": np.float32, "weight": np.float32,
                  "exec_mask": bool, "ref_mask": bool}
_NODE_KEYS = ("input_ids", "positions", "tree_exit")


def _shape(arrays: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """(rows, length, terms per row) of a microbatch (rows layout: terms per row = length)."""
    rows, length = arrays["input_ids"].shape
    width = arrays["term_node"].shape[1] if "term_node" in arrays else length
    return int(rows), int(length), int(width)


def task_share(tasks: Sequence[int], seeds: Sequence[int], process_index: int,
               process_count: int) -> tuple[list[int], list[int]]:
    """This process's contiguous block of (task, seed) pairs; blocks differ in size by at most one."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside 0..{process_count - 1}")
    blocks = np.array_split(np.arange(len(tasks)), process_count)[process_index]
    return [int(tasks[i]) for i in blocks], [int(seeds[i]) for i in blocks]


def describe_local(shapes: Sequence[tuple[int, ...]], tasks: int) -> np.ndarray:
    """A fixed-size int vector of this process's microbatch shapes and task count (for an all-gather).

    A shape is (rows, length) or (rows, length, terms per row) (token-forest layouts)."""
    if len(shapes) > MAX_MICROBATCHES:
        raise ValueError(f"{len(shapes)} microbatches exceed {MAX_MICROBATCHES} per update")
    out = np.full(2 + 3 * MAX_MICROBATCHES, -1, np.int64)
    out[0], out[1] = tasks, len(shapes)
    for i, shape in enumerate(shapes):
        rows, length = shape[:2]
        out[2 + 3 * i: 5 + 3 * i] = rows, length, shape[2] if len(shape) > 2 else length
    return out


def _agreed(gathered: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(length, chunk index within that length, rows, terms per row): the most any process has."""
    per_length: dict[int, list[list[int]]] = {}
    for vec in gathered:
        counts: dict[int, int] = {}
        for i in range(int(vec[1])):
            rows, length, width = (int(x) for x in vec[2 + 3 * i: 5 + 3 * i])
            j = counts.get(length, 0)
            counts[length] = j + 1
            slots = per_length.setdefault(length, [])
            if j == len(slots):
                slots.append([0, 0])
            slots[j] = [max(slots[j][0], rows), max(slots[j][1], width)]
    return [(length, j, rows, width) for length in sorted(per_length)
            for j, (rows, width) in enumerate(per_length[length])]


def agreed_plan(gathered: np.ndarray) -> list[tuple[int, int, int]]:
    """(length, chunk index within that length, rows) of every global microbatch (same on every process)."""
    return [(length, j, rows) for length, j, rows, _ in _agreed(gathered)]


def align(local: Sequence[dict[str, np.ndarray]], local_tasks: int, gathered: np.ndarray,
          step_factor: float = 1.0, layout: str = "rows") -> list[dict[str, np.ndarray]]:
    """One step's microbatches of this process laid onto the agreed plan (zero rows where it has none).

    One process would weight a call by ``all steps / all tasks``; here each was planned with ``local steps /
    local tasks``, so weights are multiplied by ``(local tasks / all tasks) × step_factor`` where
    ``step_factor = agreed steps / local steps``. Microbatches of a step are summed, so their count does not
    enter the weights. Token-forest microbatches (``layout`` packed | tree) also widen their term arrays to
    the agreed terms per row (zero-weight terms).
    """
    plan = _agreed(gathered)
    dtypes = _DTYPES if layout == "rows" else _FOREST_DTYPES
    total_tasks = int(sum(int(v[0]) for v in gathered))
    by_length: dict[int, list[dict[str, np.ndarray]]] = {}
    for arrays in local:
        by_length.setdefault(int(arrays["input_ids"].shape[1]), []).append(arrays)
    factor = 0.0
    if local and total_tasks:
        factor = (local_tasks / total_tasks) * step_factor
    out = []
    for length, j, rows, width in plan:
        mine = by_length.get(length, [])
        arrays = mine[j] if j < len(mine) else {k: np.zeros((0, 0), t) for k, t in dtypes.items()}
        padded = {}
        for k, t in dtypes.items():
            v = arrays[k]
            cols = length if layout == "rows" or k in _NODE_KEYS else width
            grown = np.zeros((rows, cols), t)
            grown[: v.shape[0], : v.shape[1]] = v
            padded[k] = grown
        padded["weight"] = (padded["weight"] * factor).astype(np.float32)
        out.append(padded)
    return out


def gather_descriptions(vec: np.ndarray) -> np.ndarray:
    """Every process's ``describe_local`` vector, stacked in process order (a host all-gather)."""
    import jax

    if jax.process_count() == 1:
        return vec[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(vec))


def agree(minibatches: Sequence[Sequence[Any]], local_tasks: int,
          layout: str = "rows") -> list[list[dict[str, np.ndarray]]]:
    """Per optimizer step, the arrays this process feeds (``align`` after gathering every process's shapes).

    ``minibatches[i]`` lists this process's microbatches of step ``i``; every process returns the same number
    of steps with the same microbatch shapes.
    """
    counts = gather_descriptions(np.asarray([len(minibatches)], np.int64))
    steps = int(np.max(counts))
    step_factor = steps / len(minibatches) if len(minibatches) else 0.0
    out = []
    for i in range(steps):
        local = [mb.arrays for mb in minibatches[i]] if i < len(minibatches) else []
        vec = describe_local([_shape(a) for a in local], local_tasks)
        out.append(align(local, local_tasks, gather_descriptions(vec), step_factor, layout))
    return out
