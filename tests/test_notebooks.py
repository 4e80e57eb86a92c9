"""The notebooks under notebooks/ run top to bottom without an error, in this interpreter's environment.

The kernels run with ``RETROJAX_NOTEBOOK_QUICK=1``: a notebook that reads it runs every cell's code on smaller
counts (03: fewer levels), as its text says."""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "00_quickstart.ipynb", "01_environments_and_rewind.ipynb", "02_trials_and_advantages.ipynb",
        "03_ablations.ipynb", "04_rir.ipynb"]


def _kernel_manager() -> KernelManager:
    """A kernel running this very interpreter (the venv's python), whatever ``python`` is on PATH."""
    km = KernelManager(kernel_name="python3")
    assert km.format_kernel_cmd()[0] == sys.executable, km.format_kernel_cmd()
    return km


@pytest.fixture(scope="module")
def kernel_bytecode(tmp_path_factory) -> Path | None:
    """One bytecode folder for every kernel of this file where the environment writes none
    (PYTHONDONTWRITEBYTECODE; `make install` compiles none either): each kernel would otherwise compile the
    source of every module it imports (jax, flax, retrojax: about 3.5 s CPU a kernel on a 2-core CPU). The
    first kernel writes it, the others read it; None where Python writes its __pycache__ as usual."""
    return tmp_path_factory.mktemp("pycache") if os.environ.get("PYTHONDONTWRITEBYTECODE") else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, kernel_bytecode, monkeypatch):
    monkeypatch.setenv("RETROJAX_NOTEBOOK_QUICK", "1")
    if kernel_bytecode is not None:  # the kernel inherits this process's environment
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
        monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(kernel_bytecode))
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks clean"
    km = _kernel_manager()
    client = NotebookClient(nb, timeout=300, km=km, resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:  # a client given its kernel manager leaves the kernel running: stop it (memory, threads)
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert sum(bool(c.outputs) for c in nb.cells if c.cell_type == "code") >= 3
