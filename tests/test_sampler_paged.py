"""The paged KV cache: the same tokens and log-probs as the dense cache (rewinds, multi-turn appends, shared
prompts, evictions, the serve engine's concurrent requests), and the page allocator's invariants."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import test_sampler as dense_tests
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.model.qwen3 import PRESETS, Qwen3
from retrojax.sampler import Sampler, SamplerError
from retrojax.sampling.pages import (
    NULL_PAGE,
    PageBook,
    PoolFullError,
    kv_bytes_per_page,
    pages_for,
    pages_per_row,
)

ROWS, MAX_LEN, BUCKETS, MIN_WINDOW, PAGE = 4, 128, (8, 32), 32, 16
POOL = ROWS * pages_for(MAX_LEN, PAGE) + 1  # the default pool: every row at max_len, and the null page


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen3 with random weights: paged and dense caches are compared on the same model, so no
    reference checkpoint is needed (test_sampler.py checks the dense cache against transformers)."""
    return Qwen3(PRESETS["tiny"], rngs=nnx.Rngs(3))


def sampler(model, kv: str, pages: int | None = None, **kw) -> Sampler:
    return Sampler(model, rows=ROWS, max_len=MAX_LEN, chunk_buckets=BUCKETS, min_window=MIN_WINDOW, kv=kv,
                   page_size=PAGE, pages=pages, **kw)


def ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=n).astype(np.int32)


def trials(s: Sampler) -> tuple[list, np.ndarray]:
    """Four trials of one task (one 40-token prompt, two with a different last observation): sampled and
    greedy turns, appends, rewinds to a mark and into the shared prompt, a top-k turn; every reply and two
    rows' next-token logits."""
    task = ids(0, 40)
    key = jax.random.key(1)
    s.append([0, 1, 2, 3], [task, task, np.concatenate([task, ids(1, 3)]), np.concatenate([task, ids(2, 9)])])
    out = s.generate([0, 1, 2, 3], 10, key=key)
    marks = [s.mark(r) for r in range(ROWS)]
    s.append([0, 2], [ids(3, 5), ids(4, 20)])
    out += s.generate([0, 1, 2], [7, 12, 5], key=jax.random.fold_in(key, 1))
    s.rewind(0, 20)  # into the shared prompt's second page: the next write copies it
    s.rewind(2, marks[2])
    s.append([0, 2, 3], [ids(5, 4), ids(6, 8), ids(7, 2)])
    out += s.generate([0, 1, 2, 3], 9, temperature=0.0)
    out += s.generate([0, 1, 2, 3], 6, key=jax.random.fold_in(key, 2), top_k=20)
    s.reset(1)
    s.append([1], [task])  # a new trial of the task: its prompt's full pages are still held by rows 2, 3
    out += s.generate([1, 3], 8, key=jax.random.fold_in(key, 3))
    return out, s.next_logits([0, 3])


