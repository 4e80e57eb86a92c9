"""A pool of worker processes, each holding one text-world engine instance.

A call names the state the worker must be in (task + action path) and the operation to run there.
The worker replays the path (reset + steps) only when its engine is elsewhere, checks the replayed
observation against the one recorded, and then runs the operation — so any worker can serve any
trial, and a restarted worker continues a trial by replay without the caller doing anything.

Calls of one batch run in parallel across workers (each worker serves its queue in order); every call
has a deadline. A worker that dies or misses its deadline is killed with its whole process group (the
engine's JVM included), restarted, and the call is sent again (once, with extra time for the fresh
engine to warm up: its first call replays the trial's path). Workers are fresh interpreters
(``python -m envs.textworlds.worker``, never a fork of a process that may hold JAX threads) started in
their own session and talking over a socket pair, so closing the pool (or killing one worker) leaves
no stray engine process behind, and the caller's ``__main__`` is never re-imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from envs.textworlds.base import Observation, ReplayDivergence, TextWorld, TextWorldError, digest

WORLDS = {
    "scienceworld": "envs.textworlds.scienceworld:ScienceWorld",
    "alfworld": "envs.textworlds.alfworld:ALFWorld",
}


def make_world(world: str, kwargs: dict[str, Any] | None = None) -> TextWorld:
    """Build a world by registered name or ``module:Class`` path."""
    target = WORLDS.get(world, world)
    if ":" not in target:
        raise ValueError(f"unknown text world '{world}' (known: {', '.join(sorted(WORLDS))})")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class Call:
    """One operation at a given state: ``op`` ∈ reset | restore | step | admissible | candidates |
    expert | goal.

    ``path`` is the action sequence from the task's reset to the state the op runs at; ``expected``
    is the observation recorded there (checked whenever the worker had to replay to get there).
    """

    op: str
    task: str
    path: tuple[str, ...] = ()
    expected: str | None = None
    expected_key: str | None = None  # the world's state key recorded there (checked after a replay)
    path_keys: tuple[str, ...] = ()  # state keys recorded after each path action (checked where needed)
    action: str | None = None
    fresh: bool = False  # replay even if the worker is already at this state (rewinds)
    admissible: bool = False  # attach the world's admissible actions to the returned observation
    prefetch_expert: bool = False  # also work out the expert's next action at the resulting state


@dataclasses.dataclass(frozen=True)
class Reply:
    """The answer to one call: ``value`` on success, else ``error`` (with ``kind``)."""

    value: Any = None
    error: str | None = None
    kind: str | None = None  # divergence | engine | worker
    restarts: int = 0
    replayed: int = 0  # actions replayed by the worker to reach the call's state

    @property
    def ok(self) -> bool:
        return self.error is None


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------


CACHED_OPS = frozenset({"step", "admissible", "candidates", "expert", "goal"})
RESULT_CACHE_SIZE = 4096


def value_done(value: Any) -> bool:
    return isinstance(value, Observation) and value.done


class _WorkerState:
    """The engine plus which (task, path) it currently reflects (None = unknown).

    Engines are deterministic up to the world's canonical form (every replay checks it), so a worker
    also remembers the answers of recent calls by (op, task, path, action): trials that share a
    prefix — the B trials of one task — are then served without moving the engine. To reach a state
    it replays only the missing suffix when the engine already stands on a prefix of the wanted path,
    else it resets and replays all.
    Rewinds (``fresh``) always reset and replay for real.
    """

    def __init__(self, world: TextWorld, cache_size: int = RESULT_CACHE_SIZE):
        self.world = world
        self.at: tuple[str, tuple[str, ...]] | None = None
        self.obs: Observation | None = None
        self.cache: OrderedDict[str, Any] = OrderedDict()
        self.cache_size = int(cache_size)

    def _reach(
        self, task: str, path: tuple[str, ...], expected: str | None, fresh: bool = False,
        expected_key: str | None = None, path_keys: tuple[str, ...] = (),
    ) -> tuple[Observation, int]:
        """Bring the engine to ``(task, path)`` and check it against the record there.

        A replay that does not reproduce the record is tried again from a fresh reset, up to the
        world's ``replay_attempts`` — or its ``order_attempts`` for mismatches found right after an
        order-dependent action, which is checked against its recorded state key at once (ScienceWorld
        reorders identically named objects at each reset, so a numbered answer to its "Ambiguous
        request" may pick another of them). It stays a ``ReplayDivergence`` after the last attempt.
        """
        if not fresh and self.at == (task, path) and self.obs is not None:
            return self.obs, 0
        start, obs = 0, None
        if (not fresh and self.at is not None and self.obs is not None and self.at[0] == task
                and len(self.at[1]) <= len(path) and path[: len(self.at[1])] == self.at[1]):
            start, obs = len(self.at[1]), self.obs  # the engine stands on a prefix: replay the rest
        limits = (max(1, int(self.world.replay_attempts)), max(1, int(self.world.order_attempts)))
        replayed, tries, order_tries = 0, 0, 0
        while True:
            self.at = None
            try:
                obs, n = self._replay(task, path, start, obs, expected, expected_key, path_keys)
                replayed += n
                break
            except ReplayDivergence as e:
                replayed += e.replayed
                order_tries += e.at_order_dependent
                tries += not e.at_order_dependent
                if tries >= limits[0] or order_tries >= limits[1]:
                    total = tries + order_tries
                    note = f" (after {total} replays)" if total > 1 else ""
                    raise ReplayDivergence(f"{e}{note}", replayed) from None
                start, obs = 0, None
        self.at, self.obs = (task, path), obs
        return obs, replayed

    def _replay(
        self, task: str, path: tuple[str, ...], start: int, obs: Observation | None, expected: str | None,
        expected_key: str | None, path_keys: tuple[str, ...] = (),
    ) -> tuple[Observation, int]:
        """One replay from ``start`` (0: a reset); returns the observation and the actions replayed.
        A ``ReplayDivergence`` carries the actions it replayed."""
        if start == 0:
            obs = self.world.reset(task)
        for i, action in enumerate(path[start:], start=start):
            check = i < len(path_keys) and bool(path_keys[i]) and self.world.order_dependent(action)
            obs = self.world.step(action, full=i == len(path) - 1 or check)
            if not obs.valid:
                raise ReplayDivergence(
                    f"replay of {task}: action {i + 1} '{action}' was rejected on replay: {obs.text[:200]!r}",
                    i + 1 - start,
                )
            if check and obs.key != path_keys[i]:
                raise ReplayDivergence(
                    f"replay of {task}: action {i + 1} '{action}' reached another state than recorded "
                    f"(state key {obs.key} vs {path_keys[i]})", i + 1 - start, at_order_dependent=True,
                )
        assert obs is not None
        if expected is not None and obs.text != expected:
            recorded, replayed = self.world.canonical(expected), self.world.canonical(obs.text)
            if recorded != replayed:
                only_rec = sorted(set(recorded.splitlines()) - set(replayed.splitlines()))
                only_rep = sorted(set(replayed.splitlines()) - set(recorded.splitlines()))
                raise ReplayDivergence(
                    f"replay of {task} to C_{len(path)} diverged: recorded {expected[:160]!r}, "
                    f"replayed {obs.text[:160]!r}; only recorded: {only_rec[:3]!r}, only replayed: "
                    f"{only_rep[:3]!r}", len(path) - start,
                )
        if expected_key and obs.key and obs.key != expected_key:
            raise ReplayDivergence(
                f"replay of {task} to C_{len(path)} diverged: the observation matches but the world's state "
                f"(its state key {obs.key} vs recorded {expected_key}) does not", len(path) - start,
            )
        return obs, len(path) - start

    @staticmethod
    def _key(op: str, task: str, path: tuple[str, ...], action: str | None, admissible: bool) -> str:
        return digest(op, task, str(len(path)), *path, action or "", str(admissible))

    def _remember(self, key: str, value: Any) -> None:
        self.cache[key] = value
        self.cache.move_to_end(key)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    def run(self, call: Call) -> tuple[Any, int]:
        key = None
        if self.cache_size > 0 and call.op in CACHED_OPS and not call.fresh:
            key = self._key(call.op, call.task, call.path, call.action, call.admissible)
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key], 0
        value, replayed = self._run(call)
        if call.admissible and isinstance(value, Observation):
            value = dataclasses.replace(value, admissible=self.world.admissible())
        if key is not None:
            self._remember(key, value)
        if call.prefetch_expert and self.cache_size > 0 and self.at is not None and not value_done(value):
            # the engine stands on the resulting state now: answer the expert call of the next turn
            ekey = self._key("expert", *self.at, None, False)
            if ekey not in self.cache:
                self._remember(ekey, self.world.expert_action())
        return value, replayed

    def _run(self, call: Call) -> tuple[Any, int]:
        if call.op == "reset":
            self.at = None
            obs = self.world.reset(call.task)
            self.at, self.obs = (call.task, ()), obs
            return obs, 0
        obs, replayed = self._reach(call.task, call.path, call.expected, call.fresh, call.expected_key,
                                    call.path_keys)
        if call.op == "restore":
            return obs, replayed
        if call.op == "step":
            if call.action is None:
                raise ValueError("step call without an action")
            self.at = None
            new = self.world.step(call.action)
            if new.valid:
                self.at, self.obs = (call.task, call.path + (call.action,)), new
            elif not new.changed:
                self.at = (call.task, call.path)
            return new, replayed
        if call.op == "admissible":
            return self.world.admissible(), replayed
        if call.op == "expert":
            return self.world.expert_action(), replayed
        if call.op == "candidates":
            return self.world.candidates(), replayed
        if call.op == "goal":
            return self.world.goal(), replayed
        raise ValueError(f"unknown call op '{call.op}'")


def worker_main(
    conn: Connection, world: str, kwargs: dict[str, Any], cache_size: int = RESULT_CACHE_SIZE
) -> None:
    """Worker process (its own session, so the pool can kill it with its engine): serve calls."""
    try:
        state = _WorkerState(make_world(world, kwargs), cache_size)
    except BaseException as e:  # report any start failure to the parent, then exit
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid(), state.world.child_pids()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "close":
                break
            if msg[0] == "sleep":  # test hook: make this worker miss its deadline
                time.sleep(float(msg[1]))
                continue
            call_id, call = msg[1], msg[2]
            try:
                value, replayed = state.run(call)
                conn.send(("ok", call_id, value, replayed))
            except ReplayDivergence as e:
                state.at = None
                conn.send(("err", call_id, "divergence", str(e)))
            except Exception as e:  # engine errors are per-call answers, the worker stays up
                state.at = None
                detail = traceback.format_exc(limit=3)
                conn.send(("err", call_id, "engine", f"{type(e).__name__}: {e}\n{detail}"))
    finally:
        state.world.close()
        conn.close()


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    proc: Any
    conn: Connection
    pid: int
    child_pids: list[int]


def _kill_group(proc: Any) -> None:
    """SIGKILL a worker and everything in its session (its engine's JVM)."""
    pid = proc.pid
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError):
        pass


def _join(proc: Any, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _shutdown(workers: list[_Worker | None], grace_s: float) -> None:
    for w in workers:
        if w is None:
            continue
        try:
            w.conn.send(("close",))
        except (OSError, BrokenPipeError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for w in workers:
        if w is None:
            continue
        _join(w.proc, max(0.0, deadline - time.monotonic()))
        _kill_group(w.proc)  # the session may still hold an engine process; make sure it is gone
        _join(w.proc, 2.0)
        w.conn.close()


class WorkerPool:
    """``num_workers`` processes, each with one ``world`` engine; see the module docstring."""

    def __init__(
        self,
        world: str,
        num_workers: int = 2,
        timeout_s: float = 30.0,
        world_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 180.0,
        max_retries: int = 1,
        retry_grace_s: float = 60.0,
        result_cache: int = RESULT_CACHE_SIZE,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.world = world
        self.world_kwargs = dict(world_kwargs or {})
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.max_retries = int(max_retries)
        self.retry_grace_s = float(retry_grace_s)  # extra time for a retry: a fresh engine warms up
        self.result_cache = int(result_cache)  # answers remembered per worker (0: always ask the engine)
        self.restarts = 0
        self._next_id = 0
        self._workers: list[_Worker | None] = [None] * num_workers
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, 5.0)
        pending = [self._spawn() for _ in range(num_workers)]
        for i, (proc, conn) in enumerate(pending):
            self._workers[i] = self._await_ready(proc, conn)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _spawn(self) -> tuple[Any, Connection]:
        parent, child = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "envs.textworlds.worker", str(child.fileno()), self.world,
               json.dumps(self.world_kwargs), str(self.result_cache)]
        proc = subprocess.Popen(
            cmd, pass_fds=[child.fileno()], start_new_session=True, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        child.close()
        return proc, Connection(parent.detach())

    def _await_ready(self, proc: Any, conn: Connection) -> _Worker:
        deadline = time.monotonic() + self.start_timeout_s
        while not conn.poll(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
        if not conn.poll(0):
            _kill_group(proc)
            raise TextWorldError(f"{self.world} worker did not start within {self.start_timeout_s:.0f}s")
        try:
            msg = conn.recv()
        except (EOFError, OSError) as e:
            _kill_group(proc)
            raise TextWorldError(f"{self.world} worker died while starting") from e
        if msg[0] != "ready":
            _kill_group(proc)
            raise TextWorldError(f"{self.world} worker failed to start: {msg[1]}")
        return _Worker(proc=proc, conn=conn, pid=msg[1], child_pids=list(msg[2]))

    def _restart(self, index: int) -> None:
        old = self._workers[index]
        if old is not None:
            _kill_group(old.proc)
            _join(old.proc, 5.0)
            old.conn.close()
        self._workers[index] = None
        self._workers[index] = self._await_ready(*self._spawn())
        self.restarts += 1

    def pids(self) -> list[int]:
        """Every process the pool started: workers and their engines' children."""
        out: list[int] = []
        for w in self._workers:
            if w is not None:
                out.append(w.pid)
                out.extend(w.child_pids)
        return out

    def kill_worker(self, index: int) -> None:
        """Kill a worker with its engine (used to test recovery)."""
        w = self._workers[index]
        if w is not None:
            _kill_group(w.proc)
            _join(w.proc, 5.0)

    def stall_worker(self, index: int, seconds: float) -> None:
        """Make a worker unresponsive for ``seconds`` (used to test per-call timeouts)."""
        w = self._workers[index]
        if w is not None:
            w.conn.send(("sleep", seconds))

    def run(self, calls: Sequence[tuple[int, Call]]) -> list[Reply]:
        """Run ``(worker_index, call)`` pairs: parallel across workers, in order within one."""
        if self._finalizer.alive is False:
            raise TextWorldError("the worker pool is closed")
        queues: dict[int, list[int]] = {}
        for pos, (wi, _) in enumerate(calls):
            if not 0 <= wi < self.num_workers:
                raise ValueError(f"worker index {wi} out of range 0..{self.num_workers - 1}")
            queues.setdefault(wi, []).append(pos)
        replies: list[Reply | None] = [None] * len(calls)
        attempts = [0] * len(calls)
        inflight: dict[int, tuple[int, int, float]] = {}  # worker -> (call pos, call id, deadline)

        def send_next(wi: int) -> None:
            while queues.get(wi):
                pos = queues[wi][0]
                self._next_id += 1
                try:
                    self._workers[wi].conn.send(("call", self._next_id, calls[pos][1]))
                except (OSError, BrokenPipeError, ValueError, AttributeError):
                    # restart, then either resend this call (retry) or move on to the next one
                    self._fail_and_restart(wi, pos, attempts, replies, queues, "worker pipe broken")
                    continue
                limit = self.timeout_s + (self.retry_grace_s if attempts[pos] else 0.0)
                inflight[wi] = (pos, self._next_id, time.monotonic() + limit)
                return

        for wi in list(queues):
            send_next(wi)
        while inflight:
            now = time.monotonic()
            wait_s = max(0.0, min(d for _, _, d in inflight.values()) - now)
            conns = {self._workers[wi].conn: wi for wi in inflight}
            ready = wait(list(conns), timeout=wait_s)
            for conn in ready:
                wi = conns[conn]
                pos, call_id, _ = inflight[wi]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    del inflight[wi]
                    self._fail_and_restart(wi, pos, attempts, replies, queues, "worker died")
                    send_next(wi)
                    continue
                if msg[1] != call_id:
                    continue  # a late answer to a call that already timed out
                del inflight[wi]
                if msg[0] == "ok":
                    replies[pos] = Reply(value=msg[2], restarts=attempts[pos], replayed=msg[3])
                else:
                    replies[pos] = Reply(error=msg[3], kind=msg[2], restarts=attempts[pos])
                queues[wi].pop(0)
                send_next(wi)
            now = time.monotonic()
            for wi, (pos, _, deadline) in list(inflight.items()):
                if now >= deadline and wi in inflight:
                    del inflight[wi]
                    self._fail_and_restart(wi, pos, attempts, replies, queues, "call timed out")
                    send_next(wi)
        return [r if r is not None else Reply(error="no answer", kind="worker") for r in replies]

    def _fail_and_restart(
        self,
        wi: int,
        pos: int,
        attempts: list[int],
        replies: list[Reply | None],
        queues: dict[int, list[int]],
        why: str,
    ) -> bool:
        """Restart worker ``wi``; keep the call queued for a retry or answer it with an error."""
        attempts[pos] += 1
        try:
            self._restart(wi)
        except TextWorldError as e:
            for p in queues[wi]:
                replies[p] = Reply(error=f"{why}; restart failed: {e}", kind="worker", restarts=attempts[p])
            queues[wi].clear()
            return False
        if attempts[pos] > self.max_retries:
            replies[pos] = Reply(
                error=f"{why} (after {attempts[pos] - 1} restart(s); limit {self.timeout_s:.1f}s per call)",
                kind="worker",
                restarts=attempts[pos],
            )
            queues[wi].pop(0)
            return False
        return True

    def close(self) -> None:
        """Stop every worker and its engine; idempotent."""
        self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

