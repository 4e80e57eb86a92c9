"""Count the XLA programs a process compiles, by name and by run stage, and hold each stage to a bound.

Compile time dominates a CPU run (a new update shape costs seconds), so a change that adds shapes — a new
row count, an unbucketed length — shows up only as a slower run unless the programs are counted. JAX reports
every backend compile through :mod:`jax.monitoring` (``/jax/core/compile/backend_compile_duration``, with the
program's ``fun_name``; a persistent-compile-cache hit also records ``/jax/compilation_cache/cache_hits``
inside that span), on every backend, so one listener counts them all with no wrapper around any call. A hit
is counted as *cached*, apart from fresh compiles; a call that finds its program in JAX's in-memory cache
compiles nothing and is not counted.

A :class:`Ledger` adds up what each stage compiled (``with ledger.stage("sft"): ...``; a stage entered again
adds to its tally, stages may nest) and compares it with that stage's :class:`Bound`: the most programs the
stage's jitted functions (``Bound.names``) can need, computed by the caller from the functions that choose
the shapes. Programs outside a bound's names (eager ``jnp`` ops, small helpers) are counted as *other*.
A stage that needs more programs (compiled or cached) than its bound is a warning, never an error: the run
goes on.

Python API::

    ledger = Ledger()
    ledger.bound("update", Bound(12, ("_accumulate_step", "_apply_step")))
    with ledger.stage("update"):
        ...
    ledger.log()                # one line per stage, a warning for a stage past its bound
    summary.update(ledger.metrics())   # programs.<stage>.compiled / .cached / .compile_s / .bound / ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class Tally:
    """Programs of one name: fresh compiles, persistent-cache hits, and the seconds each kind took."""

    compiled: int = 0
    cached: int = 0
    compile_s: float = 0.0
    cached_s: float = 0.0

    def add(self, other: Tally, sign: int = 1) -> None:
        self.compiled += sign * other.compiled
        self.cached += sign * other.cached
        self.compile_s += sign * other.compile_s
        self.cached_s += sign * other.cached_s


class _Counter:
    """The process-wide tally by program name, fed by JAX's monitoring listeners (installed once)."""

    def __init__(self) -> None:
        self.by_name: dict[str, Tally] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # cache hits seen inside the compile span now running on a thread
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            jax.monitoring.register_event_listener(self._on_event)
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            self._installed = True

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            self._local.hits = getattr(self._local, "hits", 0) + 1

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event != COMPILE_EVENT:
            return
        hit = getattr(self._local, "hits", 0) > 0
        self._local.hits = 0
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            t = self.by_name.setdefault(name, Tally())
            if hit:
                t.cached += 1
                t.cached_s += duration
            else:
                t.compiled += 1
                t.compile_s += duration

    def snapshot(self) -> dict[str, Tally]:
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in self.by_name.items()}


COUNTER = _Counter()


def totals() -> dict[str, Tally]:
    """Every program this process compiled or loaded from the persistent cache since counting began, by
    name (counting begins at the first :func:`totals`, :class:`Ledger` or :func:`install`)."""
    COUNTER.install()
    return COUNTER.snapshot()


def install() -> None:
    """Start counting (idempotent): programs compiled before this are not seen."""
    COUNTER.install()


def base_name(fun_name: str) -> str:
    """``jit(_decode_impl)`` / ``jit__decode_impl`` / ``_decode_impl`` → ``_decode_impl``: the Python
    function's name, however this JAX version spells a program's name."""
    name = fun_name
    if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
    elif name.startswith("jit_"):
        name = name[4:]
    return name


@dataclasses.dataclass(frozen=True)
class Bound:
    """The most programs a stage's jitted functions ``names`` may compile. ``exact``: the count the shape
    rules allow; False: an upper bound, ``why`` says what it cannot know."""

    programs: int
    names: tuple[str, ...]
    exact: bool = True
    why: str = ""

    def __add__(self, other: Bound) -> Bound:
        why = "; ".join(w for w in (self.why, other.why) if w)
        return Bound(self.programs + other.programs, tuple(dict.fromkeys(self.names + other.names)),
                     self.exact and other.exact, why)


