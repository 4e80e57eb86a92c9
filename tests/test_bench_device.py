"""``retrojax bench device --quick`` through the real CLI: every documented key is written and the Pallas
kernel (interpret mode) matches the dense reference within 1e-5 in float32."""

from __future__ import annotations

import json

import pytest

from retrojax import cli

QUICK_KEYS = [
    "device.backend", "device.kind", "device.peak_bf16_flops", "device.hbm_bytes_per_s",
    "device.forest.max_abs_err", *(f"device.forest.max_abs_err.{g}" for g in ("out", "dq", "dk", "dv")),
    "device.update.tiny.attention", "device.update.tiny.tree_long_speedup",
    *(f"device.update.tiny.{layout}.{f}" for layout in ("rows", "tree_long")
      for f in ("s", "tokens", "model_flops", "mfu")),
    "device.memory.tiny.plan_bytes", "device.memory.tiny.peak_bytes_in_use",
    "device.forest.tiny.tokens", "device.forest.tiny.visible_pairs",
    *(f"device.forest.tiny.{impl}_s" for impl in ("kernel", "xla_loop", "dense")),
    "device.forest.tiny.kernel_over_xla_loop", "device.forest.tiny.kernel_over_dense",
    "device.update.tiny.attention_rows",
    *(f"device.rows_fused.tiny.{f}" for f in ("tokens", "implementation", "fused_s", "xla_s",
                                              "xla_over_fused")),
    *(f"device.{kind}.tiny.{f}.{b}" for b in (8,)  # --quick: one sampler batch
      for kind, f in (("prefill", "tok_per_s"), ("prefill", "mfu"), ("decode", "tok_per_s"),
                      ("decode", "hbm_roofline_fraction"))),
]


@pytest.mark.slow
def test_bench_device_quick_writes_every_key(tmp_path, capsys):
    path = tmp_path / "device.json"
    assert cli.main(["bench", "device", "--quick", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    assert sorted(figures) == sorted(QUICK_KEYS)
    assert figures["device.backend"] == "cpu"
    assert figures["device.forest.max_abs_err"] <= 1e-5
    assert figures["device.update.tiny.attention"] == "xla"  # model.attention auto on CPU
    assert figures["device.update.tiny.attention_rows"] == "xla"
    assert figures["device.rows_fused.tiny.implementation"] == "xla"  # cuDNN is for GPUs
    assert figures["device.peak_bf16_flops"] is None and figures["device.update.tiny.rows.mfu"] is None
    for key in QUICK_KEYS:
        if key.startswith(("device.forest.tiny.", "device.update.tiny.r", "device.update.tiny.t",
                           "device.rows_fused.tiny.fused", "device.rows_fused.tiny.x",
                           "device.prefill.tiny.tok", "device.decode.tiny.tok")) and ".mfu" not in key:
            assert figures[key] > 0, key
    assert "device.forest.max_abs_err: " in capsys.readouterr().out
