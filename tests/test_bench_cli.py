"""The shared handler of ``retrojax bench sampler|update|textworlds``: progress on stderr, figures on stdout,
JSON with ``--json`` (the measurement is a fake: speed lives in the bench commands, not in tests)."""

from __future__ import annotations

import argparse
import json

from retrojax.bench import run_and_report


def test_run_and_report_prints_logs_and_writes_json(tmp_path, capsys):
    seen = {}

    def fake_run(quick: bool, log):
        seen["quick"] = quick
        log("measuring")
        return {"decode_tok_per_s.1": 1234.5, "device": "cpu"}

    path = tmp_path / "sub" / "figures.json"
    assert run_and_report(fake_run, argparse.Namespace(quick=True, json=str(path))) == 0
    out, err = capsys.readouterr()
    assert seen == {"quick": True} and "measuring" in err
    assert out.splitlines() == ["decode_tok_per_s.1: 1234", "device: cpu"]
    assert json.loads(path.read_text()) == {"decode_tok_per_s.1": 1234.5, "device": "cpu"}
