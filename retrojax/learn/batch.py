"""Archive + advantages → padded, bucketed training arrays for the jitted update (host-side numpy).

Layout (eq. 19): within a segment the conversation only grows, so consecutive execution calls of a segment
whose prompt starts with the previous call's prompt + output are chained into one sequence that holds every
decision's original context; where the prefix relation does not hold (or the chain would outgrow the largest
bucket) a new sequence starts. Reflection calls are their own sequences. Each trained output token carries

- ``adv``: its call's advantage (A_cont or A_ref);
- ``weight``: the call's share of the task objective, ``1 / (tokens × decisions)`` for execution tokens (a
  token mean within each decision, then a mean over decisions) and ``λ_ref / (reflection tokens of the
  task)`` for reflection tokens (eq. 19: one token mean over all eligible reflection tokens of the task, so
  a longer reflection carries more weight), divided by the number of tasks (tasks
  are averaged without pooling their groups) and multiplied by the number of minibatches (sequences are dealt
  to minibatches at random, so each optimizer step sees an unbiased estimate of the whole objective);
- ``old_logprobs``: the behaviour policy's sampler log-probs.

Prompt and padding tokens have zero weight; ``exec_mask`` and ``ref_mask`` are disjoint. Rows hold one
sequence each, right-padded to a length bucket; the row count is padded to a power of two, so the update
compiles once per (rows, length) bucket.

Minibatches and microbatches are different things. A *minibatch* (``learn.minibatches``, the mini-batch of
PPO/GRPO trainers) is a random share of the update's sequences and gets ONE optimizer step. Its
*microbatches* are a memory device only: the minibatch's sequences grouped by length bucket and chunked to
``max_batch_tokens``; the update sums their gradients before stepping, so the step does not depend on how
the minibatch was chunked (nor on the chunks' length order).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from retrojax.agent.archive import EXECUTION, REFLECTION, Archive, CallRecord
from retrojax.learn.advantages import Advantages

BATCH_KEYS = ("input_ids", "targets", "attention_mask", "old_logprobs", "adv", "weight", "exec_mask",
              "ref_mask")


@dataclasses.dataclass
class Span:
    """One trained call inside a sequence: its output tokens start at ``start`` (sequence index)."""

    call: CallRecord
    start: int
    advantage: float
    weight: float  # per-token weight
    role: str


@dataclasses.dataclass
class Sequence_:
    """One training sequence (token ids) and the trained calls in it."""

    tokens: np.ndarray
    spans: list[Span]
    task: int


@dataclasses.dataclass
class Microbatch:
    """Arrays for one optimizer step, with bookkeeping for logs."""

    arrays: dict[str, np.ndarray]
    sequences: int
    trained_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.arrays["input_ids"].shape)  # type: ignore[return-value]


@dataclasses.dataclass
class BatchPlan:
    """One update's arrays: ``minibatches[i]`` is the list of microbatches of optimizer step ``i``."""

    minibatches: list[list[Microbatch]]
    stats: dict[str, float]

    @property
    def microbatches(self) -> list[Microbatch]:
        """Every microbatch of every minibatch, in step order."""
        return [mb for group in self.minibatches for mb in group]


def _concat(call: CallRecord) -> np.ndarray:
    return np.concatenate([np.asarray(call.prompt_ids, np.int32), np.asarray(call.output_ids, np.int32)])


def extends(prev: CallRecord, nxt: CallRecord) -> bool:
    """True if ``nxt``'s prompt starts with ``prev``'s prompt + output (the conversation only grew)."""
    head = _concat(prev)
    p = np.asarray(nxt.prompt_ids)
    return p.size >= head.size and np.array_equal(p[: head.size], head)


def chain_segment(calls: Sequence[CallRecord], max_len: int) -> list[list[CallRecord]]:
    """Split a segment's calls (in order) into chains whose prompts extend each other and fit max_len + 1."""
    chains: list[list[CallRecord]] = []
    for c in calls:
        total = len(c.prompt_ids) + len(c.output_ids)
        if chains and extends(chains[-1][-1], c) and total <= max_len + 1:
            chains[-1].append(c)
        else:
            chains.append([c])
    return chains


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    for b in sorted(buckets):
        if length <= b:
            return b
    return None


def _row_bucket(n: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(n, 1)))))


