"""The HTTP side of ``retrojax serve``: a FastAPI app with ``/v1/models`` and ``/v1/chat/completions``.

Requests are validated here (:mod:`retrojax.serve.protocol`), rendered with the model's chat template
(:mod:`retrojax.serve.template`) and handed to the continuous-batching :class:`~retrojax.serve.engine.Engine`;
replies come back as one ``chat.completion`` or as server-sent ``chat.completion.chunk`` events ending with
``data: [DONE]``. Every refusal is the OpenAI error object with a 4xx status; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request

from retrojax.serve.engine import Engine, Job
from retrojax.serve.protocol import (
    APIError,
    ChatRequest,
    chunk_body,
    completion_body,
    completion_id,
    parse_chat_request,
    usage,
)
from retrojax.serve.template import render_prompt, template_name

# Seconds an idle keep-alive connection stays open. Clients pool connections and reuse one idle for less than
# their own expiry (httpx, and so the openai client: 5 s); uvicorn's default of 5 s closed such a connection
# just as a request arrived on it, and the client got "Connection reset by peer" (uvloop runs due timers
# before reading sockets, so under load the request bytes were already there when the connection closed).
# Outliving the clients' expiry leaves the closing to them.
KEEP_ALIVE_S = 75


def _error_response(error: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status)


def create_app(engine: Engine, model_name: str) -> Any:
    """The FastAPI app serving ``engine`` under the model id ``model_name``."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="retrojax serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {exc.errors()}"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine._active), "stats": engine.stats}

    @app.get("/metrics")
    async def metrics():
        """Counters (requests, tokens, prefix reuse) and every compiled program with its first-call time."""
        return {"running": len(engine._active), "stats": engine.stats,
                "row_buckets": engine.sampler.row_buckets, "programs": engine.programs()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "retrojax", "max_model_len": engine.max_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
            req = parse_chat_request(body)
            if req.model != model_name:
                raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                               f"'{model_name}'", param="model", code="model_not_found")
            prompt = render_prompt(engine.tokenizer, req.messages, req.enable_thinking)
            if len(prompt) >= engine.max_len:
                raise APIError(400, f"the prompt has {len(prompt)} tokens; this server's context is "
                               f"{engine.max_len} tokens (prompt + reply)", param="messages",
                               code="context_length_exceeded")
            max_tokens = req.max_tokens if req.max_tokens is not None else engine.max_len - len(prompt)
            if len(prompt) + max_tokens > engine.max_len:
                raise APIError(400, f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}; "
                               f"together they exceed this server's context of {engine.max_len} tokens",
                               param="max_tokens", code="context_length_exceeded")
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            job = Job(prompt=prompt, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, stop=req.stop, stream=req.stream,
                      on_event=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
            engine.submit(job)
        except APIError as e:
            return _error_response(e)
        if req.stream:
            return StreamingResponse(_stream(engine, job, queue, req), media_type="text/event-stream")
        try:
            while True:
                event = await queue.get()
                if "error" in event:
                    return _error_response(event["error"])
                if "done" in event:
                    return completion_body(completion_id(), model_name, event["text"], event["finish_reason"],
                                           event["stop_reason"], event["prompt_tokens"],
                                           event["completion_tokens"])
        finally:
            if not job.finished:
                engine.cancel(job)

    return app


async def _stream(engine: Engine, job: Job, queue: asyncio.Queue, req: ChatRequest) -> AsyncIterator[str]:
    cid, created = completion_id(), int(time.time())

    def sse(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield sse(chunk_body(cid, req.model, created, {"role": "assistant", "content": ""}))
        while True:
            event = await queue.get()
            if "error" in event:
                yield sse(event["error"].body())
                break
            if "delta" in event:
                yield sse(chunk_body(cid, req.model, created, {"content": event["delta"]}))
                continue
            yield sse(chunk_body(cid, req.model, created, {}, event["finish_reason"], event["stop_reason"]))
            if req.include_usage:
                yield sse(chunk_body(cid, req.model, created, {}, no_choice=True,
                                     usage_=usage(event["prompt_tokens"], event["completion_tokens"])))
            break
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:
            engine.cancel(job)


class BackgroundServer:
    """uvicorn serving ``app`` from a thread on ``host`` (port 0: a free port), for tests and benchmarks."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, keep_alive_s: int = KEEP_ALIVE_S):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_keep_alive=keep_alive_s))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the background server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def load_engine(model_dir: str | Path, tokenizer_dir: str | Path | None = None, *, rows: int = 16,
                max_len: int = 2048, chunk_steps: int = 4, dtype: str = "float32", seed: int = 0,
                min_window: int = 256, adapter: str | Path | None = None,
                row_buckets: tuple[int, ...] | None = None, log: Any = None,
                pages: int | None = None) -> Engine:
    """An engine over a Hugging Face Qwen3 directory (config.json + safetensors + tokenizer files).
    ``min_window``: the smallest attention window compiled for (``max_len``: one decode compilation).
    ``row_buckets``/``log``/``pages`` (the KV page pool; None: every row at ``max_len``): see
    :class:`~retrojax.serve.engine.Engine`.
    ``adapter``: a PEFT LoRA adapter directory served on the base (decoded from merged weights)."""
    import jax.numpy as jnp

    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.tokenizer import load_tokenizer

    model = from_pretrained(Path(model_dir), dtype=jnp.dtype(dtype))
    if adapter:
        from retrojax.model.lora import for_decoding
        from retrojax.model.peft import load_peft_adapter

        model = for_decoding(load_peft_adapter(model, adapter))
    tokenizer = load_tokenizer(Path(tokenizer_dir or model_dir))
    # prefill chunks of at most 512 tokens: a 700-token prompt costs 512 + 256 token slots, not 2048
    buckets = tuple(b for b in (32, 128, 256, 512) if b < max_len) or (max_len,)
    return Engine(model, tokenizer, rows=rows, max_len=max_len, chunk_steps=chunk_steps, seed=seed,
                  chunk_buckets=buckets, min_window=min_window, row_buckets=row_buckets, log=log, pages=pages)


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax serve`` (flags in ``retrojax/cli.py``)."""
    model_dir = Path(args.model)
    for what, path in (("model", model_dir), ("tokenizer", Path(args.tokenizer or model_dir))):
        if not path.is_dir():
            print(f"retrojax serve: {what} directory {path} does not exist", file=sys.stderr)
            return 2
    if args.max_batch < 1 or args.max_len < 2 or args.decode_chunk < 1:
        print("retrojax serve: --max-batch, --decode-chunk must be >= 1 and --max-len >= 2", file=sys.stderr)
        return 2
    try:
        spec = getattr(args, "row_buckets", None)
        row_buckets = tuple(int(b) for b in spec.split(",")) if spec else None
        from retrojax.plan.admission import admit_serving, summary

        planned = admit_serving(model_dir, args.dtype, args.max_batch, args.max_len,
                                getattr(args, "device_memory", None))  # DoesNotFit: before any allocation
        print(f"retrojax serve: {summary(planned).removeprefix('plan: ')}", file=sys.stderr)
        engine = load_engine(model_dir, args.tokenizer, rows=args.max_batch, max_len=args.max_len,
                             chunk_steps=args.decode_chunk, dtype=args.dtype, seed=args.seed,
                             adapter=getattr(args, "adapter", None), row_buckets=row_buckets,
                             pages=planned.kv_pages,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, ValueError) as e:
        print(f"retrojax serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    name = args.name or model_dir.resolve().name
    if getattr(args, "warmup", True):
        print(f"retrojax serve: compiling {engine.stats['program_bound']} programs before serving "
              "(--no-warmup: on first use)", file=sys.stderr, flush=True)
        seconds = engine.warmup()
        print(f"retrojax serve: {engine.stats['programs']} programs compiled in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    engine.start()
    print(f"retrojax serve: '{name}' ({template_name(engine.tokenizer)}; {engine.rows} rows × "
          f"{engine.max_len} tokens; row buckets {','.join(map(str, engine.sampler.row_buckets))}, at most "
          f"{engine.stats['program_bound']} programs) on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_keep_alive=getattr(args, "keep_alive", None) or KEEP_ALIVE_S)
    finally:
        engine.close()
    return 0
