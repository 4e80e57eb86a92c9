"""``retrojax plan`` on a tiny config: compile-only figures under the documented keys, exit 1 with the reason
when a phase does not fit, ``learn.remat: auto`` resolution."""

from __future__ import annotations

import json

from retrojax.cli import main as cli
from retrojax.config import load
from retrojax.plan import resolve_remat
from retrojax.plan.cli import parse_bytes

KEYS = ("plan.fits", "plan.total_gb", "plan.params_gb", "plan.opt_gb", "plan.grads_gb", "plan.act_gb",
        "plan.kv_gb", "plan.remat", "plan.max_inflight_fit")
TINY = """model: {preset: tiny}
sampler: {max_len: 256, max_inflight: 8}
learn: {seq_buckets: [128, 256], max_batch_tokens: 1024, logprob_chunk: 64, lora: {rank: 4}}
mesh: {data: 1, fsdp: 1, tp: 1}
"""


def test_plan_figures_and_a_plan_that_does_not_fit(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "plan.json"
    assert cli(["plan", "--config", str(cfg), "--device-memory", "2GB", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert all(k in fig for k in KEYS) and fig["plan.fits"] is True
    assert fig["plan.route"] == "lora" and fig["plan.remat"] is False  # auto: fits without remat
    assert fig["plan.remat_on.act_gb"] < fig["plan.no_remat.act_gb"]
    assert fig["plan.trainable_gb"] < fig["plan.full.grads_gb"]
    assert fig["plan.opt_gb"] < fig["plan.full.opt_gb"]
    assert 0 < fig["plan.total_gb"] <= 2 and fig["plan.max_inflight_fit"] >= 8
    # a device too small for the update: exit 1 and say what does not fit
    capsys.readouterr()
    assert cli(["plan", "--config", str(cfg), "--device-memory", "20MB", "--no-compare", "--json",
                str(out)]) == 1
    assert "does not fit: the update needs" in capsys.readouterr().err
    assert json.loads(out.read_text())["plan.fits"] is False


def test_sizes_and_remat_settings():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30 and parse_bytes("24") == 24e9
    assert resolve_remat(load(None, ["learn.remat=true"])) is True
    assert resolve_remat(load(None, ["learn.remat=false"])) is False
    assert resolve_remat(load(None)) is False  # auto: the tiny default fits any host without remat
