"""Admission before allocation (retrojax.plan.admission): ``sampler.max_inflight: auto`` takes the rows that
fit, and no entry point (train, eval, rir, serve) starts a run the plan says does not fit."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from retrojax.cli import main as cli_main
from retrojax.config import from_dict, load
from retrojax.model.qwen3 import Qwen3Config
from retrojax.plan.admission import (
    DoesNotFit,
    _train_hint,
    admit_rows,
    admit_train,
    resolve,
)
from retrojax.plan.bound import decode_bytes_per_row, kv_bytes_per_row, param_count, train_resident_bytes

MICRO = Qwen3Config(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096)


@pytest.fixture()
def micro_dir(tmp_path):
    """A checkpoint directory with only a config.json: admission reads shapes, never weights."""
    (tmp_path / "config.json").write_text(json.dumps(MICRO.to_hf_dict()))
    return tmp_path


def micro_cfg(micro_dir, **sampler):
    """A config over the micro shape; dense rows unless ``kv`` says otherwise."""
    return from_dict({
        "model": {"path": str(micro_dir)},
        "sampler": {"max_len": 1024, "kv": "dense", **sampler},
        "trial": {"trials_per_task": 4},
        "learn": {"tasks_per_update": 2, "seq_buckets": [256], "max_batch_tokens": 512, "logprob_chunk": 64},
    })


def test_param_count_matches_the_model():
    import jax
    from flax import nnx

    from retrojax.model import Qwen3

    model = nnx.eval_shape(lambda: Qwen3(MICRO, rngs=nnx.Rngs(0)))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_count(MICRO) == counted


def test_auto_takes_what_fits_and_an_explicit_value_that_does_not_stops():
    resident = {"weights": 10e9}
    auto = admit_rows(job="t", resident=resident, per_row=1e9, budget=20e9, requested="auto", wanted=64,
                      hint="")
    assert auto.max_inflight == 7  # 0.85 * 20 - 10 = 7 GB of rows
    assert auto.figures["plan.max_inflight_fit"] == 7
    assert admit_rows(job="t", resident=resident, per_row=1e9, budget=20e9, requested="auto", wanted=3,
                      hint="").max_inflight == 3
    assert admit_rows(job="t", resident=resident, per_row=1e9, budget=20e9, requested=5, wanted=64,
                      hint="").max_inflight == 5
    with pytest.raises(DoesNotFit, match=r"12 rows were asked for, at most 7 fit.*max_inflight"):
        admit_rows(job="t", resident=resident, per_row=1e9, budget=20e9, requested=12, wanted=64, hint="")
    with pytest.raises(DoesNotFit, match="not even one row fits. shrink it"):
        admit_rows(job="t", resident=resident, per_row=1e9, budget=12e9, requested="auto", wanted=64,
                   hint="shrink it")
    with pytest.raises(DoesNotFit, match="64 rows were asked"):  # 0 = every trial of the update
        admit_rows(job="t", resident=resident, per_row=1e9, budget=20e9, requested=0, wanted=64, hint="")


def test_float32_masters_are_counted_and_named_in_the_advice():
    cfg = load("configs/sokoban.yaml", [])
    f32 = train_resident_bytes(cfg, remat=True)
    low = train_resident_bytes(dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn,
                                                                                  master_dtype="model")))
    assert f32["masters"] == pytest.approx(2 * f32["weights"], rel=0.01)  # float32 beside bfloat16
    assert f32["adamw"] == pytest.approx(2 * low["adamw"])
    assert low["masters"] == 0
    with pytest.raises(DoesNotFit, match="learn.master_dtype=model"):
        admit_rows(job="train", resident=f32, per_row=1.0, budget=80e9, requested="auto", wanted=128,
                   hint=_train_hint(cfg))


def test_train_takes_every_row_by_the_bound_without_compiling(micro_dir):
    cfg = micro_cfg(micro_dir)
    found = admit_train(cfg, 1e9)
    assert found.figures["plan.method"] == "bound" and found.max_inflight == 8


def _bound(cfg, rows: int) -> float:
    per_row = kv_bytes_per_row(MICRO, 1024, "float32") + decode_bytes_per_row(MICRO)
    return (sum(train_resident_bytes(cfg).values()) + rows * per_row) / 0.85


def test_train_compiles_the_plan_where_the_bound_is_tight(micro_dir):
    """A budget below the closed-form bound but above what the compiled programs need: the compile-only plan
    admits every row of the update."""
    cfg = micro_cfg(micro_dir)
    budget = 0.92 * _bound(cfg, 8)  # the bound admits 1 row of 8; the compiled plan needs less
    found = admit_train(cfg, budget)
    assert found.figures["plan.method"] == "compile"
    assert found.max_inflight == 8
    assert found.figures["plan.total_gb"] * 1e9 <= budget


def test_train_auto_takes_the_rows_the_compiled_plan_fits(micro_dir):
    """With many long rows the KV cache decides: auto takes the rows the compiled plan fits, fewer than the
    update's trials (an explicit count above the fit stops: see the admit_rows test)."""
    cfg = micro_cfg(micro_dir, max_len=4096)
    cfg = dataclasses.replace(cfg, trial=dataclasses.replace(cfg.trial, trials_per_task=32))  # 64 rows
    kv = kv_bytes_per_row(MICRO, 4096, "float32")
    budget = sum(train_resident_bytes(cfg).values()) + 20 * kv  # room for ~20 rows beside the update
    found = admit_train(cfg, budget)
    assert found.figures["plan.method"] == "compile"
    assert 1 <= found.max_inflight < 64
    assert found.max_inflight == found.figures["plan.max_inflight_fit"]
    assert found.figures["plan.fits"] and "plan.reason_at_every_row" in found.figures


