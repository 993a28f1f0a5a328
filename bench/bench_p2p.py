"""Benchmark: the P2P transport against broadcast, same model, into 1, 2 and 4 inference ranks, one run.

Topology per point: a Megatron trainer (qwen3 dense, TP=2: 2 gloo processes, one stage) and one
reference engine of N ranks (TP=N; 2 KV heads, replicated at TP=4), started as separate jobs
that meet at the weight-sync rendezvous, exactly as `tests/support/jobs.py::run_pair` runs them
through the unchanged drivers. Per transport ("broadcast"; "p2p" with the torch mover and with
Mooncake over TCP) and N: `--versions` syncs with a training step between them; the first is a
warm-up. Reported per point (medians over the measured syncs):

- sync s: the slowest trainer rank's `TrainerWeightSync.sync()` (returns after every engine
  rank committed), and its phases; recv MB: bytes each inference rank received at the transport;
- wire MB: all bytes received by all inference ranks; host replica MB per trainer rank.

Machine caveat: 2 + N processes share this machine's cores (2 here): with more processes than
cores every figure is CPU-bound (memcpy, checksums, loopback TCP), not network-bound.

    PYTHONPATH=. python bench/bench_p2p.py                     # N = 1, 2, 4; 3 transports
    PYTHONPATH=. python bench/bench_p2p.py --ranks 1,2 --transports broadcast,p2p-torch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.bench_sync import machine_description
from megatron_sync.core.metrics import align
from tests.support.jobs import run_pair

SPEC = dict(family="qwen3", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
            ffn_hidden_size=1536, vocab_size=8192)  # 32.5 M parameters: 65 MB in bf16
TRANSPORTS = {
    "broadcast": {"transport": "broadcast"},
    "p2p-torch": {"transport": "p2p", "p2p_backend": "torch"},
    "p2p-mooncake": {"transport": "p2p", "p2p_backend": "mooncake", "p2p_local_hostname": "127.0.0.1"},
}
MB = 1e6


def run_point(transport: str, *, engines: int = 1, engine_tp: int = 1, versions: int = 4, bucket_mb: float = 8.0,
              dtype: str = "bfloat16") -> dict:
    """Run one trainer job (TP=2) and `engines` engines of `engine_tp` ranks over `transport`; return medians."""
    case = {"spec": SPEC, "layout": {"tp": 2}, "engines": engines, "engine_tp": engine_tp, "versions": versions,
            "receiver_metrics": True, "keep_tensors": False, "timeout_s": 600.0,
            "weight_sync": {"dtype": dtype, "bucket_size_mb": bucket_mb, **TRANSPORTS[transport]}}
    start = time.monotonic()
    trainers, _ = run_pair(case, timeout=1800)
    wall = time.monotonic() - start
    syncs = [[json.loads(t["metrics"][v]) for t in trainers] for v in range(versions)]
    received = [[json.loads(m) for m in reports] for reports in trainers[0]["received"]]
    measured = range(1, versions)  # version 1 is the warm-up

    def slowest(v):
        return max(syncs[v], key=lambda m: m["phases_s"]["total"])

    phases = {p: statistics.median(slowest(v)["phases_s"][p] for v in measured)
              for p in ("gather", "convert", "pack", "transfer", "commit", "total")}
    recv = [m["bytes"] for m in sorted(received[-1], key=lambda m: m["rank"])]
    # broadcast: the stage source holds the whole stage, which is what every inference rank receives
    replica = [t["replica"]["held"] for t in trainers] if "replica" in trainers[0] else [recv[0], 0]
    return {"transport": transport, "ranks": engines * engine_tp, "sync_s": phases["total"], "phases": phases,
            "warmup_s": slowest(0)["phases_s"]["total"], "recv": recv, "wire": sum(recv), "replica": replica,
            "wall": wall}


def format_rows(rows: list[dict]) -> str:
    header = ["transport", "N", "sync s", "warm-up s", "gather", "convert", "pack", "transfer", "commit",
              "recv MB/rank", "wire MB", "replica MB/trainer rank"]
    lines = []
    for r in rows:
        p = r["phases"]
        lines.append([r["transport"], str(r["ranks"]), f"{r['sync_s']:.3f}", f"{r['warmup_s']:.3f}",
                      *(f"{p[k]:.3f}" for k in ("gather", "convert", "pack", "transfer", "commit")),
                      "/".join(f"{b / MB:.1f}" for b in r["recv"]), f"{r['wire'] / MB:.1f}",
                      "/".join(f"{b / MB:.1f}" for b in r["replica"])])
    return align(header, lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4", help="inference ranks (one engine of that TP)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--versions", type=int, default=4, help="syncs per point; the first is a warm-up")
    parser.add_argument("--bucket-mb", type=float, default=8.0)
    args = parser.parse_args(argv)
    print(machine_description())
    print(f"model: {SPEC}; trainer TP=2 (2 processes) -> one reference engine of N ranks; bf16; "
          f"bucket {args.bucket_mb:g} MB; {args.versions} syncs per point (first = warm-up), medians")
    rows = []
    for ranks in map(int, args.ranks.split(",")):
        for transport in args.transports.split(","):
            rows.append(run_point(transport, engine_tp=ranks, versions=args.versions, bucket_mb=args.bucket_mb))
            r = rows[-1]
            print(f"  {transport} N={ranks}: sync {r['sync_s']:.3f}s ({r['wall']:.0f}s wall with start-up)", flush=True)
    print(format_rows(rows))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")


if __name__ == "__main__":
    main()
