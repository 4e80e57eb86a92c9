"""`retrojax eval` with RIR protocol names writes the stable JSON keys; `retrojax rir` writes report.md with
every table, the range heat map and the paper's anchors marked as the paper's."""

from __future__ import annotations

import json

from retrojax.cli import main


def test_eval_json_and_rir_report(tmp_path):
    out = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            "--config",
            "configs/rir_minesweeper.yaml",
            "--policy",
            "oracle:0.3",
            "--protocol",
            "T@3,RIR,RIR/react,RIR/range-2-8",
            "--seeds",
            "2",
            "--tasks",
            "6",
            "--set",
            "trial.trials_per_task=1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["protocols"] == ["T@3", "RIR", "RIR/react", "RIR/range-2-8"]
    for name in ("RIR", "RIR/react", "RIR/range-2-8"):
        r = data["results"][name]
        assert {"success", "ci95", "dense_reward", "actions", "reviews", "rollbacks", "aux_calls"} <= set(r)
        assert r["n"] == 12 and 0 <= r["ci95"][0] <= r["success"] <= r["ci95"][1] <= 1
    assert data["results"]["RIR/react"]["reviews"] == 0 and "T@3" in data["results"]
    assert main(["eval", "--config", "configs/rir_minesweeper.yaml", "--protocol", "RIR/bogus"]) == 2

    rc = main(
        [
            "rir",
            "--config",
            "configs/rir_sokoban.yaml",
            "--table",
            "all",
            "--tasks",
            "4",
            "--seeds",
            "1",
            "--trials-per-task",
            "1",
            "--set",
            "rir.range_l_min=[2,4]",
            "--set",
            "rir.range_l_max=[8]",
            "--out",
            str(tmp_path / "rep"),
        ]
    )
    assert rc == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    for title in ("Table 1", "Table 2", "Table 3a", "Table 3b", "Table 3c", "Range sweep", "acceptance"):
        assert title in text
    assert "76.75%" in text and "77.49%" in text and "their numbers, not ours" in text
    assert (tmp_path / "rep" / "range_sokoban.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert set(summary["sokoban"]["results"]) >= {"RIR", "RIR/range-2-8", "RIR/range-4-8", "P@1", "T@3"}
    assert (
        main(["rir", "--config", "configs/rir_sokoban.yaml", "--table", "nope", "--out", str(tmp_path)]) == 2
    )


def test_rir_protocol_filter_runs_only_the_named_rows(tmp_path):
    args = ["rir", "--config", "configs/rir_sokoban.yaml", "--table", "main", "--tasks", "2", "--seeds", "1",
            "--trials-per-task", "1", "--out", str(tmp_path / "rep")]
    assert main([*args, "--protocol", "RIR,RIR/react"]) == 0
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert set(summary["sokoban"]["results"]) == {"RIR", "RIR/react"}
    assert main([*args, "--protocol", "RIR/bogus"]) == 2  # not among the table's rows: a clear error
