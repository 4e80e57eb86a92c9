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


def task_share(tasks: Sequence[int], seeds: Sequence[int], process_index: int,
               process_count: int) -> tuple[list[int], list[int]]:
    """This process's contiguous block of (task, seed) pairs; blocks differ in size by at most one."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside 0..{process_count - 1}")
    blocks = np.array_split(np.arange(len(tasks)), process_count)[process_index]
    return [int(tasks[i]) for i in blocks], [int(seeds[i]) for i in blocks]


def describe_local(shapes: Sequence[tuple[int, int]], tasks: int) -> np.ndarray:
    """A fixed-size int vector of this process's microbatch shapes and task count (for an all-gather)."""
    if len(shapes) > MAX_MICROBATCHES:
        raise ValueError(f"{len(shapes)} microbatches exceed {MAX_MICROBATCHES} per update")
    out = np.full(2 + 2 * MAX_MICROBATCHES, -1, np.int64)
    out[0], out[1] = tasks, len(shapes)
    for i, (rows, length) in enumerate(shapes):
        out[2 + 2 * i], out[3 + 2 * i] = rows, length
    return out


def agreed_plan(gathered: np.ndarray) -> list[tuple[int, int, int]]:
    """(length, chunk index within that length, rows) of every global microbatch (same on every process)."""
    per_length: dict[int, list[int]] = {}
    for vec in gathered:
        counts: dict[int, int] = {}
        for i in range(int(vec[1])):
            rows, length = int(vec[2 + 2 * i]), int(vec[3 + 2 * i])
            j = counts.get(length, 0)
            counts[length] = j + 1
            slots = per_length.setdefault(length, [])
            if j == len(slots):
                slots.append(0)
            slots[j] = max(slots[j], rows)
    return [(length, j, rows) for length in sorted(per_length) for j, rows in enumerate(per_length[length])]


def align(local: Sequence[dict[str, np.ndarray]], local_tasks: int, gathered: np.ndarray,
          step_factor: float = 1.0) -> list[dict[str, np.ndarray]]:
    """One step's microbatches of this process laid onto the agreed plan (zero rows where it has none).

    One process would weight a call by ``all steps / all tasks``; here each was planned with ``local steps /
    local tasks``, so weights are multiplied by ``(local tasks / all tasks) × step_factor`` where
    ``step_factor = agreed steps / local steps``. Microbatches of a step are summed, so their count does not
    enter the weights.
    """
    plan = agreed_plan(gathered)
    total_tasks = int(sum(int(v[0]) for v in gathered))
    by_length: dict[int, list[dict[str, np.ndarray]]] = {}
    for arrays in local:
        by_length.setdefault(int(arrays["input_ids"].shape[1]), []).append(arrays)
    factor = 0.0
    if local and total_tasks:
        factor = (local_tasks / total_tasks) * step_factor
    out = []
    for length, j, rows in plan:
        mine = by_length.get(length, [])
        arrays = mine[j] if j < len(mine) else {k: np.zeros((0, length), t) for k, t in _DTYPES.items()}
        padded = {}
        for k, t in _DTYPES.items():
            v = arrays[k]
            extra = np.zeros((rows - v.shape[0], length), t)
            padded[k] = np.concatenate([v, extra]) if extra.shape[0] else v
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


def agree(minibatches: Sequence[Sequence[Any]], local_tasks: int) -> list[list[dict[str, np.ndarray]]]:
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
        vec = describe_local([tuple(a["input_ids"].shape) for a in local], local_tasks)
        out.append(align(local, local_tasks, gather_descriptions(vec), step_factor))
    return out