def build_sequences(archive: Archive, adv: Advantages, *, lambda_ref: float, max_len: int,
                    chain: bool = True, skip_zero: bool = False) -> tuple[list[Sequence_], dict[str, float]]:
    """Training sequences with per-call weights (before microbatch scaling).

    ``skip_zero`` leaves out calls whose advantage is exactly 0 (their surrogate and gradient are 0; without a
    KL term they cost compute only). They still count in their task's decision share.
    """
    credit = {(c.task, c.trial, c.call_index): c for c in adv.credits}
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    decisions: dict[int, int] = defaultdict(int)
    ref_tokens: dict[int, int] = defaultdict(int)  # eligible reflection output tokens per task
    for c in adv.credits:
        if c.role == EXECUTION:
            decisions[c.task] += 1
        elif lambda_ref != 0.0:
            ref_tokens[c.task] += len(calls[(c.task, c.trial, c.call_index)].output_ids)
    reflections = {t: n for t, n in ref_tokens.items() if n > 0}
    tasks = sorted(set(decisions) | set(reflections))
    n_tasks = max(len(tasks), 1)

    def span(call: CallRecord, start: int) -> Span | None:
        cr = credit.get((call.task, call.trial, call.call_index))
        n_out = len(call.output_ids)
        if cr is None or n_out == 0 or start < 1 or (skip_zero and cr.advantage == 0.0):
            return None  # (an empty prompt gives no context to predict the first output token from)
        if cr.role == EXECUTION:
            w = 1.0 / (n_out * decisions[call.task] * n_tasks)
        else:
            w = lambda_ref / (reflections[call.task] * n_tasks)
        return Span(call, start, cr.advantage, w, cr.role)

    seqs: list[Sequence_] = []
    dropped = 0
    broken_prefix = 0
    by_segment: dict[tuple[int, int, int], list[CallRecord]] = defaultdict(list)
    for c in archive.calls:
        if c.role == EXECUTION and (c.task, c.trial, c.call_index) in credit:
            by_segment[(c.task, c.trial, c.segment)].append(c)
    for key in sorted(by_segment):
        seg = sorted(by_segment[key], key=lambda c: (c.position, c.call_index))
        chains = chain_segment(seg, max_len) if chain else [[c] for c in seg]
        broken_prefix += sum(1 for i in range(1, len(seg)) if not extends(seg[i - 1], seg[i]))
        for ch in chains:
            tokens = _concat(ch[-1])
            if tokens.size - 1 > max_len:
                dropped += len(ch)
                continue
            spans = [s for c in ch if (s := span(c, len(c.prompt_ids))) is not None]
            if spans:  # the sequence ends with its last trained output
                end = max(sp.start + len(sp.call.output_ids) for sp in spans)
                seqs.append(Sequence_(tokens[:end], spans, key[0]))
    if lambda_ref != 0.0:
        for cr in adv.credits:
            if cr.role != REFLECTION:
                continue
            call = calls[(cr.task, cr.trial, cr.call_index)]
            tokens = _concat(call)
            if tokens.size - 1 > max_len:
                dropped += 1
                continue
            s = span(call, len(call.prompt_ids))
            if s is not None:
                seqs.append(Sequence_(tokens, [s], cr.task))
    stats = {"batch/sequences": float(len(seqs)), "batch/dropped_calls": float(dropped),
             "batch/prefix_breaks": float(broken_prefix), "batch/tasks": float(len(tasks))}
    return seqs, stats


def _fill(seqs: list[Sequence_], rows: int, length: int, scale: float) -> dict[str, np.ndarray]:
    a = {
        "input_ids": np.zeros((rows, length), np.int32),
        "targets": np.zeros((rows, length), np.int32),
        "attention_mask": np.zeros((rows, length), bool),
        "old_logprobs": np.zeros((rows, length), np.float32),
        "adv": np.zeros((rows, length), np.float32),
        "weight": np.zeros((rows, length), np.float32),
        "exec_mask": np.zeros((rows, length), bool),
        "ref_mask": np.zeros((rows, length), bool),
    }
    for r, s in enumerate(seqs):
        n = s.tokens.size - 1
        a["input_ids"][r, :n] = s.tokens[:-1]
        a["targets"][r, :n] = s.tokens[1:]
        a["attention_mask"][r, :n] = True
        for sp in s.spans:
            n_out = len(sp.call.output_ids)
            lo, hi = sp.start - 1, sp.start - 1 + n_out  # target index i predicts token i + 1
            a["old_logprobs"][r, lo:hi] = np.asarray(sp.call.logprobs, np.float32)[:n_out]
            a["adv"][r, lo:hi] = sp.advantage
            a["weight"][r, lo:hi] = sp.weight * scale
            a["exec_mask" if sp.role == EXECUTION else "ref_mask"][r, lo:hi] = True
    return a


