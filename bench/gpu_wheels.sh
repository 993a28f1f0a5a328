#!/usr/bin/env bash
# Wheels `make gpu-check` needs on a lent CUDA machine that its image lacks, for its Python (3.12, x86-64;
# the image has torch, transformers, xxhash, pytest, pytest-timeout and pytest-xdist, and reaches no index).
# Two folders, each under the 64 MiB a device call may carry with the repository:
#   .whl/base  megatron-core and zstandard: the gpu-marked tests and every device check but NIXL's;
#   .whl/nixl  NIXL for CUDA 13 (the image's CUDA): the device-direct arena check.
# Both are ignored by git; docs/testing.md ("The GPU check") has the two device calls that carry them.
set -euo pipefail
cd "$(dirname "$0")/.."
fetch() {
  local into=$1; shift
  mkdir -p "$into"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$into" "$@"
}
fetch .whl/base megatron-core==0.16.1 zstandard==0.25.0
fetch .whl/nixl nixl-cu13==1.5.1
du -sh .whl/base .whl/nixl
