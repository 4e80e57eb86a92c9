"""``retrojax serve`` through the official ``openai`` client on loopback: parity with ``retrojax generate``
and transformers' greedy generate, streaming, continuous batching, and OpenAI errors for bad requests."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
from serve_fixtures import tiny_qwen3_with_tokenizer

openai = pytest.importorskip("openai")

from retrojax.cli import main as cli  # noqa: E402
from retrojax.serve.app import BackgroundServer, create_app, load_engine  # noqa: E402

NAME = "tiny-qwen3"
CHATS = [
    [{"role": "user", "content": "Push the box to the goal."}],
    [{"role": "system", "content": "You play Sokoban. Answer with <action>up</action>."},
     {"role": "user", "content": "Board:\n#####\n#@$.#\n#####\nYour move?"},
     {"role": "assistant", "content": "<action>right</action>"},
     {"role": "user", "content": "The box is on the goal. What now?"}],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3_with_tokenizer(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def served(ckpt):
    engine = load_engine(ckpt, rows=4, max_len=256, chunk_steps=4)
    engine.start()
    with BackgroundServer(create_app(engine, NAME)) as server:
        yield engine, server
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].base_url, api_key="unused", max_retries=0, timeout=120)


def _greedy(client, messages, n=12, **kw):
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, **kw)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_greedy_reply_equals_retrojax_generate(client, ckpt, capsys):
    prompt = CHATS[0][0]["content"]
    assert cli(["generate", "--model", str(ckpt), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    got = _greedy(client, CHATS[0])
    assert got.choices[0].message.content + "\n" == printed
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 12


@pytest.mark.parametrize("chat", CHATS)
def test_greedy_reply_equals_transformers_generate(client, ckpt, chat):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, enable_thinking=False,
                                  return_dict=False)
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    with torch.no_grad():
        out = hf.generate(torch.as_tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=stops,
                          pad_token_id=stops[1])[0, len(ids):].tolist()
    got = _greedy(client, chat, n=10)
    ended = bool(out) and out[-1] in stops
    assert got.choices[0].message.content == tok.decode(out[:-1] if ended else out)
    assert got.choices[0].finish_reason == ("stop" if ended else "length")
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(out)


def test_streaming_gives_the_same_text_and_usage(client):
    whole = _greedy(client, CHATS[1], n=9)
    stream = _greedy(client, CHATS[1], n=9, stream=True, stream_options={"include_usage": True})
    parts, finish, use = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            use = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert use.completion_tokens == whole.usage.completion_tokens == 9


def test_stop_strings_end_the_reply_before_the_string(client):
    free = _greedy(client, CHATS[0], n=12).choices[0].message.content
    cut = free[3:6]  # a string the greedy reply is known to contain
    got = _greedy(client, CHATS[0], n=12, stop=[cut])
    assert got.choices[0].message.content == free[: free.find(cut)]
    body = got.model_dump()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == cut


def test_concurrent_requests_join_the_running_batch_and_match_solo_replies(client, served):
    engine = served[0]
    chats = [[{"role": "user", "content": f"Request number {i}: where is the box?"}] for i in range(7)]
    lengths = [30, 5, 12, 8, 20, 3, 16]
    solo = [_greedy(client, c, n=n).choices[0].message.content for c, n in zip(chats, lengths, strict=True)]
    joined = engine.stats["joined_running_batch"]
    with concurrent.futures.ThreadPoolExecutor(7) as pool:  # more requests than the engine's 4 rows
        futures = [pool.submit(_greedy, client, c, n) for c, n in zip(chats, lengths, strict=True)]
        together = [f.result().choices[0].message.content for f in futures]
    assert together == solo
    assert engine.stats["joined_running_batch"] > joined  # admitted while others were decoding
    assert engine.stats["max_running"] == 4


def test_a_request_joins_while_a_long_one_decodes(client, served):
    engine = served[0]
    calls0 = engine.stats["decode_calls"]
    result = {}
    long = threading.Thread(target=lambda: result.setdefault("long", _greedy(client, CHATS[0], n=120)))
    long.start()
    while engine.stats["decode_calls"] < calls0 + 3:  # the long one is decoding
        threading.Event().wait(0.01)
    short = _greedy(client, CHATS[1], n=4)
    done_calls = engine.stats["decode_calls"]
    long.join()
    assert short.usage.completion_tokens == 4
    assert done_calls < engine.stats["decode_calls"]  # the short one finished first; the long one went on
    assert result["long"].usage.completion_tokens == 120


BAD = [
    ({"model": "no-such-model"}, 404, "model_not_found"),
    ({"temperature": -1}, 400, "invalid_value"),
    ({"top_p": 0}, 400, "invalid_value"),
    ({"max_tokens": 0}, 400, "invalid_value"),
    ({"max_tokens": 100_000}, 400, "context_length_exceeded"),
    ({"messages": []}, 400, "invalid_value"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value"),
    ({"messages": [{"role": "user"}]}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "context_length_exceeded"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ({"n": 2}, 400, "invalid_value"),
    ({"frobnicate": True}, 400, "unknown_parameter"),
]


@pytest.mark.parametrize(("change", "status", "code"), BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, change, status, code):
    kw = {"model": NAME, "messages": CHATS[0], "max_tokens": 3, **change}
    extra = {k: kw.pop(k) for k in ("frobnicate",) if k in kw}
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**kw, extra_body=extra or None)
    assert err.value.status_code == status
    assert err.value.body["code"] == code and err.value.body["type"] == "invalid_request_error"
    assert _greedy(client, CHATS[0], n=2).usage.completion_tokens == 2


def test_malformed_json_and_unknown_routes_get_openai_errors(served):
    base = served[1].base_url
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{base}/chat/completions", content=json.dumps([1, 2]), timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_metrics_list_every_program_run_within_the_bound(client, served):
    _greedy(client, CHATS[1], n=3)
    root = served[1].base_url.removesuffix("/v1")
    m = httpx.get(f"{root}/metrics", timeout=30).json()
    stats, programs = m["stats"], m["programs"]
    # rows 4: buckets 1, 2, 4; prefill chunks 32, 128 and one decode length; max_len 256: one window
    assert m["row_buckets"] == [1, 2, 4] and stats["program_bound"] == 3 * 1 * (2 + 1)
    assert 0 < stats["programs"] == len(programs) <= stats["program_bound"]
    assert {p["kind"] for p in programs} == {"prefill", "decode"} and stats["program_s"] > 0
    assert len({(p["kind"], p["rows"], p["width"], p["window"]) for p in programs}) == len(programs)


def test_sampled_and_greedy_requests_share_a_batch_without_mixing_settings(client):
    solo = _greedy(client, CHATS[1], n=8).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hot = [pool.submit(client.chat.completions.create, model=NAME, messages=CHATS[0], max_tokens=8,
                           temperature=1.5, top_p=0.95, extra_body={"top_k": 50}) for _ in range(3)]
        cold = pool.submit(_greedy, client, CHATS[1], 8)
        replies = [f.result() for f in hot]
    assert cold.result().choices[0].message.content == solo
    assert all(r.usage.completion_tokens <= 8 for r in replies)


def test_chat_template_kwargs_switch_qwen3_thinking(client, ckpt):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    for thinking in (True, False):
        ids = tok.apply_chat_template(CHATS[1], tokenize=True, add_generation_prompt=True,
                                      enable_thinking=thinking, return_dict=False)
        switch = {"chat_template_kwargs": {"enable_thinking": thinking}}
        got = _greedy(client, CHATS[1], n=2, extra_body=switch)
        assert got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError):
        _greedy(client, CHATS[1], n=2, extra_body={"chat_template_kwargs": {"tools": []}})