@dataclasses.dataclass
class StageCount:
    """What one stage compiled: programs under its bound's names (``compiled``/``cached``), the rest
    (``other``), and the bound (None: no bound set)."""

    compiled: int
    cached: int
    compile_s: float
    other: int
    other_s: float
    bound: Bound | None

    @property
    def programs(self) -> int:
        """Programs the stage needed: compiled, or loaded from the persistent cache (a new shape both)."""
        return self.compiled + self.cached

    @property
    def over(self) -> bool:
        return self.bound is not None and self.programs > self.bound.programs


class Ledger:
    """Per-stage program tallies of one run, and each stage's bound (module docstring)."""

    def __init__(self) -> None:
        install()
        self.stages: dict[str, dict[str, Tally]] = {}
        self.bounds: dict[str, Bound] = {}

    def bound(self, stage: str, bound: Bound) -> None:
        """Set ``stage``'s bound (replacing any earlier one)."""
        self.bounds[stage] = bound

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Count what the block compiles into stage ``name`` (added to what it compiled before)."""
        before = COUNTER.snapshot()
        try:
            yield
        finally:
            tally = self.stages.setdefault(name, {})
            for fun, t in COUNTER.snapshot().items():
                d = dataclasses.replace(t)
                if fun in before:
                    d.add(before[fun], -1)
                if d.compiled or d.cached:
                    tally.setdefault(base_name(fun), Tally()).add(d)

    def count(self, stage: str) -> StageCount:
        """``stage``'s tally against its bound."""
        bound = self.bounds.get(stage)
        names = set(bound.names) if bound is not None else None
        inside, rest = Tally(), Tally()
        for fun, t in self.stages.get(stage, {}).items():
            (inside if names is None or fun in names else rest).add(t)
        return StageCount(inside.compiled, inside.cached, inside.compile_s + inside.cached_s,
                          rest.compiled + rest.cached, rest.compile_s + rest.cached_s, bound)

    def by_name(self, stage: str) -> dict[str, Tally]:
        return {k: dataclasses.replace(v) for k, v in self.stages.get(stage, {}).items()}

    def line(self, stage: str) -> str:
        c = self.count(stage)
        text = f"programs: {stage} {c.compiled} compiled ({c.compile_s:.1f} s), {c.cached} from cache"
        if c.bound is not None:
            text += f"; bound {c.bound.programs}" + ("" if c.bound.exact else " (upper)")
        return text + f"; {c.other} other ({c.other_s:.1f} s)"

    def log(self, out: Callable[[str], None] | None = None) -> list[str]:
        """One line per stage (``out``: default print to stdout), then a warning on stderr per stage whose
        count is above its bound; returns the lines and warnings."""
        emit = out or (lambda s: print(s, flush=True))
        lines = []
        for stage in self.stages:
            lines.append(self.line(stage))
            emit(lines[-1])
        for stage in self.stages:
            c = self.count(stage)
            if c.over:
                warning = (f"warning: stage {stage} needed {c.programs} programs, above its bound of "
                           f"{c.bound.programs}: a shape the bound does not know ({self._names(stage)})")
                lines.append(warning)
                (out or (lambda s: print(s, file=sys.stderr, flush=True)))(warning)
        return lines

    def _names(self, stage: str) -> str:
        names = set(self.bounds[stage].names)
        return ", ".join(f"{k} {t.compiled + t.cached}" for k, t in sorted(self.stages[stage].items())
                         if k in names)

    def metrics(self) -> dict[str, float]:
        """``programs.<stage>.compiled``, ``.cached``, ``.compile_s``, ``.other``, ``.bound`` (where set)."""
        out: dict[str, float] = {}
        for stage in self.stages:
            c = self.count(stage)
            p = f"programs.{stage}"
            out.update({f"{p}.compiled": float(c.compiled), f"{p}.cached": float(c.cached),
                        f"{p}.compile_s": round(c.compile_s, 3), f"{p}.other": float(c.other)})
            if c.bound is not None:
                out[f"{p}.bound"] = float(c.bound.programs)
        return out
