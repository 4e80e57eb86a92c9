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
import subprocess
import sys
from pathlib import Path

from retrojax.plan.bound import parse_bytes


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

