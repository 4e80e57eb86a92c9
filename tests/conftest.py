"""Shared test setup: tests/ is importable (`from hf_fixtures import make_tiny_hf_checkpoint`)."""

import sys
from pathlib import Path

import pytest

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
