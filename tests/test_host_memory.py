"""retrojax.host_memory: with its malloc settings a process reuses freed buffers instead of page-faulting
fresh ones from the kernel at every allocation (what XLA's CPU runtime does at every program call)."""

from __future__ import annotations

import os
import subprocess
import sys

from retrojax.host_memory import keep_freed_memory

# As XLA's runtime does: a worker thread allocates, fills and frees a 96 MiB buffer, five times; print the
# page faults of the last four.
_PROBE = """
import ctypes, resource, sys, threading
from retrojax.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def use(n=96 << 20):
    p = ctypes.c_void_p(libc.malloc(ctypes.c_size_t(n)))
    assert p.value
    ctypes.memset(p, 1, n)
    libc.free(p)
counts = []
def work():
    use()
    before = faults()
    for _ in range(4):
        use()
    counts.append(faults() - before)
t = threading.Thread(target=work); t.start(); t.join()
print(int(applied), counts[0])
"""


def _probe(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "RETROJAX_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return bool(int(out[0])), int(out[1])


def test_freed_buffers_are_reused_without_page_faults():
    applied, kept = _probe("keep")
    _, system = _probe("system")
    assert applied
    pages = 4 * (96 << 20) // 4096  # 98,304 pages of 4 KiB: what four fresh buffers fault in
    assert system > pages // 2, system  # glibc's default maps each large buffer afresh
    assert kept < pages // 50, kept  # reused: (almost) no new faults


def test_the_system_setting_leaves_malloc_alone():
    for value in ("system", "0", "off"):
        assert keep_freed_memory({"RETROJAX_MALLOC": value}) is False
