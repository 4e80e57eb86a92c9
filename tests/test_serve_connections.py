"""``retrojax serve`` at the connection level: many clients at once each get their reply, and a pooled
keep-alive connection is never closed by the server while a client may still reuse it.

The second is the cause of a "Connection reset by peer" seen under load: uvicorn's default keep-alive (5 s)
equalled the clients' pool expiry (httpx, and so the openai client: 5 s), so a client could send a request on
a connection idle for just under 5 s at the moment the server closed it.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import pytest
from serve_fixtures import tiny_qwen3_with_tokenizer

openai = pytest.importorskip("openai")

from retrojax.serve.app import BackgroundServer, create_app, load_engine  # noqa: E402

NAME = "tiny-qwen3"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = load_engine(tiny_qwen3_with_tokenizer(tmp_path_factory.mktemp("conn")), rows=4, max_len=256,
                         chunk_steps=4)
    engine.start()
    with BackgroundServer(create_app(engine, NAME)) as server:
        yield engine, server
    engine.close()


def _get(sock: socket.socket, path: str) -> tuple[int, bytes]:
    """One HTTP/1.1 GET on an open keep-alive connection: (status, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-response")
        body += chunk
    return int(lines[0].split()[1]), body


def test_an_idle_connection_outlives_the_clients_pool_expiry(served):
    server = served[1]
    idle = httpx.Limits().keepalive_expiry + 0.5  # longer than a pooled connection is reused by a client
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        assert _get(sock, "/v1/models")[0] == 200
        time.sleep(idle)
        status, body = _get(sock, "/v1/models")  # the same connection, as a client's pool would reuse it
    assert status == 200 and NAME.encode() in body


def test_many_concurrent_connections_all_get_their_reply(served):
    engine, server = served
    n = 32  # eight times the engine's rows: most wait in the queue while connections stay open
    failed = engine.stats["failed"]
    start = threading.Barrier(n)

    def one(i: int) -> int:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        start.wait()  # every connection opens at once
        reply = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"Request {i}: where is the box?"}],
            max_tokens=3, temperature=0)
        client.close()
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        tokens = list(pool.map(one, range(n)))
    assert len(tokens) == n and all(1 <= t <= 3 for t in tokens)
    assert engine.stats["failed"] == failed
