"""The (data, fsdp, tp) device mesh from config, with devices ordered by process so ``data`` spans hosts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "fsdp", "tp")


def resolve_shape(data: int, fsdp: int, tp: int, n_devices: int) -> tuple[int, int, int]:
    """Sizes of (data, fsdp, tp) for ``n_devices``; at most one axis may be −1 (= whatever is left)."""
    sizes = [data, fsdp, tp]
    for name, s in zip(AXES, sizes, strict=True):
        if isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1):
            raise ValueError(f"mesh.{name} must be a positive int or -1 (fill), got {s!r}")
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one of mesh.data/fsdp/tp may be -1, got "
                         f"{dict(zip(AXES, sizes, strict=True))}")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if n_devices % known:
            raise ValueError(f"mesh {dict(zip(AXES, sizes, strict=True))}: {n_devices} devices are not a "
                             f"multiple of {known}")
        sizes[fill[0]] = n_devices // known
    if not fill and math.prod(sizes) < n_devices:
        return sizes[0], sizes[1], sizes[2]  # an explicit smaller mesh: the first devices (by process)
    if math.prod(sizes) != n_devices:
        raise ValueError(f"mesh {dict(zip(AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
                         f"{n_devices} are available")
    return sizes[0], sizes[1], sizes[2]


def ordered_devices(devices: Sequence[Any] | None = None) -> list[Any]:
    """Devices sorted by (process, id): each host's devices are contiguous, so ``data`` is the outer axis."""
    devs = list(jax.devices() if devices is None else devices)
    return sorted(devs, key=lambda d: (d.process_index, d.id))


def make_mesh(data: int = 1, fsdp: int = -1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes ``("data", "fsdp", "tp")`` over all (or the given) devices; −1 fills one axis.

    Without −1, a mesh smaller than the device count takes the first devices in process order.
    """
    devs = ordered_devices(devices)
    shape = resolve_shape(data, fsdp, tp, len(devs))
    return Mesh(np.asarray(devs[:math.prod(shape)], dtype=object).reshape(shape), AXES)


def mesh_from_config(cfg: Any, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh of ``cfg.mesh`` (a config with a ``mesh`` section, or the section itself)."""
    m = getattr(cfg, "mesh", cfg)
    return make_mesh(m.data, m.fsdp, m.tp, devices)


def config_mesh(cfg: Any) -> Mesh | None:
    """The config's mesh when it spans more than one device, else None (plain single-device arrays)."""
    if getattr(cfg, "mesh", None) is None:
        return None
    mesh = mesh_from_config(cfg)
    return mesh if mesh.devices.size > 1 else None


def describe(mesh: Mesh) -> dict[str, Any]:
    """JSON-able record of a mesh (written into checkpoint meta and bench reports)."""
    return {"axes": list(mesh.axis_names), "shape": [int(mesh.shape[a]) for a in mesh.axis_names],
            "devices": int(mesh.devices.size), "processes": int(jax.process_count()),
            "platform": str(mesh.devices.flat[0].platform)}


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's devices as a (rows, 1, tp) mesh: the per-host sampler replica's device set."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    tp = int(mesh.shape["tp"])
    return Mesh(np.asarray(mine, dtype=object).reshape(len(mine) // tp, 1, tp), AXES)
