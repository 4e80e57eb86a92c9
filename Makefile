# retrojax: `make demo`, `make test` and `make docs` each install what they need into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install reads pyproject.toml, .ci/fixtures.txt and .ci/constraints.txt (the one pinned JAX
# stack inside pyproject.toml's supported range): a change to any of them reinstalls.
INSTALL_INPUTS := pyproject.toml .ci/fixtures.txt .ci/constraints.txt
STAMP := $(VENV)/.installed-$(shell cat $(INSTALL_INPUTS) | cksum | cut -d' ' -f1)
# No bytecode compilation at install time (Python compiles what it imports on first use; torch alone is
# thousands of files the tests never import) and no progress bars. The venv's own pip is recent enough for
# editable installs, so it is not upgraded over the network first.
PIP_INSTALL := $(BIN)/pip install -q --no-compile --progress-bar off
# Test workers (pytest-xdist): whole files go to one worker, so module fixtures are built once; files are
# handed out in collection order, heaviest first (tests/conftest.py HEAVY_FIRST).
TEST_WORKERS ?= 2
TEST_DURATIONS ?= 20
# JAX's persistent compile cache for the test suite lives in the venv, for every process the tests start
# (workers, subprocesses, notebook kernels; JAX reads JAX_COMPILATION_CACHE_DIR itself, and the CLI reads
# RETROJAX_COMPILE_CACHE): a fresh clone starts cold, a rerun of `make test` reuses what the first compiled.
# `make test TEST_COMPILE_CACHE=` runs without it.
TEST_COMPILE_CACHE ?= $(CURDIR)/$(VENV)/jax-cache
# The suite compiles hundreds of small XLA programs and runs each a few times, so compiling is most of its
# time (backend compile 974 s of the suite's 1,155 in-process CPU s, 2026-12-07, 31e31d6, a 2-core x86 CPU).
# Level 0 skips LLVM's optimisation passes (four compile-heavy files 5m24s -> 4m39s, 2026-12-06, a 2-core AMD
# EPYC CPU); the legacy loop emitters instead of XLA:CPU's MLIR fusion emitters compile the same fusions
# about three times faster (`test_model_qwen3.py` + `test_learner_learns.py`: backend compile 45.4 -> 15.3 s,
# 59 -> 30 s user; the whole suite 1,277 -> 947 s user, 2026-12-07, 31e31d6, a 2-core x86 CPU; jaxlib 0.10.2,
# the pinned one, knows the flag). Programs compute the same operations; reductions may sum in another order
# (float32 differences of ~1e-6 relative). `make test TEST_XLA_FLAGS=` runs with XLA's default.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
# Python's bytecode cache stays on for every process a run starts (an environment may set
# PYTHONDONTWRITEBYTECODE): the suite starts dozens of processes (workers, CLI subprocesses, servers, notebook
# kernels), and without cached bytecode each one compiled the source of jax, flax, transformers and retrojax
# again, about 3 s of CPU per process (2.7 s with the cache against 5.4 s without for one import of the stack,
# 2026-12-07, a 2-core x86 CPU).
BYTECODE := PYTHONDONTWRITEBYTECODE=
MKDOCS_BUILD := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -f docs/mkdocs/mkdocs.yml

.PHONY: test demo docs lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	$(PIP_INSTALL) -c .ci/constraints.txt -e '.[test,textworlds,api,docs]'
	$(PIP_INSTALL) --no-deps -r .ci/fixtures.txt
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BYTECODE) $(BIN)/retrojax demo

docs: install
	$(MKDOCS_BUILD)
	@echo "docs: runs/site/index.html"

lint: install
	$(BIN)/ruff check retrojax envs tests

test: install
	$(BIN)/ruff check retrojax envs tests
	$(MKDOCS_BUILD)
	$(BYTECODE) XLA_FLAGS="$(TEST_XLA_FLAGS)" JAX_COMPILATION_CACHE_DIR=$(TEST_COMPILE_CACHE) \
		RETROJAX_COMPILE_CACHE=$(or $(TEST_COMPILE_CACHE),0) \
		$(BIN)/python -m pytest tests -p no:cacheprovider --timeout=900 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=$(TEST_DURATIONS)

clean:
	rm -rf $(VENV) .pytest_cache runs/site
