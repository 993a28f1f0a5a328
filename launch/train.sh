#!/usr/bin/env bash
# Trainer job: one process per trainer rank, running YOUR training entry point under torchrun.
# The entry point builds its Megatron model and calls WeightSyncCallback after each optimizer step
# (README: "Using it from a Megatron training loop"). Everything after the entry point goes to it.
#
#   NPROC=8 NNODES=4 MASTER_ADDR=node0 launch/train.sh --module my_pkg.train -- --config train.yaml
#   NPROC=8 launch/train.sh path/to/pretrain_gpt.py --config train.yaml --weight-sync-master-address 10.0.0.5
#   NPROC=2 launch/train.sh --config configs/demo_qwen3_moe_ep2.yaml     # default: the demo's trainer
#
# The weight-sync transport group uses weight_sync.backend: "auto" (the default) is NCCL when CUDA is
# available and gloo otherwise. The inference job (launch/serve.sh) meets this one at
# weight_sync.master_address:master_port, which the trainer's first stage hosts.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ENTRY=(-m examples.train_tiny)
if [[ "${1:-}" == "--module" ]]; then
  ENTRY=(-m "$2"); shift 2
elif [[ "${1:-}" == *.py ]]; then
  ENTRY=("$1"); shift
fi
[[ "${1:-}" == "--" ]] && shift
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC:-2}" \
  --node-rank="${NODE_RANK:-0}" --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  "${ENTRY[@]}" "$@"
