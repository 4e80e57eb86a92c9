"""``retrojax bench serve``: aggregate output tokens/s of ``retrojax serve`` with 1, 8 and 32 concurrent
clients, against the same requests sent one at a time.

Figures (stable keys):

- ``serve.tok_per_s.{1,8,32}``: completion tokens (as the server's ``usage`` reports them) per second of wall
  time while N client threads (official ``openai`` client, loopback HTTP) each send ``per_client`` chat
  requests back to back;
- ``serve.sequential_tok_per_s``: the 32-client run's requests, sent one at a time by one client;
- ``serve.speedup_32``: ``tok_per_s.32 / sequential_tok_per_s`` (the goal is ≥ 5 on a 2-core CPU);
- ``serve.engine.*``: the engine's counters after the runs (decode calls, largest running batch, requests
  that joined a running batch, prompt tokens reused from a row's cached conversation);
- ``serve.compile_s``: seconds of the server's warm-up (``retrojax serve --warmup``), which compiles every
  program the engine can need (each row bucket and window: prefill per chunk bucket, decode) before the
  server starts; ``serve.programs``: how many; ``serve.programs_while_measuring``: programs first run during
  the timed runs (0: no compile inside the figures).

The model is the tiny Qwen3 of ``bench sampler`` (hidden 64, 2 layers, vocabulary 1000) with random weights
and a sentencepiece chat tokenizer trained here, saved with ``save_pretrained``, served by ``retrojax serve``
itself (32 rows, 4 decode steps per admission, greedy, 64 new tokens per request). The server runs in its own
process, as it does for real clients: with the clients' 32 threads in the server's
process they took the interpreter lock from the engine thread (2026-12-07, same run, every program compiled
beforehand: 32 clients 1,504 tok/s against 965 one at a time in one process, 2,711 against 633 with the
server apart). After the warm-up, one untimed 32-client round opens connections before the timed runs.
``--quick`` (smoke test): 8 tokens and one request per client, one row bucket (32), a 128-token context
(one prefill chunk bucket); the same keys.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _server(path: Path, rows: int, max_len: int, row_buckets: tuple[int, ...] | None, log) -> Iterator[str]:
    """``retrojax serve`` on ``path`` in its own process (warm-up on), its output lines to ``log``; yields the
    server's root URL once it answers ``/health``."""
    port = _free_port()
    cmd = [sys.executable, "-m", "retrojax.cli", "serve", "--model", str(path), "--name", "bench", "--port",
           str(port), "--max-batch", str(rows), "--max-len", str(max_len), "--decode-chunk", "4"]
    if row_buckets:
        cmd += ["--row-buckets", ",".join(map(str, row_buckets))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: [log(line.rstrip()) for line in proc.stdout], daemon=True)
    reader.start()
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"retrojax serve exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("retrojax serve was not ready within 900 s")
            try:
                if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)


def run(quick: bool = False, log=print) -> dict[str, float]:
    levels = (1, 8, 32)
    top = levels[-1]
    per_client, max_tokens = (1, 8) if quick else (2, 64)
    # quick: fewer programs to compile (one row bucket, one prefill chunk bucket), the same code path
    row_buckets, max_len = ((top,), 128) if quick else (None, 256)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = _build_server_dir(Path(tmp))
        with _server(path, top, max_len, row_buckets, log) as root:
            warm = httpx.get(f"{root}/metrics", timeout=30).json()["stats"]
            figures["serve.compile_s"] = float(warm["program_s"])
            figures["serve.programs"] = float(warm["programs"])
            base_url = f"{root}/v1"
            _drive(base_url, "bench", _requests(top, 7), top, max_tokens)  # connections, first calls
            heavy = _requests(top * per_client, 11)
            for n in levels:
                chats = heavy if n == top else _requests(n * per_client, 100 + n)
                tokens, wall = _drive(base_url, "bench", chats, n, max_tokens)
                figures[f"serve.tok_per_s.{n}"] = tokens / wall
                log(f"serve.tok_per_s.{n}: {tokens} tokens in {wall:.2f} s")
            tokens, wall = _drive(base_url, "bench", heavy, 1, max_tokens)
            figures["serve.sequential_tok_per_s"] = tokens / wall
            log(f"serve.sequential_tok_per_s: {tokens} tokens in {wall:.2f} s ({top}-client requests)")
            stats = httpx.get(f"{root}/metrics", timeout=30).json()["stats"]
    sequential = figures["serve.sequential_tok_per_s"]
    figures[f"serve.speedup_{top}"] = figures[f"serve.tok_per_s.{top}"] / sequential
    # programs first run after the warm-up (0: no compile inside the timed runs)
    figures["serve.programs_while_measuring"] = float(stats["programs"]) - figures["serve.programs"]
    for key in ("decode_calls", "max_running", "joined_running_batch", "prefix_reused_tokens"):
        figures[f"serve.engine.{key}"] = float(stats[key])
    return figures


def main(args: argparse.Namespace) -> int:
    return run_and_report(run, args)
