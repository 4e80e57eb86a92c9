"""``retrojax bench serve``: aggregate output tokens/s of ``retrojax serve`` with 1, 8 and 32 concurrent
clients, against the same requests sent one at a time.

Figures (stable keys):

- ``serve.tok_per_s.{1,8,32}``: completion tokens (as the server's ``usage`` reports them) per second of wall
  time while N client threads (official ``openai`` client, loopback HTTP) each send ``per_client`` chat
  requests back to back;
- ``serve.sequential_tok_per_s``: the 32-client run's requests, sent one at a time by one client;
- ``serve.speedup_32``: ``tok_per_s.32 / sequential_tok_per_s`` (the goal is ≥ 5 on a 2-core CPU);
- ``serve.engine.*``: the engine's counters after the runs (decode calls, largest running batch, requests
  that joined a running batch, prompt tokens reused from a row's cached conversation).

The model is the tiny Qwen3 of ``bench sampler`` (hidden 64, 2 layers, vocabulary 1000) with random weights
and a sentencepiece chat tokenizer trained here, saved with ``save_pretrained`` and served by the same engine
and app as ``retrojax serve`` (32 rows, 4 decode steps per admission, greedy, 64 new tokens per request).
Everything is compiled by one untimed round first. ``--quick`` shrinks it (smoke test).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

import numpy as np
from flax import nnx

from retrojax.bench import run_and_report

_WORDS = ("push the box left right up down goal wall player room reach corner avoid stuck move plan "
          "rewind checkpoint remark state board target").split()


def _requests(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(12, 30))))
        out.append([{"role": "system", "content": "You play Sokoban."},
                    {"role": "user", "content": f"Turn {i}: {words}. Your move?"}])
    return out


def _build_server_dir(root: Path) -> Path:
    from retrojax.bench.sampler import MODELS
    from retrojax.model.checkpoint import save_pretrained
    from retrojax.model.qwen3 import Qwen3
    from retrojax.model.tokenizer import train_sentencepiece

    path = root / "bench-serve-tiny"
    save_pretrained(Qwen3(MODELS[""], rngs=nnx.Rngs(0)), path)
    texts = [" ".join(m["content"] for m in chat) for chat in _requests(200, 1)]
    train_sentencepiece(texts, 600, path)
    return path


def _drive(base_url: str, name: str, chats: list, clients: int, max_tokens: int) -> tuple[int, float]:
    """``chats`` sent by ``clients`` threads (each takes the next unsent one): (completion tokens, wall s)."""
    import openai

    pool_clients = [openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
                    for _ in range(clients)]
    queue = list(reversed(chats))

    def worker(i: int) -> int:
        tokens = 0
        while True:
            try:
                chat = queue.pop()
            except IndexError:
                return tokens
            reply = pool_clients[i].chat.completions.create(model=name, messages=chat, max_tokens=max_tokens,
                                                            temperature=0)
            tokens += reply.usage.completion_tokens

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(worker, range(clients)))
    return total, time.perf_counter() - start


def run(quick: bool = False, log=print) -> dict[str, float]:
    from retrojax.serve.app import BackgroundServer, create_app, load_engine

    levels = (1, 4) if quick else (1, 8, 32)
    per_client, max_tokens = (1, 8) if quick else (2, 64)
    top = levels[-1]
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = _build_server_dir(Path(tmp))
        engine = load_engine(path, rows=top, max_len=256, chunk_steps=4)
        engine.warmup()
        engine.start()
        try:
            with BackgroundServer(create_app(engine, "bench")) as server:
                _drive(server.base_url, "bench", _requests(top, 7), top, max_tokens)  # compile everything
                heavy = _requests(top * per_client, 11)
                for n in levels:
                    chats = heavy if n == top else _requests(n * per_client, 100 + n)
                    tokens, wall = _drive(server.base_url, "bench", chats, n, max_tokens)
                    figures[f"serve.tok_per_s.{n}"] = tokens / wall
                    log(f"serve.tok_per_s.{n}: {tokens} tokens in {wall:.2f} s")
                tokens, wall = _drive(server.base_url, "bench", heavy, 1, max_tokens)
                figures["serve.sequential_tok_per_s"] = tokens / wall
                log(f"serve.sequential_tok_per_s: {tokens} tokens in {wall:.2f} s ({top}-client requests)")
        finally:
            engine.close()
    sequential = figures["serve.sequential_tok_per_s"]
    figures[f"serve.speedup_{top}"] = figures[f"serve.tok_per_s.{top}"] / sequential
    for key in ("decode_calls", "max_running", "joined_running_batch", "prefix_reused_tokens"):
        figures[f"serve.engine.{key}"] = float(engine.stats[key])
    return figures


def main(args: argparse.Namespace) -> int:
    return run_and_report(run, args)
