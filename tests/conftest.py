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


# The suite's heaviest files (CPU seconds on a fresh clone, 2-core x86 CPU; docs/development.md), heaviest
# first. `make test` hands whole files to its workers in collection order (`--dist loadfile
# --no-loadscope-reorder`), so these start first and no worker finishes the run alone on a long file.
HEAVY_FIRST = (
    "test_bench_quick.py", "test_learn_master_weights.py", "test_tiny_trains.py", "test_notebooks.py",
    "test_bench_realshape.py", "test_parallel_resume.py", "test_demo.py", "test_learn_trainer.py",
    "test_agent_model.py", "test_warm_start.py", "test_learner_learns.py", "test_parallel_multiprocess.py",
    "test_plan.py", "test_sampler_paged.py", "test_learn_layout_exact.py", "test_kernels_forest_attention.py",
    "test_attention_fused.py", "test_rir_baselines.py", "test_sampler.py", "test_textworlds_scienceworld.py",
    "test_model_qwen3.py", "test_serve_openai.py",
)


def pytest_collection_modifyitems(config, items):
    """Heaviest files first (``HEAVY_FIRST``); every other file keeps its place, every test its file order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))
