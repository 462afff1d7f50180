# The two set-up commands of README.md: `make demo` and `make test`.
# On a CPU machine torch is pinned to the local CPU build; a GPU user picks theirs, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: demo test lint bench clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[dev]"
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tensortier demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: $(VENV)/.installed
	$(VENV)/bin/tensortier bench tiers --json benchmarks/results/tiers-cpu.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
