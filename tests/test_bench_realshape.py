"""``retrojax bench realshape --quick`` through the real CLI: the whole path (random HF checkpoint, warm
start, collection, log-prob pass, update, checkpoint, resume, export, reload, greedy against transformers)
at the tiny shape over Qwen3's tokenizer writes every key, resumes exactly, decodes as transformers does."""

from __future__ import annotations

import json

import pytest

from retrojax import cli

PHASES = ("setup", "warm_start", "trainer", "collect", "layout", "logprobs", "update", "checkpoint", "resume",
          "export", "reload", "generate")
KEYS = [
    *(f"realshape.{p}.{f}" for p in PHASES for f in ("wall_s", "cpu_s", "peak_rss_gb", "live_arrays_gb")),
    "realshape.decode_tok_per_s", "realshape.master_changed_fraction", "realshape.resume_exact",
    "realshape.export_exact", "realshape.hf_greedy_match", "realshape.total.wall_s", "realshape.total.cpu_s",
]


@pytest.mark.slow
def test_bench_realshape_quick(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path / "realshape.json"
    assert cli.main(["bench", "realshape", "--quick", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    missing = [k for k in KEYS if k not in figures]
    assert not missing, missing
    assert figures["realshape.model"] == "tiny@qwen3-vocab"
    assert figures["realshape.resume_exact"] is True
    assert figures["realshape.export_exact"] is True
    assert figures["realshape.hf_greedy_match"] == 1.0
    assert figures["realshape.generate.tokens"] == 8
    # one update at lr 1e-6 moves the float32 masters (bfloat16 weights stepped in place would not)
    assert figures["realshape.master_changed_fraction"] > 0.5
    assert figures["realshape.update.skipped_steps"] == 0 and figures["realshape.update.trained_tokens"] > 0
    assert figures["realshape.collect.model_trials"] == 2 and figures["realshape.collect.sampled_tokens"] > 0
    for p in PHASES:
        assert figures[f"realshape.{p}.wall_s"] > 0 and figures[f"realshape.{p}.peak_rss_gb"] > 0