def assert_same(got, want, logits_got, logits_want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(logits_got, logits_want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def dense_run(model):
    return trials(sampler(model, "dense"))


def test_paged_equals_dense_with_rewinds_appends_and_shared_prompts(model, dense_run):
    s = sampler(model, "paged")
    got, logits = trials(s)
    assert_same(got, dense_run[0], logits, dense_run[1])
    s.paged.check()
    assert s.stats["shared_pages"] >= 6 and s.stats["copied_pages"] >= 1 and s.stats["evicted_rows"] == 0
    for r in range(ROWS):  # a row holds the pages of its conversation (all tokens but the pending one)
        assert s.paged.count[r] == pages_for(s.length(r) - 1, PAGE) and s.paged.kv_len[r] == s.length(r) - 1


def test_a_small_pool_preempts_rows_and_recomputes_them_with_the_same_tokens(model, dense_run):
    """A pool of 8 usable pages (one full row) cannot hold every row: calls evict other rows and run in
    groups, and evicted rows are prefilled again from their conversations when next used."""
    pages = 9
    s = sampler(model, "paged", pages=pages)
    got, logits = trials(s)
    assert_same(got, dense_run[0], logits, dense_run[1])
    s.paged.check()
    assert s.stats["evicted_rows"] > 0 and s.stats["recomputed_tokens"] > 0
    assert s.paged.held <= pages - 1


def test_new_weights_share_no_page_computed_with_the_old_ones(model):
    s = sampler(model, "paged")
    task = ids(0, 40)
    s.append([0], [task])
    s.append([1], [task])
    assert s.stats["shared_pages"] == 2  # 39 slots with keys/values: two full pages of 16
    s.update_model(model)
    s.append([2], [task])
    assert s.stats["shared_pages"] == 2
    s.paged.check()


def test_dense_cache_stays_selectable_and_kv_is_checked(model):
    assert sampler(model, "dense").paged is None
    with pytest.raises(SamplerError, match="kv must be one of"):
        sampler(model, "ring")
    with pytest.raises(SamplerError, match="one full row"):
        sampler(model, "paged", pages=8)
    with pytest.raises(SamplerError, match="page_size"):
        Sampler(model, rows=1, max_len=16, kv="paged", page_size=0)


# the dense sampler's behavioural tests, run on pages. Left out: tests reading the dense cache's arrays, and
# test_multiturn_with_rewind_matches_one_forward_pass (its forward passes compile a program per length; the
# paged rows' tokens, log-probs and logits after appends and rewinds equal the dense cache's above)
DENSE_TESTS = ["test_same_key_same_tokens_and_reset",
               "test_stop_token_ends_row_and_stays_in_conversation", "test_stop_string_split_across_tokens",
               "test_bad_arguments_raise_clear_errors", "test_compilations_stay_bounded",
               "test_min_out_len_shares_one_decode_program_and_keeps_the_tokens"]


@pytest.mark.parametrize("name", DENSE_TESTS)
def test_dense_sampler_tests_pass_on_pages(name, model, monkeypatch):
    # this module's pool (page size and page count): a program reads the page table over its attention
    # window only, so the dense tests' calls (max_len 64) run the programs of this module's own tests
    def paged(*args, **kw):
        return Sampler(*args, kv="paged", page_size=PAGE, pages=POOL, **kw)

    monkeypatch.setattr(dense_tests, "Sampler", paged)
    getattr(dense_tests, name)(model)


def test_serve_engine_concurrent_requests_match_on_pages(model):
    """The engine's continuous batching with a shared system prompt: the same greedy replies on pages as on
    the dense cache, with the full pool and with one so small that requests wait for pages."""
    from retrojax.serve.engine import Engine, Job

    tok = dense_tests.LetterTokenizer(1000)
    tok.stop_token_ids = ()
    system = ids(10, 70).tolist()  # longer than a page (64 tokens, the engine's)
    prompts = [system + ids(20 + i, 3 + 4 * i).tolist() for i in range(6)]

    def serve(kv: str, pages: int | None = None) -> tuple[list[list[int]], Engine]:
        engine = Engine(model, tok, rows=4, max_len=MAX_LEN, chunk_steps=3, chunk_buckets=BUCKETS,
                        min_window=MIN_WINDOW, row_buckets=(2,), kv=kv, pages=pages).start()
        done = [threading.Event() for _ in prompts]
        jobs = [Job(prompt=p, max_tokens=11 + i, temperature=0.0, on_event=lambda e, d=d: d.set()
                    if "done" in e or "error" in e else None)
                for i, (p, d) in enumerate(zip(prompts, done, strict=True))]
        for job in jobs:
            engine.submit(job)
        try:
            assert all(d.wait(120) for d in done)
        finally:
            engine.close()
        return [j.ids for j in jobs], engine

    want, _ = serve("dense")
    got, engine = serve("paged")
    assert got == want and engine.sampler.stats["shared_pages"] > 0
    small, engine = serve("paged", pages=pages_for(MAX_LEN, 64) + 1)
    assert small == want
    engine.sampler.paged.check()


def test_planner_sizes():
    class Qwen3_4B:  # the fields a Qwen3 config carries for the KV cache
        num_hidden_layers, num_key_value_heads, head_dim = 36, 8, 128

    assert kv_bytes_per_page(Qwen3_4B, 64, 2) == 64 * 2 * 36 * 8 * 128 * 2  # 144 KiB a token, bf16
    assert pages_per_row(1, 64) == 0 and pages_per_row(65, 64) == 1 and pages_per_row(66, 64) == 2
    assert pages_per_row(65, 64, reserve=384) == 7


# --- the allocator's invariants -----------------------------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["grow", "rewind", "share", "reset"]), st.integers(0, 3),
                         st.integers(0, 40), st.integers(0, 2)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_page_book_invariants(ops):
    """Random grows (reserve + write), rewinds onto another continuation, prefix shares and resets over 4 rows
    whose conversations come from 3 token streams, against a model of the device pool: every row reads its own
    conversation in its valid slots, every indexed page holds the prefix its key names, refcounts match the
    tables, free + held pages are the pool, and a rewind frees exactly the pages past the mark."""
    ps, pages, length = 4, 30, 48
    book = PageBook(4, pages, ps, max_pages=12)
    streams = [np.random.default_rng(s).integers(0, 3, length).astype(np.int32) for s in range(3)]
    conversation = [streams[0].copy() for _ in range(4)]  # what each row's slots must hold
    pool = np.full((pages, ps), -1, np.int32)  # what the device's pages hold (-1: never written)
    for op, row, n, stream in ops:
        kv = int(book.kv_len[row])
        if op == "grow":
            slots = min(kv + n, length)
            try:
                copies = book.reserve(row, slots)
            except PoolFullError:
                assert book.new_pages_for(row, slots) > book.free
                continue
            assert all(book.refcount[new] == 1 and new not in (NULL_PAGE, old) for old, new in copies)
            for old, new in copies:
                pool[new] = pool[old]
            for slot in range(kv, slots):
                pool[book.table[row, slot // ps], slot % ps] = conversation[row][slot]
            book.wrote(row, slots, conversation[row])
            book.trim(row)
        elif op == "rewind":  # back to the mark, then on along another stream (a new branch)
            mark = min(n, kv)
            before = book.row_pages(row)
            held_before = book.refcount.copy()
            book.truncate(row, mark)
            keep = pages_for(mark, ps)
            np.testing.assert_array_equal(book.row_pages(row), before[:keep])
            gone = before[keep:]
            np.testing.assert_array_equal(book.refcount[gone], held_before[gone] - 1)
            conversation[row] = np.concatenate([conversation[row][:mark], streams[stream][mark:]])
        elif op == "share":
            book.truncate(row, 0)
            conversation[row] = streams[stream].copy()
            taken = book.share(row, conversation[row], min(n, length))
            assert int(book.kv_len[row]) == len(taken) * ps
        else:
            book.truncate(row, 0)
            assert book.count[row] == 0 and book.kv_len[row] == 0
        book.check()
        assert book.free + book.held == pages - 1
        held = np.concatenate([book.row_pages(r) for r in range(4)])
        pages_seen, times = np.unique(held, return_counts=True)
        np.testing.assert_array_equal(book.refcount[pages_seen], times)  # owned twice only when counted twice
        for r in range(4):
            valid = int(book.kv_len[r])
            read = pool[book.table[r, : pages_for(valid, ps)]].reshape(-1)[:valid]
            np.testing.assert_array_equal(read, conversation[r][:valid], err_msg=f"row {r}")
        for page, tokens in book.indexed_prefixes():
            np.testing.assert_array_equal(pool[page], tokens, err_msg=f"indexed page {page}")


def test_bench_replay_counts_shared_prompt_pages_once():
    """The bench's archive replay (retrojax bench sampler, sampler.kv.*): two trials of a task with one
    130-token prompt and different 10-token replies hold its two full pages once."""
    from types import SimpleNamespace

    from retrojax.bench.kv_pages import memory_figures, replay

    prompt = ids(30, 130)
    calls = {t: [SimpleNamespace(trial=t, task=0, role="execution", prompt_ids=prompt,
                                 output_ids=ids(31 + t, 10))] for t in (0, 1)}
    archive = SimpleNamespace(calls=calls[0] + calls[1], tasks=lambda: [0], calls_of=lambda t: calls[t])
    cfg = SimpleNamespace(sampler=SimpleNamespace(max_len=1024, max_new_tokens=64, max_reflection_tokens=64))
    totals = replay(archive, cfg)
    # each row: 139 slots = 3 pages; pages 0 and 1 shared; during the call each reserves 129 + 64 slots
    assert totals["row_pages"] == 6 and totals["distinct_pages"] == 4 and totals["used_tokens"] == 280
    assert totals["call_distinct_pages"] == 2 + 2 * 2
    figures = memory_figures(totals, cfg)
    assert figures["sampler.kv.prompt_share"] == pytest.approx(1 / 3)
    assert figures["sampler.kv.paged.allocated_over_used"] == pytest.approx(6 * 64 / 280)
    assert figures["sampler.kv.dense.allocated_over_used"] == pytest.approx(2 * 1024 / 280)