def test_a_paged_cache_admits_every_row_with_a_pool_of_what_is_left(micro_dir):
    """Where dense rows of max_len slots fit only 3 of 8, a paged cache runs all 8 rows with a pool of the
    pages that fit (at least one whole row; rows that outgrow it are evicted and recomputed)."""
    from retrojax.sampling.pages import PAGE_SIZE, pages_for

    dense = micro_cfg(micro_dir)
    resident = sum(train_resident_bytes(dense).values())
    per_row = kv_bytes_per_row(MICRO, 1024, "float32") + decode_bytes_per_row(MICRO)
    budget = (resident + 3.5 * per_row) / 0.85
    assert admit_rows(job="t", resident={"r": resident}, per_row=per_row, budget=budget, requested="auto",
                      wanted=8, hint="").max_inflight == 3
    paged = micro_cfg(micro_dir, kv="paged")
    found = admit_train(paged, budget)
    row_pages = pages_for(1024, PAGE_SIZE)
    assert found.figures["plan.method"] == "bound" and found.max_inflight == 8
    assert row_pages + 1 <= found.kv_pages < 8 * row_pages + 1
    assert found.figures["plan.kv_pool_gb"] * 1e9 <= 0.85 * budget - resident
    planned = resolve(paged, found)
    assert (planned.sampler.max_inflight, planned.sampler.kv_pages) == (8, found.kv_pages)
    with pytest.raises(DoesNotFit, match="sampler.kv_pages"):
        admit_train(micro_cfg(micro_dir, kv="paged", kv_pages=100 * row_pages), budget)


def _run(argv, capsys):
    code = cli_main(argv)
    return code, capsys.readouterr()


def test_train_stops_before_allocating_when_the_rows_do_not_fit(micro_dir, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(json.dumps(dataclasses.asdict(micro_cfg(micro_dir, max_inflight=8))))
    code, out = _run(["train", "--config", str(tmp_path / "c.yaml"), "--set", f"run.out_dir={tmp_path}/run",
                      "--device-memory", "0.1MB"], capsys)
    assert code == 2
    assert "error: train: the weights, optimizer state and one sampler row alone need" in out.err
    assert "To fit" in out.err
    assert not (tmp_path / "run").exists()  # nothing built, nothing written


def test_eval_and_rir_plan_a_model_policy_before_loading_it(micro_dir, capsys):
    code, out = _run(["eval", "--config", "configs/sokoban_tiny.yaml", "--policy", f"model:{micro_dir}",
                      "--set", "sampler.max_inflight=64", "--set", "sampler.kv=dense",
                      "--device-memory", "2MB", "--tasks", "1",
                      "--seeds", "1"], capsys)
    assert code == 2 and "eval: " in out.err and "rows were asked for" in out.err
    code, out = _run(["rir", "--config", "configs/rir_sokoban.yaml", "--policy", f"model:{micro_dir}",
                      "--device-memory", "0.1MB", "--tasks", "1", "--seeds", "1", "--table", "main"], capsys)
    assert code == 2 and "not even one row fits" in out.err


def test_serve_refuses_a_batch_that_does_not_fit(micro_dir, capsys):
    from retrojax.serve.app import main as serve_main

    args = argparse.Namespace(model=str(micro_dir), tokenizer=None, adapter=None, name=None, host="127.0.0.1",
                              port=0, max_batch=512, max_len=4096, decode_chunk=4, row_buckets=None,
                              dtype="float32", seed=0, log_level="warning", warmup=False, keep_alive=None,
                              device_memory="4MB")
    assert serve_main(args) == 2  # 512 rows' decode temporaries beside a pool of at least one 4096-slot row
    err = capsys.readouterr().err
    assert "serve:" in err and "512 rows were asked for" in err and "--max-batch" in err


def test_train_resolves_auto_before_building_anything():
    from retrojax.learn.cli import plan_run

    cfg = load("configs/sokoban_tiny.yaml", [])
    assert cfg.sampler.max_inflight == "auto"
    planned, admission, remat = plan_run(cfg, "24GB")
    assert planned.sampler.max_inflight == admission.max_inflight == 8  # 2 tasks x 4 trials: all fit
    assert admission.figures["plan.method"] == "bound" and remat is False