def _forest_microbatches(group: list[Sequence_], seq_buckets: Sequence[int], max_batch_tokens: int,
                         scale: float, layout: str) -> list[Microbatch]:
    from retrojax.learn.layout import forest_options, from_sequence, pack

    packing = pack([from_sequence(s, scale) for s in group], lengths=seq_buckets,
                   max_batch_tokens=max_batch_tokens, **forest_options(layout))
    return [Microbatch(a, sum(len(r.members) for r in rows), int((a["exec_mask"] | a["ref_mask"]).sum()))
            for a, rows in zip(packing.microbatches, packing.row_groups or [], strict=True)]


def plan_batches(archive: Archive, adv: Advantages, *, lambda_ref: float, seq_buckets: Sequence[int],
                 max_batch_tokens: int, minibatches: int = 1, chain: bool = True, skip_zero: bool = False,
                 rng: np.random.Generator | None = None, layout: str = "rows") -> BatchPlan:
    """Minibatches (one optimizer step each) of microbatches covering every trained call of ``archive``.

    ``layout`` (``learn.layout``): ``rows`` as described above; ``packed`` / ``tree``: each minibatch's
    sequences packed into token-forest rows (``retrojax.learn.layout``), same weights, same minibatches.
    """
    if minibatches < 1:
        raise ValueError(f"minibatches must be ≥ 1, got {minibatches}")
    from retrojax.learn.layout import LAYOUTS, rows_per_microbatch

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    max_len = max(seq_buckets)
    seqs, stats = build_sequences(archive, adv, lambda_ref=lambda_ref, max_len=max_len, chain=chain,
                                  skip_zero=skip_zero)
    for s in seqs:
        for sp in s.spans:
            if len(sp.call.logprobs) < len(sp.call.output_ids):
                c = sp.call
                raise ValueError(f"call {c.call_index} of trial {c.trial}: {len(c.logprobs)} logprobs "
                                 f"for {len(c.output_ids)} output tokens")
    order = np.arange(len(seqs)) if rng is None else rng.permutation(len(seqs))
    groups = [[seqs[i] for i in order[g::minibatches]] for g in range(minibatches)]
    groups = [g for g in groups if g]  # fewer sequences than minibatches: fewer (non-empty) steps
    scale = float(len(groups))  # each step's weights sum to an estimate of the whole objective
    steps: list[list[Microbatch]] = []
    for group in groups:
        if layout != "rows":
            steps.append(_forest_microbatches(group, seq_buckets, max_batch_tokens, scale, layout))
            continue
        by_len: dict[int, list[Sequence_]] = defaultdict(list)
        for s in group:
            length = bucket_for(s.tokens.size - 1, seq_buckets)
            assert length is not None  # build_sequences dropped the ones that do not fit
            by_len[length].append(s)
        micro: list[Microbatch] = []
        for length in sorted(by_len):
            cap = rows_per_microbatch(length, max_batch_tokens)
            items = by_len[length]
            for i in range(0, len(items), cap):
                arrays = _fill(items[i:i + cap], _row_bucket(len(items[i:i + cap])), length, scale)
                micro.append(Microbatch(arrays, len(items[i:i + cap]),
                                        int((arrays["exec_mask"] | arrays["ref_mask"]).sum())))
        steps.append(micro)
    plan = BatchPlan(steps, stats)
    mbs = plan.microbatches
    stats["batch/minibatches"] = float(len(steps))
    stats["batch/microbatches"] = float(len(mbs))
    stats["batch/trained_tokens"] = float(sum(m.trained_tokens for m in mbs))
    stats["batch/padded_tokens"] = float(sum(int(np.prod(m.shape)) for m in mbs))
    return plan
