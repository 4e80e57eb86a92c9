"""``retrojax plan`` with the paged KV cache: the pool it counts is the one admission sizes
(``sampler.kv_pages`` auto or explicit), held whatever the row count; a dense cache stays rows × max_len."""

from __future__ import annotations

from retrojax.config import from_dict
from retrojax.plan import memory
from retrojax.plan.admission import admit_kv
from retrojax.plan.bound import KVShape, decode_bytes_per_row, kv_bytes_per_row, train_resident_bytes
from retrojax.plan.memory import GB, kv_pages, plan_memory, sampler_held_bytes, shapes_from_config

ROWS, MAX_LEN = 8, 256


def tiny(**sampler):
    return from_dict({
        "model": {"preset": "tiny"},
        "sampler": {"max_len": MAX_LEN, "max_inflight": ROWS, **sampler},
        "learn": {"seq_buckets": [128], "max_batch_tokens": 256, "logprob_chunk": 64, "lora": {"rank": 4}},
        "mesh": {"data": 1, "fsdp": 1, "tp": 1},
    })


def test_pool_is_the_one_admission_sizes_and_dense_stays_rows_of_max_len():
    cfg = tiny()
    shapes = shapes_from_config(cfg)
    kv = KVShape.of(cfg)
    assert kv.paged and cfg.sampler.kv == "paged"  # the default
    resident = train_resident_bytes(cfg)
    # a device whose bound leaves 20 pages beside the run and its rows' temporaries
    budget = (sum(resident.values()) + ROWS * decode_bytes_per_row(kv.config) + 20.5 * kv.page_bytes()) / 0.85
    admitted = admit_kv(job="train", kv=kv, resident=resident, budget=budget, requested="auto", wanted=ROWS,
                        hint="")
    assert kv.row_pages() + 1 < admitted.kv_pages < ROWS * kv.row_pages() + 1
    assert kv_pages(cfg, shapes, budget) == admitted.kv_pages == 20
    assert kv_pages(cfg, shapes) == ROWS * kv.row_pages() + 1  # no device: every row at max_len
    assert kv_pages(tiny(kv_pages=7), shapes, budget) == 7
    dense = tiny(kv="dense")
    assert kv_pages(dense, shapes, budget) is None
    held_paged = sampler_held_bytes(cfg, shapes, None, shapes.lora, budget=budget)
    held_dense = sampler_held_bytes(dense, shapes, None, shapes.lora)
    row = kv_bytes_per_row(kv.config, MAX_LEN, cfg.model.dtype)
    assert held_dense - held_paged == ROWS * row - 20 * kv.page_bytes()


def _update_figures(cfg, shapes, mesh, *, remat, lora, rows=None, logprobs=False):
    """Fixed update figures (the update's own compile is tested in test_plan.py): the plan's KV terms are
    what this file checks, and they come from the sampler's compile."""
    out = {"params": 4e6, "trainable": 1e5, "compute_copy": 0.0, "opt": 2e5, "grads": 1e5,
           "act": 3e6 if remat else 6e6, "opt_step_temp": 1e5, "rows": float(rows or shapes.rows)}
    out["update"] = out["params"] + out["opt"] + out["grads"] + out["act"]
    if logprobs:
        out["logprob_act"] = 2e6
        out["logprob"] = out["params"] + out["opt"] + out["logprob_act"]
    return out


def test_plan_reports_and_holds_the_pool(monkeypatch):
    """An explicit pool of 5 pages (two rows at max_len and the null page): the plan compiles the paged
    programs, counts the pool once whatever the rows, so more rows fit than dense rows of max_len; a dense
    cache counts rows × max_len slots."""
    monkeypatch.setattr(memory, "plan_update", _update_figures)
    cfg = tiny(kv_pages=5)
    kv = KVShape.of(cfg)
    budget = 30e6
    fig = plan_memory(cfg, budget, log=lambda s: None, compare=False)
    assert fig["plan.kv"] == "paged" and fig["plan.kv_pages"] == 5 and fig["plan.fits"] is True
    assert abs(fig["plan.kv_gb"] * GB - 5 * kv.page_bytes()) < 1
    shapes = shapes_from_config(cfg)
    held = sampler_held_bytes(cfg, shapes, None, shapes.lora, budget)
    assert abs(fig["plan.sampler_held_gb"] * GB - held) < 1
    dense = plan_memory(tiny(kv="dense"), budget, log=lambda s: None, compare=False)
    assert dense["plan.kv"] == "dense" and "plan.kv_pages" not in dense
    row = kv_bytes_per_row(kv.config, MAX_LEN, cfg.model.dtype)
    assert abs(dense["plan.kv_gb"] * GB - ROWS * row) < 1
    assert fig["plan.max_inflight_fit"] > dense["plan.max_inflight_fit"] >= ROWS
