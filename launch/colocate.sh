#!/usr/bin/env bash
# Colocated job: ONE torchrun job per host holding both roles, NTRAIN trainer ranks and NSERVE inference
# ranks (megatron_sync.drivers.colocate gives each role its own ranks and rendezvous port). The trainer's
# arguments come first, the inference job's after --serve:
#
#   NTRAIN=2 NSERVE=2 launch/colocate.sh --module my_pkg.train -- --config train.yaml \
#       --serve --engine reference --model-dir /models/qwen3 --config train.yaml
#
# With weight_sync.transport: ipc the weights go through shared memory (see the README's "Colocated
# training and inference"). The same two roles can also run as two jobs side by side: launch/train.sh
# and launch/serve.sh on one host, with the same YAML.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NTRAIN="${NTRAIN:-1}"
NSERVE="${NSERVE:-1}"
ENTRY=(--module examples.custom_loop)
if [[ "${1:-}" == "--module" ]]; then
  ENTRY=(--module "$2"); shift 2
elif [[ "${1:-}" == *.py ]]; then
  ENTRY=(--script "$1"); shift
fi
[[ "${1:-}" == "--" ]] && shift
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes="${NNODES:-1}" --nproc-per-node="$((NTRAIN + NSERVE))" \
  --node-rank="${NODE_RANK:-0}" --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  -m megatron_sync.drivers.colocate --trainer-ranks "$NTRAIN" "${ENTRY[@]}" -- "$@"
