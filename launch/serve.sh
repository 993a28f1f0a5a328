#!/usr/bin/env bash
# Inference job: one process per inference rank (weight_sync.num_inference_ranks in all),
# grouped into engines of weight_sync.engine_tp_size ranks each.
#   NPROC=2 launch/serve.sh --config configs/demo_qwen3_moe_ep2.yaml --weight-sync-master-address 10.0.0.5
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
exec python -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29501}" \
  -m megatron_sync.launch.inference "$@"
