"""The served-model policy against small fake OpenAI servers on loopback: 429 then 200, timeouts, closed
connections and malformed JSON are retried (counted) or become counted invalid turns with their reason —
through the real trial loop, with nothing lost and every batch completed."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

pytest.importorskip("openai")

from retrojax import config as config_lib  # noqa: E402
from retrojax.agent.api_policy import ApiPolicy, restore_stop  # noqa: E402
from retrojax.agent.runner import run_trials  # noqa: E402
from retrojax.eval.protocol import make_policy  # noqa: E402

REPLY = "I push on.\n<action>right"  # the server cut the stop string off, as OpenAI servers do


class FakeServer:
    """A loopback HTTP server answering chat completions by a script: one behaviour per request, the last
    one repeating. Behaviours: ``ok``, ``429``, ``500``, ``400``, ``context``, ``slow``, ``close``,
    ``badjson``, ``nochoices``."""

    def __init__(self, script: list[str], slow_s: float = 0.6):
        self.script, self.slow_s = list(script), slow_s
        self.seen: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    fake.seen.append(body)
                    step = fake.script[min(len(fake.seen) - 1, len(fake.script) - 1)]
                fake.answer(self, step, body)

        lock = threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, h, step: str, body: dict) -> None:
        def send(status: int, payload: bytes, headers=()):
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            for k, v in headers:
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(payload)

        def error(status, message, code=None):
            err = {"message": message, "type": "x", "param": None, "code": code}
            return json.dumps({"error": err}).encode()

        if step == "close":
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if step == "slow":
            time.sleep(self.slow_s)
        if step == "429":
            return send(429, error(429, "rate limited"), [("Retry-After", "0")])
        if step == "500":
            return send(500, error(500, "boom"))
        if step == "400":
            return send(400, error(400, "bad messages", "invalid_value"))
        if step == "context":
            return send(400, error(400, "too long", "context_length_exceeded"))
        if step == "badjson":
            return send(200, b'{"id": "x", "choices": [ {"message": ')
        if step == "nochoices":
            return send(200, json.dumps({"id": "x", "object": "chat.completion"}).encode())
        reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                              "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}}
        send(200, json.dumps(reply).encode())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _cfg(base_url: str, *extra: str):
    """A tiny Sokoban config against ``base_url``; the request timeout is generous (a loaded 2-core machine
    can delay the fake server's thread past a tight one) except where a test sets one to time a slow reply
    out."""
    return config_lib.load("configs/sokoban_tiny.yaml", [
        f"api.base_url={base_url}", "api.backoff_s=0.0", "api.timeout_s=5", "api.retries=2",
        "trial.max_calls=3", *extra])


def _run(cfg, trials=1):
    policy = make_policy("api:fake", cfg)
    delays = []
    policy.sleep = delays.append
    archive, metrics = run_trials(cfg, policy, task_ids=range(trials), seeds=[0], trials_per_task=1,
                                  protocols=["P@1"])
    return policy, archive, delays


def test_429_then_200_is_retried_and_counted():
    with FakeServer(["429", "ok"]) as fake:
        policy, archive, delays = _run(_cfg(fake.base_url))
    first = archive.calls[0]
    assert first.output_text == REPLY + "</action>" and first.valid
    rep = policy.report()
    assert rep["usage"]["retries"] == 1 and rep["usage"]["failed"] == 0 and delays == [0.0]
    assert rep["usage"]["requests"] == len(archive.calls)
    assert rep["usage"]["completion_tokens"] == 7 * len(archive.calls)
    assert all((c.prompt_tokens, c.completion_tokens) == (100, 7) for c in archive.calls)
    for t in archive.trials:  # per-trial sums in the archive equal the server's reported usage
        n = sum(c.trial == t.trial for c in archive.calls)
        assert (t.prompt_tokens, t.completion_tokens) == (100 * n, 7 * n)
        assert (t.prompt_tokens, t.completion_tokens) == (
            rep["trials"][f"{t.protocol}/{t.trial}"]["prompt_tokens"],
            rep["trials"][f"{t.protocol}/{t.trial}"]["completion_tokens"])
    assert fake.seen[0]["messages"][0]["role"] == "system" and fake.seen[0]["messages"][-1]["role"] == "user"
    assert fake.seen[0]["stop"] == ["</action>"] and "chat_template_kwargs" not in fake.seen[0]


def test_enable_thinking_is_sent_as_chat_template_kwargs():
    with FakeServer(["ok"]) as fake:
        _run(_cfg(fake.base_url, "api.enable_thinking=false", "trial.max_calls=1"))
    assert fake.seen[0]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(("script", "what"), [
    (["slow"], "timeout"), (["close"], "connection"), (["badjson"], "malformed"),
    (["nochoices"], "malformed"), (["500"], "HTTP 500"),
])
def test_a_request_that_keeps_failing_becomes_a_counted_invalid_turn(script, what):
    timeout = ["api.timeout_s=0.3"] if what == "timeout" else []  # the slow reply takes 0.6 s
    with FakeServer(script) as fake:
        policy, archive, delays = _run(_cfg(fake.base_url, *timeout), trials=2)
    rep = policy.report()
    calls = len(archive.calls)
    assert len(archive.trials) == 2 and all(t.end_reason for t in archive.trials)  # the batch completed
    assert rep["usage"]["failed"] == calls and rep["usage"]["retries"] == 2 * calls
    assert sum(t.invalid_turns for t in archive.trials) == calls
    assert all(what in f["reason"] and "after 3 attempts" in f["reason"] for f in rep["failures"])
    reasons = {(f["trial"], f["call_index"]): f["reason"] for f in rep["failures"]}
    assert all(not c.valid and c.invalid_reason == f"api request failed: {reasons[(c.trial, c.call_index)]}"
               and what in c.invalid_reason for c in archive.calls)
    assert all(c.prompt_tokens == c.completion_tokens == 0 for c in archive.calls)
    assert len(delays) == 2 * calls


def test_recovering_after_a_closed_connection_and_malformed_json():
    with FakeServer(["close", "badjson", "ok"]) as fake:
        policy, archive, _ = _run(_cfg(fake.base_url))
    assert archive.calls[0].valid and archive.calls[0].output_text.endswith("</action>")
    assert policy.report()["usage"]["retries"] == 2 and not policy.failures


def test_client_errors_are_not_retried_and_a_too_long_prompt_ends_the_trial():
    with FakeServer(["400"]) as fake:
        policy, archive, delays = _run(_cfg(fake.base_url))
    assert delays == [] and len(fake.seen) == len(archive.calls) == 3
    assert all("HTTP 400: bad messages" == f["reason"] for f in policy.failures)
    with FakeServer(["context"]) as fake:
        policy, archive, _ = _run(_cfg(fake.base_url))
    assert archive.trials[0].end_reason == "context" and len(fake.seen) == 1


def test_per_kind_settings_and_concurrency_bound():
    cfg = _cfg("http://127.0.0.1:9/v1", "api.temperature=0.6", "api.execution.max_tokens=11",
               "api.reflection.temperature=0.2", "api.review.top_p=0.5", "api.concurrency=2")
    policy = make_policy("api:m", cfg)
    assert isinstance(policy, ApiPolicy) and policy.model == "m" and policy.concurrency == 2
    ex, ref, rev = policy.settings("execution"), policy.settings("reflection"), policy.settings("review")
    assert (ex.temperature, ex.max_tokens, ex.stop) == (0.6, 11, ("</action>",))
    assert (ref.temperature, ref.max_tokens) == (0.2, None)
    assert (rev.top_p, rev.stop, rev.temperature) == (0.5, (), 0.6)
    assert policy.settings("some-new-role") == policy.default
    # the baselines' auxiliary kinds send no action stop string; Self-Refine's refine is an action turn
    assert all(policy.settings(k).stop == () for k in ("critique", "reflect", "value", "assist"))
    assert policy.settings("refine") == policy.default and policy.tokenizer is None
    with FakeServer(["slow"], slow_s=0.3) as fake:
        cfg = _cfg(fake.base_url, "api.concurrency=2", "api.timeout_s=5")
        start = time.perf_counter()
        policy, archive, _ = _run(cfg, trials=4)
        took = time.perf_counter() - start
    # 4 trials × 3 calls, 0.3 s each, at most 2 at once: ≥ 6 rounds of 0.3 s; unbounded would be 3 rounds
    assert len(archive.calls) == 12 and took >= 6 * 0.3 - 0.05


def test_a_local_tokenizer_of_the_served_model_counts_rir_budgets(tmp_path):
    """``api.tokenizer``: the runners tokenize with the served model's own tokenizer (RIR's auxiliary budgets
    count its tokens); a missing directory is a clear error naming the field."""
    from retrojax.model.tokenizer import train_sentencepiece

    train_sentencepiece(["<action>up</action> the box is left of you"] * 50, 300, tmp_path / "tok")
    policy = make_policy("api:m", _cfg("http://127.0.0.1:9/v1", f"api.tokenizer={tmp_path / 'tok'}"))
    text = "the box is left of you"
    ids = policy.tokenizer.encode(text)  # the trained pieces, not bytes
    assert policy.tokenizer.decode(ids) == text and len(ids) < len(text.encode())
    with pytest.raises(ValueError, match="api.tokenizer"):
        make_policy("api:m", _cfg("http://127.0.0.1:9/v1", f"api.tokenizer={tmp_path / 'none'}"))


def test_restore_stop_puts_back_what_the_server_cut():
    assert restore_stop("a <action>up", ["</action>"], None) == "a <action>up</action>"
    assert restore_stop("a <action>up</action> b", ["</action>"], None) == "a <action>up</action> b"
    assert restore_stop("<remark>x", ["</remark>"], "</remark>") == "<remark>x</remark>"
    assert restore_stop("plain", ["END"], "END") == "plainEND"
    assert restore_stop("plain", ["END"], None) == "plain"


@pytest.mark.parametrize("script", [["ok"], ["500"], ["context"]])
def test_rir_through_a_served_model_records_usage_failures_and_context(script):
    """RIR's records carry what the server reported, a failed request is an invalid turn that names the error,
    and an overflowing context ends the trial as ``context`` — the same rules as ReTRAIL's trials."""
    from retrojax.eval.rir.run import evaluate_rir

    with FakeServer(script) as fake:
        cfg = _cfg(fake.base_url, "rir.agent_budget=3", "rir.max_review_tokens=16")
        policy = make_policy("api:fake", cfg)
        policy.sleep = lambda s: None
        part, batch = evaluate_rir(cfg, policy, "sokoban-5x5-1:test", ["RIR"], seeds=1, tasks=2,
                                   trials_per_task=1)
    assert len(batch.records) == 2 and all(r.end_reason for r in batch.records)  # the batch completed
    calls = batch.archive.calls
    served = len(fake.seen)
    tokens = part["results"]["RIR"]["tokens"]
    if script == ["ok"]:
        n = policy.report()["usage"]["requests"]
        assert tokens["prompt_tokens"] == 100 * n and tokens["completion_tokens"] == 7 * n
        assert sum(r.completion_tokens for r in batch.records) == 7 * n
    elif script == ["500"]:
        assert tokens["completion_tokens"] == 0 and all(r.api_failures > 0 for r in batch.records)
        assert all(r.invalid_turns > 0 for r in batch.records)
        assert any("api request failed" in c.invalid_reason and "HTTP 500" in c.invalid_reason
                   for c in calls)
    else:
        assert [r.end_reason for r in batch.records] == ["context", "context"] and served == 2
