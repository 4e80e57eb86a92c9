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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a test marked ``slow`` are collected first. ``make test`` hands whole files to its two
    workers in collection order (pytest-xdist ``--dist loadfile --no-loadscope-reorder``), so the longest
    files start early and the short ones fill in at the end, instead of one worker finishing a long file
    alone (xdist's own order puts the files with the most tests first, whatever they cost)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each group keeps its order
