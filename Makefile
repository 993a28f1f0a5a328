# make demo  — set up .venv if needed and run the main job (CPU, no external services)
# make test  — set up .venv if needed and run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo_qwen3_moe_ep2.yaml

.PHONY: setup demo test bench clean

$(BIN)/.installed: requirements-cpu.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-cpu.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python -m megatron_sync.demo --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/bench_sync.py

clean:
	rm -rf $(VENV)
