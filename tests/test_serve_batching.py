"""The serve engine's row buckets: a request's greedy reply does not depend on its bucket or its neighbours,
padding rows keep their cached conversations, and the programs run are bounded and counted."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from retrojax.model.checkpoint import from_pretrained
from retrojax.sampler import TRACES, Sampler
from retrojax.serve.batching import RowBucketSampler, default_row_buckets

ROWS, MAX_LEN, BUCKETS = 8, 64, (8, 32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return from_pretrained(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("rowbuckets"), seed=5),
                           dtype=jnp.float32)


def bucketed(model, min_window: int = MAX_LEN, **kw) -> RowBucketSampler:
    """One attention window unless asked (fewer compiles)."""
    return RowBucketSampler(model, rows=ROWS, max_len=MAX_LEN, chunk_buckets=BUCKETS, min_window=min_window,
                            **kw)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, size=n).tolist()


def two_turns(sampler: Sampler, placed: dict[int, int]) -> dict[int, list[int]]:
    """Each ``row: seed`` gets a prompt, a 6-token greedy reply, a second user turn and a 9-token reply;
    returns every row's generated ids (both replies)."""
    rows = sorted(placed)
    sampler.append(rows, [prompt(placed[r], 5 + 3 * placed[r]) for r in rows])
    first = sampler.generate(rows, 6, temperature=0.0, stop_token_ids=())
    sampler.append(rows, [prompt(100 + placed[r], 4 + placed[r]) for r in rows])
    second = sampler.generate(rows, 9, temperature=0.0, stop_token_ids=())
    return {r: [*a.ids.tolist(), *b.ids.tolist()] for r, a, b in zip(rows, first, second, strict=True)}


def test_default_row_buckets_are_powers_of_two_up_to_the_rows():
    assert default_row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_row_buckets(12) == (1, 2, 4, 8, 12)
    assert default_row_buckets(1) == (1,)


def test_greedy_reply_is_the_same_alone_in_a_padded_bucket_and_over_every_row(model):
    reference = Sampler(model, rows=ROWS, max_len=MAX_LEN, chunk_buckets=BUCKETS, min_window=MAX_LEN)
    want = two_turns(reference, {5: 1})[5]  # the plain sampler: every row computed
    alone = bucketed(model)
    assert two_turns(alone, {5: 1})[5] == want
    assert {s[1] for s in alone.programs} == {1}  # one row: bucket 1
    crowd = bucketed(model)
    got = two_turns(crowd, {0: 2, 2: 3, 5: 1})  # three rows: bucket 4 with one padding row
    assert got[5] == want
    assert {s[1] for s in crowd.programs} == {4}
    full = bucketed(model)
    every_row = {r: 4 + r % 3 for r in range(ROWS)} | {0: 2, 2: 3, 5: 1}
    got_full = two_turns(full, every_row)  # bucket 8: every row
    assert got_full[5] == want and got_full[0] == got[0] and got_full[2] == got[2]
    assert {s[1] for s in full.programs} == {ROWS}


def test_padding_rows_keep_their_cached_conversation(model):
    s = bucketed(model)
    s.append([3], [prompt(7, 20)])
    s.generate([3], 5, temperature=0.0, stop_token_ids=())
    n = s.length(3)
    k, v = np.asarray(s.cache.k[:, 3, ..., :n]), np.asarray(s.cache.v[:, 3, :, :n])
    two_turns(s, {0: 1, 1: 2, 2: 3})  # three live rows: bucket 4 pads with row 3, the lowest free one
    assert any(shape[1] == 4 for shape in s.programs)
    np.testing.assert_array_equal(np.asarray(s.cache.k[:, 3, ..., :n]), k)
    np.testing.assert_array_equal(np.asarray(s.cache.v[:, 3, :, :n]), v)
    assert s.length(3) == n


def test_programs_are_bounded_counted_and_never_rerun_through_a_new_compile(model):
    seen = []
    s = bucketed(model, min_window=32, row_buckets=(1, 4, 8),
                 on_program=lambda shape, seconds: seen.append(shape))
    assert s.row_buckets == (1, 4, 8) and s.windows() == (32, 64)
    assert s.program_bound() == 3 * 2 * (len(BUCKETS) + 1)

    def workload():
        for live in (1, 3):
            for r in range(ROWS):
                s.reset(r)
            rows = list(range(live))
            for n in (3, 36):  # chunk buckets 8 and 32 (36 = 32 + 4); windows 32 and 64 as rows grow
                s.append(rows, [prompt(n + r, n) for r in rows])
                s.generate(rows, 4, temperature=0.0, stop_token_ids=())

    workload()
    assert 0 < len(s.programs) <= s.program_bound() and seen == list(s.programs)
    before = (dict(TRACES), len(s.programs))
    workload()
    assert (dict(TRACES), len(s.programs)) == before


def test_warm_up_runs_every_program_a_workload_needs_and_leaves_the_rows_empty(model):
    def workload(s: RowBucketSampler) -> list[list[int]]:
        out = []
        for live in (1, 3, ROWS):
            for r in range(ROWS):
                s.reset(r)
            rows = list(range(live))
            for n in (3, 36):  # chunk buckets 8 and 32; windows 32 and 64 as rows grow
                s.append(rows, [prompt(n + r, n) for r in rows])
                out += [g.ids.tolist() for g in s.generate(rows, 4, temperature=0.0, stop_token_ids=())]
        return out

    want = workload(bucketed(model, min_window=32, row_buckets=(1, 4, 8)))
    warm = bucketed(model, min_window=32, row_buckets=(1, 4, 8))
    assert warm.warm_up(stop_ids=[], decode_steps=4) > 0
    warmed = set(warm.programs)
    assert len(warmed) == 3 * 2 * (len(BUCKETS) + 1)  # every row bucket x window: both chunk buckets, decode
    assert all(warm.length(r) == 0 for r in range(ROWS))
    traces = dict(TRACES)
    assert workload(warm) == want  # what the warm-up wrote in the cache is never read
    assert set(warm.programs) == warmed and dict(TRACES) == traces  # nothing new compiled or traced
