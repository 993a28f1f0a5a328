#!/usr/bin/env bash
# Trainer job: one process per trainer rank. Run it on the training nodes; the
# inference job (launch/serve.sh) runs separately and meets it at
# weight_sync.master_address:master_port (stage 0's source rank hosts that store).
#   NPROC=2 launch/train.sh --config configs/demo_qwen3_moe_ep2.yaml --weight-sync-master-address 10.0.0.5
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
exec python -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  -m megatron_sync.launch.trainer "$@"
