"""Keep freed host memory for reuse: glibc malloc settings for XLA's CPU backend.

XLA's CPU runtime allocates every program's buffers with ``posix_memalign`` when the program runs and frees
them when it returns. Buffers above glibc's mmap threshold (128 KiB, at most 32 MiB) get fresh pages from the
kernel each time, and a worker thread's arena maps any allocation over 64 MiB whatever the threshold, so a
learner step whose attention buffers total 1.3 GB page-faults on all of them at every call. With one arena,
no mmap and no trimming, freed buffers are reused. Measured on a short demo (2026-12-06, commit 8a8e3c4, a
2-core AMD EPYC CPU), the same figures to the last digit either way: with a warm compile cache 20.4M page
faults and 60 s of kernel time in 3m38s–3m46s against 1.0M, 5 s and 3m03s–3m20s; with an empty one 7m18s
against 6m37s.
The price: the heap keeps its peak (resident set 2.8 → 3.9 GB), and threads that compile in parallel share
one arena's lock — compile-only work ran ~30% slower (two compile-heavy tests: 62–66 s against 80–87 s), which
is why ``make test``, mostly compiling, keeps glibc's defaults.

:func:`keep_freed_memory` applies the settings with ``mallopt`` in a running process; it must run before XLA
starts its threads (the CLI calls it first thing). ``RETROJAX_MALLOC=system`` leaves glibc's defaults. Any
process started with ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`` in its
environment gets the same from glibc itself.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Give the heap's free top back to the kernel only above 2 GiB (mallopt takes an int; the largest step's
# buffers come round again at the next call).
TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Set glibc malloc to one arena, no mmap, no trimming; True if applied (False off Linux/glibc, or when
    ``RETROJAX_MALLOC`` is ``system``/``0``/``off``)."""
    env = os.environ if environ is None else environ
    if env.get("RETROJAX_MALLOC", "").lower() in ("system", "0", "off", "false", "no"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's malloc
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt ignores these settings)
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all(mallopt(param, value) == 1 for param, value in settings)
