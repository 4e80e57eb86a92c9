"""`retrojax eval --transcripts FILE` and `retrojax rir --transcripts FILE`: one JSON line per model call,
agent and auxiliary, ReTRAIL and RIR alike, with exactly the messages the call carried; the eval modules
import one way (no protocol ↔ rir.report cycle)."""

from __future__ import annotations

import importlib
import json
import sys

from retrojax.cli import main

KEYS = {
    "protocol",
    "task",
    "seed",
    "replicate",
    "trial",
    "call",
    "role",
    "messages",
    "reply",
    "finish_reason",
}


def _read(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(set(r) == KEYS for r in rows)
    return rows


def test_eval_transcripts_cover_every_call_of_retrail_and_rir(tmp_path):
    path, report = tmp_path / "t.jsonl", tmp_path / "eval.json"
    argv = [
        "eval",
        "--config",
        "configs/rir_sokoban.yaml",
        "--policy",
        "oracle:0.5",
        "--protocol",
        "T@3,RIR,RIR/no-rollback",
        "--seeds",
        "1",
        "--tasks",
        "3",
        "--set",
        "trial.trials_per_task=1",
        "--set",
        "rir.agent_budget=16",
        "--json",
        str(report),
        "--transcripts",
        str(path),
    ]
    assert main(argv) == 0
    rows = _read(path)
    data = json.loads(report.read_text())
    assert {r["protocol"] for r in rows} == {"T@3", "RIR", "RIR/no-rollback"}
    roles = {r["role"] for r in rows}
    assert {"execution", "review"} <= roles and roles <= {
        "execution",
        "reflection",
        "review",
        "coarse",
        "fine",
        "patch",
    }
    for name in ("RIR", "RIR/no-rollback"):  # one line per call the records count
        r = data["results"][name]
        lines = [x for x in rows if x["protocol"] == name]
        assert len(lines) == round(r["n"] * (r["agent_calls"] + r["aux_calls"]))
    retrail = [x for x in rows if x["protocol"] == "T@3"]
    assert len(retrail) == round(data["results"]["T@3"]["n"] * data["results"]["T@3"]["calls"])
    for x in rows:
        assert x["messages"][-1]["role"] == "user" and x["messages"][0]["role"] in ("system", "user")
        if x["protocol"].startswith("RIR") and x["role"] != "execution":
            assert len(x["messages"]) == 2  # auxiliary prompts are single-turn
    calls = {}
    for x in rows:  # call indices count up from 0 within each trial
        calls.setdefault((x["protocol"], x["trial"]), []).append(x["call"])
    assert all(v == list(range(len(v))) for v in calls.values())


def test_rir_report_writes_transcripts_and_model_facts(tmp_path):
    path = tmp_path / "t.jsonl"
    argv = [
        "rir",
        "--config",
        "configs/rir_sokoban.yaml",
        "--policy",
        "random",
        "--table",
        "main",
        "--seeds",
        "1",
        "--tasks",
        "2",
        "--trials-per-task",
        "1",
        "--set",
        "rir.agent_budget=10",
        "--out",
        str(tmp_path / "out"),
        "--transcripts",
        str(path),
    ]
    assert main(argv) == 0
    rows = _read(path)
    assert {"RIR", "RIR/react", "RIR/no-rollback", "RIR/restart", "T@1"} <= {r["protocol"] for r in rows}
    text = (tmp_path / "out" / "report.md").read_text()
    assert "Paired differences against RIR" in text and "failed to parse" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    parsed = summary["sokoban"]["results"]["RIR"]
    # RIR's four roles, beside any the baselines' variants add (assist, critique, refine, reflect, value)
    assert {"review", "coarse", "fine", "patch"} <= set(parsed["parse_failures_by_role"])
    from retrojax.agent.rir import replies

    bad, total = parsed["parse_failures_by_role"], parsed["aux_calls_by_role_total"]
    assert all(0 <= bad[k] <= total[k] for k in bad) and sum(bad.values()) > 0  # the random player's garbage
    # review and patch replies parse without context: the counts match the transcript's replies
    ours = [r for r in rows if r["protocol"] == "RIR"]
    assert bad["review"] == sum(
        bool(replies.parse_review(r["reply"]).problems) for r in ours if r["role"] == "review"
    )
    assert bad["patch"] == sum(
        bool(replies.parse_patch(r["reply"]).problems) for r in ours if r["role"] == "patch"
    )
    assert total["review"] == sum(r["role"] == "review" for r in ours)


def test_eval_modules_import_one_way():
    """Each of the eval modules imports first from a clean slate (every ``retrojax`` module dropped from
    ``sys.modules``, so a cycle would meet a half-initialised module); the test's own modules come back
    after, so the rest of the session keeps its classes."""
    mine = [k for k in sys.modules if k == "retrojax" or k.startswith("retrojax.")]
    saved = {k: sys.modules[k] for k in mine}
    try:
        for first in ("retrojax.eval.protocol", "retrojax.eval.rir.report", "retrojax.eval.rir.run"):
            for k in [k for k in sys.modules if k == "retrojax" or k.startswith("retrojax.")]:
                del sys.modules[k]
            for name in (first, "retrojax.eval.protocol", "retrojax.eval.rir.report"):
                importlib.import_module(name)
    finally:
        for k in [k for k in sys.modules if k == "retrojax" or k.startswith("retrojax.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    src = open("retrojax/eval/rir/run.py").read() + open("retrojax/eval/rir/metrics.py").read()
    assert "eval.protocol" not in src.replace("``eval.protocol``", "") and "rir.report" not in src.replace(
        "``eval.rir.report``", ""
    )
