"""``retrojax plan --config FILE [--set K=V …] --device-memory 80GB [--json FILE]``.

Needs no weights (shapes from the preset or ``model.path``'s config.json). When the config's mesh needs
more devices than this host has, the command re-runs itself on that many simulated CPU devices
(``--xla_force_host_platform_device_count``): the plan is compile-only, so nothing of that size is
allocated. Exit status 0 when everything fits, 1 with the reason when something does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

_UNITS = {"": 1e9, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> float:
    """``80GB`` / ``80`` (GB) / ``141GiB`` / ``16e9B`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: expected a size such as 80GB, 141GiB or 24")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"--device-memory must be > 0, got {text!r}")
    return value


def _mesh_devices(cfg) -> int:
    m = cfg.mesh
    sizes = [m.data, m.fsdp, m.tp]
    if any(s == -1 for s in sizes):
        return 0  # fills whatever is there
    return math.prod(sizes)


def main(args: argparse.Namespace) -> int:
    from retrojax.config import ConfigError, load

    try:
        if not args.config:
            raise ValueError("retrojax plan needs --config FILE")
        cfg = load(args.config, args.overrides or [])
        device_bytes = parse_bytes(args.device_memory)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    need = _mesh_devices(cfg)
    import jax

    if need > jax.device_count():
        if os.environ.get("RETROJAX_PLAN_CHILD"):
            print(f"error: the mesh needs {need} devices, {jax.device_count()} visible", file=sys.stderr)
            return 2
        from retrojax.parallel.testing import simulated_env

        print(f"plan: the mesh needs {need} devices, this host has {jax.device_count()}: simulating {need} "
              "CPU devices (compile-only)", file=sys.stderr)
        env = simulated_env(need, {"RETROJAX_PLAN_CHILD": "1"})
        return subprocess.call([sys.executable, "-m", "retrojax.cli", *_argv(args)], env=env)
    from retrojax.parallel.mesh import config_mesh
    from retrojax.plan.memory import plan_memory

    try:
        mesh = config_mesh(cfg)
        figures = plan_memory(cfg, device_bytes, mesh=mesh, log=lambda s: print(s, file=sys.stderr),
                              compare=not args.no_compare)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    figures["plan.simulated_devices"] = bool(os.environ.get("RETROJAX_PLAN_CHILD"))
    figures["plan.backend"] = jax.devices()[0].platform
    for k, v in figures.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if not figures["plan.fits"]:
        print(f"does not fit: {figures['plan.reason']}", file=sys.stderr)
        return 1
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["plan", "--config", args.config, "--device-memory", args.device_memory]
    for s in args.overrides or []:
        out += ["--set", s]
    if args.json:
        out += ["--json", args.json]
    if args.no_compare:
        out.append("--no-compare")
    return out

