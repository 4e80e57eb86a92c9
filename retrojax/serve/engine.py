"""Continuous batching over the KV-cache sampler: one engine thread, one sampler row per running request.

The engine loops: admit waiting requests into free sampler rows (one batched prefill of their prompts),
then decode every running row together for ``chunk_steps`` tokens (one jitted ``Sampler.generate`` call
with per-row limits and sampling settings), hand each request its new text, and free the rows of
requests that finished (stop token, stop string, ``max_tokens``, full row) or were cancelled. A request
that arrives while others decode joins them at the next chunk boundary — at most ``chunk_steps`` tokens
later (1 = the next decode step) — and never waits for the batch to drain.

Rows remember their last conversation: a new request goes to the free row that shares the longest prefix
with its prompt (ties: the least recently admitted row, so a conversation between turns keeps its row),
which is rewound to that prefix (no compute) so only the rest is prefilled — an agent's next turn re-sends
its whole conversation, and only the new turns cost prefill.

Device calls run on row buckets (:mod:`retrojax.serve.batching`): the rows that have work, padded to the next
power of two, so a prefill admitting one prompt costs one row, not ``rows``. The engine's programs are bounded
(``stats["program_bound"]``) and counted as they first run (``stats["programs"]``, ``stats["program_s"]``:
seconds of those first calls, compile included), each new one reported through ``log``.

Paged keys/values (``kv="paged"``, :mod:`retrojax.sampling.pages`): requests that start with the same tokens
(a system prompt) hold its full pages once. With a pool smaller than every row at ``max_len`` (``pages``), a
request is admitted only while the pages of every running request's next chunk and of its prompt fit; a
running request that no longer fits is preempted inside the sampler (its pages freed, its conversation
recomputed by a prefill when its turn comes), never failed.

Stop strings are matched on host in the decoded text (OpenAI semantics: the reply ends before the stop
string); the row may have decoded a few tokens past it inside the chunk, which are dropped with the row.
Streaming holds back the tail that could still become a stop string and any incomplete UTF-8 character.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from retrojax.sampling.pages import pages_per_row
from retrojax.sampling.rows import bucket_for
from retrojax.sampling.stops import first_stop_token_index, pow2_at_least
from retrojax.serve.batching import RowBucketSampler
from retrojax.serve.protocol import APIError

Event = dict[str, Any]


@dataclasses.dataclass(eq=False)
class Job:
    """One chat completion in the engine. ``on_event`` is called from the engine thread with
    ``{"delta": text}`` (streaming only), then ``{"done": ...}`` or ``{"error": APIError}``."""

    prompt: list[int]
    max_tokens: int
    on_event: Callable[[Event], None]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    ids: list[int] = dataclasses.field(default_factory=list)
    sent: int = 0  # characters already streamed
    cancelled: bool = False
    finished: bool = False


class Engine:
    """See the module docstring. ``rows``: requests decoded together; ``max_len``: prompt + reply tokens;
    ``row_buckets``: row counts programs run on (None: powers of two up to ``rows``); ``log``: gets one line
    per new program; ``kv``/``pages``: paged (default) or dense keys/values, and the page pool's size."""

    def __init__(self, model: Any, tokenizer: Any, *, rows: int = 16, max_len: int = 2048,
                 chunk_steps: int = 4, seed: int = 0, chunk_buckets: tuple[int, ...] = (32, 128, 512, 2048),
                 min_window: int = 256, row_buckets: Sequence[int] | None = None,
                 log: Callable[[str], None] | None = None, kv: str = "paged", pages: int | None = None):
        if chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
        self.sampler = RowBucketSampler(model, rows=rows, max_len=max_len, tokenizer=None,
                                        chunk_buckets=chunk_buckets, min_window=min(min_window, max_len),
                                        row_buckets=row_buckets, on_program=self._on_program, kv=kv,
                                        pages=pages)
        self.log = log
        # decode lengths the engine's chunks can ask for (the sampler rounds them to powers of two >= 16)
        decode_lengths = len({pow2_at_least(k, 16) for k in range(1, chunk_steps + 1)})
        self.tokenizer = tokenizer
        self.stop_ids = [int(i) for i in tokenizer.stop_token_ids if int(i) < model.config.vocab_size]
        self.chunk_steps = chunk_steps
        self.key = jax.random.key(seed)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}
        self._admitted_at = [0] * rows  # admission counter per row: ties go to the least recently used row
        self._admissions = 0
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "finished": 0, "failed": 0, "decode_calls": 0, "max_running": 0,
                      "joined_running_batch": 0, "generated_tokens": 0, "prompt_tokens": 0,
                      "prefix_reused_tokens": 0, "programs": 0, "program_s": 0.0,
                      "program_bound": self.sampler.program_bound(decode_lengths)}

    @property
    def rows(self) -> int:
        return self.sampler.rows

    @property
    def max_len(self) -> int:
        return self.sampler.max_len

    # --- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> Engine:
        with self._cv:
            if self._running:
                return self
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="retrojax-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def warmup(self) -> float:
        """Compile every program the engine's calls can need (each row bucket and window: prefill per chunk
        bucket, decode) before serving, so no request waits on a compile; returns the seconds taken."""
        return self.sampler.warm_up(self.stop_ids, self.chunk_steps)

    def _on_program(self, shape: tuple, seconds: float) -> None:
        self.stats["programs"] += 1
        self.stats["program_s"] = round(self.stats["program_s"] + seconds, 3)
        if self.log is not None:
            kind, rows, width, window = shape[:4]
            what = f"{width} tokens" if kind == "prefill" else f"{width} steps"
            self.log(f"retrojax serve: new program {kind} [{rows} rows, {what}, window {window}]: "
                     f"{seconds:.1f} s (program {self.stats['programs']} of at most "
                     f"{self.stats['program_bound']})")

    def programs(self) -> list[dict[str, Any]]:
        """Every program run so far: its kind, rows, prefill tokens or decode steps, window, first-call s."""
        return [{"kind": shape[0], "rows": shape[1], "width": shape[2], "window": shape[3],
                 "first_call_s": round(seconds, 3)} for shape, seconds in self.sampler.programs.items()]

    # --- requests --------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins the running batch at the next chunk boundary with a free row."""
        if not job.prompt or len(job.prompt) + job.max_tokens > self.max_len or job.max_tokens < 1:
            raise APIError(400, f"prompt ({len(job.prompt)} tokens) + max_tokens ({job.max_tokens}) must fit "
                           f"the server's context of {self.max_len} tokens", code="context_length_exceeded")
        with self._cv:
            if not self._running:
                raise APIError(503, "the engine is not running", kind="server_error")
            self.stats["requests"] += 1
            self._waiting.append(job)
            self._cv.notify_all()

    @staticmethod
    def cancel(job: Job) -> None:
        """Stop working on ``job`` (a client went away); its row is freed at the next chunk boundary."""
        job.cancelled = True

    # --- the loop --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._waiting and not self._active:
                    self._cv.wait()
                if not self._running:
                    pending = [*self._waiting, *self._active.values()]
                    self._waiting.clear()
                    self._active.clear()
                    break
                running_before = len(self._active)
                free = [r for r in range(self.rows) if r not in self._active]
                admitted: list[tuple[int, Job]] = []
                while self._waiting and free:
                    if not self._pages_fit(self._waiting[0], admitted):
                        break
                    job = self._waiting.popleft()
                    if not job.cancelled:
                        row = max(free, key=lambda r, job=job: (self._common_prefix(r, job.prompt),
                                                                -self._admitted_at[r], -r))
                        self._admissions += 1
                        self._admitted_at[row] = self._admissions
                        free.remove(row)
                        self._active[row] = job
                        admitted.append((row, job))
                if running_before and admitted:
                    self.stats["joined_running_batch"] += len(admitted)
                self.stats["max_running"] = max(self.stats["max_running"], len(self._active))
                active = dict(self._active)
            try:
                self._step(admitted, active)
            except Exception as e:  # a failure fails the requests in flight, never the server
                error = APIError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
                for row, job in active.items():
                    self._finish_row(row, job, {"error": error}, failed=True)
        for job in pending:
            self._emit(job, {"error": APIError(503, "the server is shutting down", kind="server_error")})

    def _step(self, admitted: list[tuple[int, Job]], active: dict[int, Job]) -> None:
        if admitted:
            rows, chunks = [], []
            for row, job in admitted:
                common = self._common_prefix(row, job.prompt)
                self.sampler.rewind(row, common)
                self.stats["prompt_tokens"] += len(job.prompt)
                self.stats["prefix_reused_tokens"] += common
                if common < len(job.prompt):
                    rows.append(row)
                    chunks.append(job.prompt[common:])
            groups: dict[int, list[tuple[int, list[int]]]] = collections.defaultdict(list)
            for row, chunk in zip(rows, chunks, strict=True):  # one prefill per chunk bucket: a long prompt
                groups[bucket_for(len(chunk), self.sampler.buckets)].append((row, chunk))  # pads no short one
            for group in groups.values():
                self.sampler.append([r for r, _ in group], [c for _, c in group])
        for row, job in list(active.items()):
            if job.cancelled:
                self._finish_row(row, job, None)
                del active[row]
        if not active:
            return
        rows = sorted(active)
        jobs = [active[r] for r in rows]
        limits = [min(self.chunk_steps, j.max_tokens - len(j.ids)) for j in jobs]
        gens = self.sampler.generate(
            rows, limits, temperature=[j.temperature for j in jobs], top_p=[j.top_p for j in jobs],
            top_k=[j.top_k for j in jobs], stop_token_ids=self.stop_ids,
            key=jax.random.fold_in(self.key, self.stats["decode_calls"]))
        self.stats["decode_calls"] += 1
        for row, job, gen, limit in zip(rows, jobs, gens, limits, strict=True):
            job.ids.extend(int(i) for i in gen.ids)
            self.stats["generated_tokens"] += int(gen.ids.size)
            self._progress(row, job, stopped_on_token=gen.finish_reason == "stop",
                           row_full=gen.ids.size < limit)

    def _pages_fit(self, job: Job, admitted: list[tuple[int, Job]]) -> bool:
        """Paged: the pool holds the next chunk of every running request, the new ones and ``job``'s prompt
        (shared prefixes counted once per request: an upper bound). A lone request always fits."""
        book = self.sampler.paged
        if book is None or not (self._active or admitted):
            return True
        fresh = {row for row, _ in admitted}
        lengths = [len(j.prompt) if row in fresh else self.sampler.length(row)
                   for row, j in self._active.items()]
        need = sum(pages_per_row(n, book.page_size, self.chunk_steps) for n in [*lengths, len(job.prompt)])
        return need <= book.pages - 1

    def _common_prefix(self, row: int, prompt: list[int]) -> int:
        """Leading tokens ``row``'s cached conversation shares with ``prompt`` (at most ``len(prompt)``)."""
        cached = self.sampler.tokens(row)
        n = min(cached.size, len(prompt))
        if n == 0:
            return 0
        diff = np.nonzero(cached[:n] != np.asarray(prompt[:n], dtype=cached.dtype))[0]
        return int(diff[0]) if diff.size else n

    def _progress(self, row: int, job: Job, *, stopped_on_token: bool, row_full: bool) -> None:
        """New text for ``job``; finish it when it stopped or reached a limit."""
        body = job.ids[:-1] if stopped_on_token else job.ids
        text = self.tokenizer.decode(body)
        finish, stop_reason, n_tokens = None, None, len(job.ids)
        at = min(((text.find(s), s) for s in job.stop if s in text), default=None)
        if at is not None:
            text, finish, stop_reason = text[: at[0]], "stop", at[1]
            n_tokens = first_stop_token_index(job.ids, [at[1]], self.tokenizer.decode) or n_tokens
        elif stopped_on_token:
            finish, stop_reason = "stop", int(job.ids[-1])
        elif len(job.ids) >= job.max_tokens or row_full:
            finish = "length"
        if job.stream:
            hold = 0 if finish else max((len(s) for s in job.stop), default=1) - 1
            safe = len(text) - hold
            while safe > job.sent and text[safe - 1] == "\ufffd" and not finish:
                safe -= 1
            if safe > job.sent:
                self._emit(job, {"delta": text[job.sent : safe]})
                job.sent = safe
        if finish:
            self._finish_row(row, job, {"done": True, "text": text, "finish_reason": finish,
                                        "stop_reason": stop_reason, "prompt_tokens": len(job.prompt),
                                        "completion_tokens": n_tokens})

    def _finish_row(self, row: int, job: Job, event: Event | None, failed: bool = False) -> None:
        with self._cv:
            if self._active.get(row) is job:
                del self._active[row]
            self.stats["failed" if failed else "finished"] += event is not None
        job.finished = True
        if event is not None:
            self._emit(job, event)

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.on_event(event)
        except Exception:  # a vanished client's queue; nothing to tell it
            job.cancelled = True
