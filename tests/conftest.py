"""Shared test setup: tests/ is importable (`from hf_fixtures import make_tiny_hf_checkpoint`)."""

import os
import sys
from pathlib import Path

import pytest

# Tests that run the CLI in-process (and its subprocesses) keep glibc's malloc defaults: the suite is mostly
# compiling, which one shared arena slows (retrojax/host_memory.py); tests/test_host_memory.py checks the
# CLI's setting in processes of its own.
os.environ.setdefault("RETROJAX_MALLOC", "system")

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory: ``tiny_hf_checkpoint(**config_overrides) -> Path`` of a fresh random HF Qwen3 checkpoint."""
    from hf_fixtures import make_tiny_hf_checkpoint

    def make(**overrides):
        return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf"), **overrides)

    return make
