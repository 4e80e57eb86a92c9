"""Where a run's persistent compile cache goes (``retrojax.parallel.distributed.setup``):
``distributed.compile_cache`` on by default, ``RETROJAX_COMPILE_CACHE=0`` turns that default off
(``make test`` and timings must compile from nothing, not from the user cache), a directory in the variable or
in the config is used."""

from __future__ import annotations

import jax
import pytest

from retrojax.config import DistributedConfig
from retrojax.parallel.distributed import setup

KEYS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")


class _Run:
    def __init__(self, **dc):
        self.distributed = DistributedConfig(initialize=False, **dc)


@pytest.fixture(autouse=True)
def _restore_jax_config():
    saved = {k: getattr(jax.config, k) for k in KEYS}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)


def _cache() -> tuple[bool, str | None]:
    return jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir


@pytest.mark.parametrize("off", ["0", "off"])
def test_the_variable_turns_the_default_off(monkeypatch, off):
    monkeypatch.setenv("RETROJAX_COMPILE_CACHE", off)
    setup(_Run())
    assert _cache()[0] is False


def test_a_directory_in_the_variable_or_the_config_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv("RETROJAX_COMPILE_CACHE", str(tmp_path / "env"))
    setup(_Run())
    assert _cache() == (True, str(tmp_path / "env"))
    monkeypatch.setenv("RETROJAX_COMPILE_CACHE", "0")
    setup(_Run(compile_cache_dir=str(tmp_path / "cfg")))  # the config's own directory wins
    assert _cache() == (True, str(tmp_path / "cfg"))
    setup(_Run(compile_cache=False))
    assert _cache()[0] is False
