#!/usr/bin/env bash
# Inference job: one process per inference rank (weight_sync.num_inference_ranks in all), grouped into
# engines of weight_sync.engine_tp_size ranks, around the engine you name, built from an HF model
# directory (config.json, and optionally its *.safetensors as the starting weights).
#
#   NPROC=2 launch/serve.sh --engine reference --model-dir /models/qwen3-tiny \
#       --config train.yaml --weight-sync-master-address 10.0.0.5
#
# The trainer's layout (its pipeline stages) is adopted at the rendezvous (disk_delta: in its directory
# session), so --trainer-stages is not needed. Settings come from the YAML's weight_sync:
# section, --weight-sync-* flags override them. vLLM runs as its own server: launch/serve_vllm.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC:-2}" \
  --node-rank="${NODE_RANK:-0}" --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29501}" \
  -m megatron_sync.drivers.serve "$@"
