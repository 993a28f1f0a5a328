#!/usr/bin/env bash
# Start an unmodified SGLang server that megatron-sync's trainer drives over SGLang's own weight-update API.
#   launch/serve_sglang.sh MODEL_DIR --port 30000 --dtype bfloat16 [--tp-size 2] [SGLang args...]
# MODEL_DIR is the HF model directory (config.json + safetensors + tokenizer) of the policy being trained.
# The trainer then drives it: weight_sync.transport: sglang, weight_sync.engines: ["sglang=http://HOST:30000"],
# weight_sync.num_inference_ranks = the server's TP size, weight_sync.dtype = its --dtype.
# PYTHON: the interpreter of SGLang's environment (`make setup` builds .venv-sglang for CPU machines).
set -euo pipefail
MODEL_DIR=${1:?usage: launch/serve_sglang.sh MODEL_DIR [SGLang server args...]}
shift
PYTHON=${PYTHON:-python}

if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sglang") is None)'; then
  echo "serve_sglang.sh: $PYTHON has no sglang; set PYTHON to SGLang's interpreter" \
       "(on CPU: make setup builds .venv-sglang)" >&2
  exit 2
fi

CPU_ARGS=()
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  # No CUDA: SGLang's CPU engine with torch-native attention and no CUDA graphs or overlap thread.
  # Without an `sgl_kernel` built for CPU, SGLang needs the import-only stand-in on PYTHONPATH
  # (tests/support/sglang_shim, with the torchvision schemas its sitecustomize declares).
  export SGLANG_USE_CPU_ENGINE=${SGLANG_USE_CPU_ENGINE:-1}
  CPU_ARGS=(--device cpu --attention-backend torch_native --disable-overlap-schedule --disable-cuda-graph)
fi

exec "$PYTHON" -m sglang.launch_server --model-path "$MODEL_DIR" "${CPU_ARGS[@]}" "$@"
