"""Run a Python snippet with N simulated CPU devices in a fresh process and read back its JSON result.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` only takes effect before JAX starts, so every
multi-device check runs in its own interpreter. The snippet prints its result as the last stdout line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any


def simulated_env(devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def run_snippet(code: str, devices: int = 8, timeout: float = 600, extra_env: dict[str, str] | None = None,
                args: list[str] | None = None) -> Any:
    """Run ``code`` on ``devices`` simulated devices; returns the JSON its last stdout line holds."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *(args or [])],
                          env=simulated_env(devices, extra_env), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"snippet failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"snippet printed nothing:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a local jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(code: str, processes: int, devices_per_process: int, timeout: float = 600) -> list[Any]:
    """Run ``code`` as ``processes`` local processes of one jax.distributed run (gloo on CPU).

    Each gets ``RETROJAX_COORDINATOR``, ``RETROJAX_PROCESS_ID`` and ``RETROJAX_NUM_PROCESSES``; returns
    every process's JSON result in process order.
    """
    port = free_port()
    procs = []
    for pid in range(processes):
        env = simulated_env(devices_per_process, {"RETROJAX_COORDINATOR": f"127.0.0.1:{port}",
                                                  "RETROJAX_PROCESS_ID": str(pid),
                                                  "RETROJAX_NUM_PROCESSES": str(processes)})
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for pid, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"process {pid} failed (rc {p.returncode}):\n{err[-4000:]}")
            lines = [ln for ln in out.splitlines() if ln.strip()]
            results.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
