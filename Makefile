# The two set-up commands of README.md: `make demo` and `make test`.
# On a CPU machine torch is pinned to the local CPU build; a GPU user picks theirs, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# peers of scripts/gpu_check.sh, installed without their dependencies: torchao's CPU offload
# optimizer and torchtune's OffloadActivations need neither's recipe stack (the dry run in
# `make test` imports them; `make gpu-wheels` carries them to a GPU machine)
GPU_PEERS := torchao==0.17.0 torchtune==0.6.1
# what the GPU machine's image lacks of tensortier's own dependencies
GPU_DEPS := zstandard==0.25.0 lz4==4.4.5 crc32c==2.9.post0
WHEEL_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))

# the TorchRL peer's own venv (benchmarks/replay.py looks there: --cache-dir's default)
TORCHRL_VENV ?= $(HOME)/.cache/tensortier/torchrl-venv

.PHONY: demo test lint bench bench-peers clean gpu-wheels gpu-dry-run

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.torch pyproject.toml Makefile
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(GPU_PEERS)
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tensortier demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q --durations=25 tests

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# benchmarks live outside the installed library: run from the repository root (benchmarks/README.md)
bench: $(VENV)/.installed
	$(PY) -m benchmarks tiers --json benchmarks/results/tiers-cpu.json

# the peers the benchmarks compare against (benchmarks/README.md): RLlib (extra bench-rl) and
# DeepSpeed's CPU Adam (extra bench-optimizer, DS_BUILD_OPS=0: its op JIT-builds) here with
# torch held at its pin (a constraint on the installed version), TorchRL in its own venv with the
# torch its C++ segment tree was built against
bench-peers: $(VENV)/.installed-bench $(TORCHRL_VENV)/.installed

$(VENV)/.installed-bench: $(VENV)/.installed-dev pyproject.toml
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt
	DS_BUILD_OPS=0 $(PIP) install -q -c $(VENV)/torch-pin.txt -e ".[dev,bench-rl,bench-optimizer]"
	touch $@

$(TORCHRL_VENV)/.installed: benchmarks/requirements-torchrl.txt
	$(PYTHON) -m venv --clear $(TORCHRL_VENV)
	$(TORCHRL_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		-r benchmarks/requirements-torchrl.txt
	touch $@

# the cp312 wheels the GPU machine lacks (no registry there): carry .whl with the working tree
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp $(WHEEL_PLATFORMS) -d .whl $(GPU_DEPS) $(GPU_PEERS)
	@du -sh .whl

# every phase of the GPU check at a tiny size on this CPU (also run by `make test`)
gpu-dry-run: $(VENV)/.installed-dev
	PYTHON=$(PY) scripts/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
