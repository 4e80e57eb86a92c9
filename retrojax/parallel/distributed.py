"""``jax.distributed`` start-up from the ``distributed:`` config, and JAX's persistent compilation cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

_CLUSTER_ENV = ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
                "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")
_STARTED = False


def wants_initialize(dc: Any, environ: dict[str, str] | None = None) -> bool:
    """Whether ``dc`` (a DistributedConfig) asks for ``jax.distributed.initialize``."""
    env = os.environ if environ is None else environ
    value = dc.initialize
    mode = {True: "on", False: "off"}[value] if isinstance(value, bool) else str(value).lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed.initialize must be auto | on | off, got {dc.initialize!r}")
    if mode == "off":
        return False
    if mode == "on":
        return True
    return bool(dc.coordinator) or any(k in env for k in _CLUSTER_ENV)


def initialize(dc: Any) -> bool:
    """Start this process's part of a multi-process run (once); returns whether it is distributed.

    Must run before anything touches a device. On CPU the cross-process collectives use
    ``dc.cpu_collectives`` (gloo by default).
    """
    global _STARTED
    if _STARTED:
        return True
    if not wants_initialize(dc):
        return False
    if dc.cpu_collectives:
        if dc.cpu_collectives not in ("gloo", "mpi"):
            raise ValueError(f"distributed.cpu_collectives must be gloo | mpi, got {dc.cpu_collectives!r}")
        jax.config.update("jax_cpu_collectives_implementation", dc.cpu_collectives)
    kwargs: dict[str, Any] = {}
    if dc.coordinator:
        kwargs["coordinator_address"] = dc.coordinator
    if dc.num_processes is not None:
        kwargs["num_processes"] = dc.num_processes
    if dc.process_id is not None:
        kwargs["process_id"] = dc.process_id
    jax.distributed.initialize(**kwargs)
    _STARTED = True
    return True


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/retrojax/jax`` (``~/.cache/retrojax/jax`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retrojax" / "jax"


def enable_compile_cache(directory: str | Path | None = None) -> Path:
    """Turn on JAX's persistent compilation cache in ``directory`` (every program)."""
    path = Path(directory) if directory else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def disable_compile_cache() -> None:
    jax.config.update("jax_enable_compilation_cache", False)


def enable_compile_cache_default() -> Path | None:
    """The CLI's default: the cache on in the user cache dir unless ``RETROJAX_COMPILE_CACHE`` is 0/off
    (or names another directory)."""
    env = os.environ.get("RETROJAX_COMPILE_CACHE", "")
    if env.lower() in ("0", "off", "false", "no"):
        return None
    try:
        return enable_compile_cache(env or None)
    except OSError:  # an unwritable cache dir never stops a run
        return None


def setup(cfg: Any) -> None:
    """Process start-up for a run: distributed init (if asked), then the compile cache as configured.

    ``distributed.compile_cache`` (default on) uses ``distributed.compile_cache_dir``, else the directory
    ``RETROJAX_COMPILE_CACHE`` names, else the user cache. ``RETROJAX_COMPILE_CACHE=0`` turns the default
    off (a run that must compile from nothing: CI, timings); only a config that names its own directory keeps
    it."""
    dc = getattr(cfg, "distributed", None)
    if dc is None:
        return
    initialize(dc)
    env = os.environ.get("RETROJAX_COMPILE_CACHE", "")
    env_off = env.lower() in ("0", "off", "false", "no")
    if dc.compile_cache and (dc.compile_cache_dir or not env_off):
        jax.config.update("jax_enable_compilation_cache", True)
        enable_compile_cache(dc.compile_cache_dir or env or None)
    else:
        disable_compile_cache()


def is_writer() -> bool:
    """Only process 0 writes logs, TensorBoard and exported checkpoints."""
    return jax.process_index() == 0
