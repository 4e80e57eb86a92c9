"""``retrojax bench envs`` output format and JSON (the measurements are replaced by fixed fakes: speed lives
in the bench command, not in tests)."""

from __future__ import annotations

import argparse
import json
import types

from retrojax.bench import envs as bench_envs


def test_main_prints_sorted_keys_goal_notes_and_json(tmp_path, monkeypatch, capsys):
    fake = types.SimpleNamespace(
        measure=lambda quick: {"sokoban.steps_per_s.1024": 3e6, "sokoban.rewind_us_per_trial": 0.1,
                               "sokoban.deepcopy_rewind_us_per_trial": 50.0,
                               "jumanji.sokoban.steps_per_s.1024": 1e6},
    )
    monkeypatch.setattr(bench_envs, "_env_modules", lambda: [fake])
    path = tmp_path / "out" / "bench.json"
    assert bench_envs.main(argparse.Namespace(json=str(path), quick=True)) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split()[0] for line in lines if not line.startswith("note:")]
    assert keys == sorted(keys) and len(keys) == 4
    assert "note: Sokoban vs Jumanji, B=1024: 3x (meets the 2x goal)" in lines
    assert "note: rewind vs deepcopy: 500x (misses the 1000x goal)" in lines
    assert json.loads(path.read_text())["sokoban.rewind_us_per_trial"] == 0.1
