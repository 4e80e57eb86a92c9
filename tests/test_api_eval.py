"""``retrojax eval --policy api:NAME`` against a running ``retrojax serve``: the whole trial loop (moves,
invalid turns, forced recoveries with reflections and rewinds, RIR reviews) over HTTP, the server's text in
the archive, usage in the report."""

from __future__ import annotations

import json

import pytest
from serve_fixtures import scripted_checkpoint

pytest.importorskip("openai")

from retrojax import config as config_lib  # noqa: E402
from retrojax.agent.archive import REFLECTION  # noqa: E402
from retrojax.agent.runner import run_trials  # noqa: E402
from retrojax.cli import main as cli  # noqa: E402
from retrojax.eval.protocol import make_policy  # noqa: E402
from retrojax.serve.app import BackgroundServer, create_app, load_engine  # noqa: E402

NAME = "scripted"
REPLY = "<action>right</action>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = scripted_checkpoint(tmp_path_factory.mktemp("scripted"), REPLY)
    engine = load_engine(ckpt, rows=4, max_len=2048, chunk_steps=8, min_window=2048)  # one decode compile
    engine.start()
    with BackgroundServer(create_app(engine, NAME)) as srv:
        yield engine, srv
    engine.close()


def _overrides(url: str) -> list[str]:
    return [f"api.base_url={url}", "api.temperature=0", "api.concurrency=4", "trial.max_calls=8",
            "trial.branch_budget=3", "rir.agent_budget=8", "rir.max_review_tokens=16",
            "rir.max_select_tokens=16", "rir.max_patch_tokens=16"]


def test_trials_through_the_server_keep_its_text_and_rewind_the_context(server):
    engine, srv = server
    cfg = config_lib.load("configs/sokoban_tiny.yaml", _overrides(srv.base_url))
    policy = make_policy(f"api:{NAME}", cfg)
    sent: dict[int, list] = {}
    answer = policy._answer
    policy._answer = lambda req: (sent.setdefault(req.trial, []).append(req.messages), answer(req))[1]
    archive, metrics = run_trials(cfg, policy, task_ids=range(2), seeds=[0], trials_per_task=1,
                                  protocols=["T@3"])
    assert all(c.output_text == REPLY for c in archive.calls)  # the server's text, stop string restored
    assert any(c.valid and c.action == "right" for c in archive.calls)
    assert archive.recoveries and any(c.role == REFLECTION for c in archive.calls)
    rep = policy.report()
    assert rep["usage"]["requests"] == len(archive.calls) and not rep["failures"]
    assert rep["usage"]["completion_tokens"] > 0 and rep["usage"]["prompt_tokens"] > 0
    assert sum(t.completion_tokens for t in archive.trials) == rep["usage"]["completion_tokens"]
    assert sum(t.prompt_tokens for t in archive.trials) == rep["usage"]["prompt_tokens"]
    assert all(c.completion_tokens > 0 for c in archive.calls)
    assert {int(t.split("/")[1]): u["requests"] for t, u in rep["trials"].items()} == {
        t.trial: len(archive.calls_of(t.trial)) for t in archive.trials}
    assert engine.stats["prefix_reused_tokens"] > 0  # later turns reuse the row's cached conversation
    # after a recovery to C_j, the next execution request is the C_j prefix plus the memory turn
    for rec in archive.recoveries:
        calls = archive.calls_of(rec.trial)
        msgs = sent[rec.trial]
        at_j = next(c.call_index for c in calls if c.role != REFLECTION and c.checkpoint == rec.target)
        after = next(c.call_index for c in calls if c.call_index > rec.reflection_call)
        prefix = msgs[at_j][:-1]  # the context at C_j before its user turn
        assert msgs[after][: len(prefix)] == prefix
        assert any(rec.remark in m["content"] for m in msgs[after][len(prefix):])
        assert msgs[rec.reflection_call] != msgs[after]


def test_eval_cli_with_a_served_model_reports_usage(server, tmp_path, capsys):
    _, srv = server
    out = tmp_path / "eval.json"
    args = ["eval", "--config", "configs/sokoban_tiny.yaml", "--policy", f"api:{NAME}", "--protocol",
            "T@3,RIR", "--seeds", "1", "--tasks", "1", "--json", str(out), "--set",
            "trial.trials_per_task=2"]
    for o in _overrides(srv.base_url):
        args += ["--set", o]
    assert cli(args) == 0
    printed = capsys.readouterr().out
    assert f"served model {NAME}" in printed
    report = json.loads(out.read_text())
    api = report["api"]
    assert api["usage"]["failed"] == 0 and api["usage"]["completion_tokens"] > 0
    for name in ("T@3", "RIR"):
        use = report["results"][name]["usage"]
        assert use["trials"] == 2 and use["prompt_tokens_per_trial"] > 0 and use["completion_tokens"] > 0
        tokens = report["results"][name]["tokens"]  # summed from the archive records ...
        for k in ("prompt_tokens", "completion_tokens"):  # ... equal the client's own count of the replies
            assert tokens[k] == api["protocols"][name][k] > 0
    assert report["results"]["T@3"]["rewinds"] > 0
