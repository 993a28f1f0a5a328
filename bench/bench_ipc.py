"""Benchmark: colocated `ipc` against `broadcast` over loopback, same model and layout, one run, with the handoff.

Topology per transport: a Megatron trainer (qwen3 dense, TP=2: 2 gloo processes, one stage) and one
reference engine of TP=2, on this host, started as separate jobs that meet at the weight-sync
rendezvous (`tests/support/jobs.py::run_pair`, the unchanged drivers), taking colocated turns
(`handoff`): before each training step the engines free their live weights and the trainer takes back
its gradient buffers; after it the trainer frees them and the sync begins, the engines allocating
their weights again as it starts. `--versions` syncs (the first, before any turn, is a warm-up), then
one more turn without a sync (the engines reload the version they hold). Reported, medians over the
measured syncs:

- the trainer's sync (its slowest rank: gather, convert, pack, checksum, transfer, commit, total);
- the engine ranks' receive (transfer = waiting for buckets, checksum, apply = copying their regions
  into the staging set and loading, commit) and the bytes each moved per medium (ipc: shared memory /
  control bytes on the store's socket; broadcast: the whole payload over loopback TCP);
- the handoff: engines' release, their restore at a sync (allocation only) and without one (allocation
  + copy of the live version back), the trainer's release and restore of its gradient buffers.

Machine caveat: 4 processes share this machine's cores (2 here) with other users' jobs: every figure is
CPU-bound and noisy; compare the two transports row by row, as measured in the same run.

    PYTHONPATH=. python bench/bench_ipc.py                    # ipc and broadcast, 5 syncs each
    PYTHONPATH=. python bench/bench_ipc.py --versions 3 --bucket-mb 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.bench_sync import machine_description
from megatron_sync.core.metrics import align
from tests.support.jobs import run_pair

SPEC = dict(family="qwen3", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
            ffn_hidden_size=1536, vocab_size=8192)  # 32.5 M parameters: 65 MB in bf16
MB = 1e6
SENDER_PHASES = ("gather", "convert", "pack", "checksum", "transfer", "commit", "total")
RECEIVER_PHASES = ("transfer", "checksum", "apply", "commit", "total")


def run_point(transport: str, *, versions: int, bucket_mb: float) -> dict:
    """Run the trainer (TP=2) and one engine (TP=2) over `transport`, taking turns; return medians."""
    case = {"spec": SPEC, "layout": {"tp": 2}, "engines": 1, "engine_tp": 2, "versions": versions, "handoff": True,
            "receiver_metrics": True, "keep_tensors": False, "timeout_s": 600.0,
            "weight_sync": {"dtype": "bfloat16", "bucket_size_mb": bucket_mb, "transport": transport}}
    start = time.monotonic()
    trainers, _ = run_pair(case, timeout=1800)
    wall = time.monotonic() - start
    measured = range(1, versions)  # version 1 is the warm-up, before any turn
    syncs = [[json.loads(t["metrics"][v]) for t in trainers] for v in range(versions)]
    sender = [max(syncs[v], key=lambda m: m["phases_s"]["total"]) for v in measured]
    receivers = [[json.loads(m) for m in trainers[0]["received"][v]] for v in measured]
    rows = [[json.loads(r) for side in ("to_training", "to_generation") for r in turn[side]]
            for turn in trainers[0]["handoffs"]]

    def median(values):
        values = list(values)
        return statistics.median(values) if values else 0.0

    def handoff(role: str, phase: str, turns) -> float:
        """Median over turns of the slowest rank's seconds of `phase` (ranks of `role` work in parallel)."""
        return median(max((r["phases_s"][phase] for r in turn if r["role"] == role), default=0.0) for turn in turns)

    synced, last = rows[:-1], rows[-1:]  # the last turn restores the engines without a sync
    engine = receivers[-1][0]
    return {
        "transport": transport, "wall": wall,
        "sender": {p: median(m["phases_s"][p] for m in sender) for p in SENDER_PHASES},
        "receiver": {p: median(max(r["phases_s"][p] for r in rs) for rs in receivers) for p in RECEIVER_PHASES},
        "bytes": engine["bytes"], "copied": engine["copied_bytes"], "shard": engine["shard_bytes"],
        "media": engine.get("media_bytes", {}), "held": engine["held_bytes"],
        "handoff": {
            "engines release": handoff("engine-handoff", "release", rows),
            "engines restore at sync": handoff("engine-handoff", "restore", synced),
            "engines restore, no sync": handoff("engine-handoff", "restore", last),
            "trainer release": handoff("trainer-handoff", "release", rows),
            "trainer restore": handoff("trainer-handoff", "restore", rows[1:]),
        },
        "handoff_bytes": {
            "engine": max(r["bytes"] for r in rows[0] if r["role"] == "engine-handoff"),
            "trainer": max(r["bytes"] for turn in rows for r in turn if r["role"] == "trainer-handoff"),
        },
    }


def format_rows(points: list[dict]) -> str:
    """Three tables: the trainer's sync, the engines' receive and bytes, the handoff."""
    sync = align(["transport", *SENDER_PHASES],
                 [[p["transport"], *(f"{p['sender'][k]:.4f}" for k in SENDER_PHASES)] for p in points])
    recv = align(["transport", *RECEIVER_PHASES, "MB in", "MB copied", "shard MB", "held MB", "media (bytes)"],
                 [[p["transport"], *(f"{p['receiver'][k]:.4f}" for k in RECEIVER_PHASES), f"{p['bytes'] / MB:.2f}",
                   f"{p['copied'] / MB:.2f}", f"{p['shard'] / MB:.2f}", f"{p['held'] / MB:.2f}",
                   " ".join(f"{k}={v}" for k, v in p["media"].items()) or "-"] for p in points])
    keys = list(points[0]["handoff"])
    hand = align(["transport", *keys, "engine MB", "trainer MB"],
                 [[p["transport"], *(f"{p['handoff'][k]:.4f}" for k in keys),
                   f"{p['handoff_bytes']['engine'] / MB:.2f}", f"{p['handoff_bytes']['trainer'] / MB:.2f}"]
                  for p in points])
    return (f"trainer sync (slowest rank), seconds:\n{sync}\n\nengine ranks' receive (slowest rank), seconds; "
            f"bytes of one engine rank:\n{recv}\n\nhandoff, seconds (slowest rank of each side):\n{hand}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="ipc,broadcast")
    parser.add_argument("--versions", type=int, default=5, help="syncs per transport; the first is a warm-up")
    parser.add_argument("--bucket-mb", type=float, default=8.0)
    args = parser.parse_args(argv)
    print(machine_description())
    print(f"model: {SPEC}; trainer TP=2 (2 processes) -> one reference engine of TP=2 on the same host; bf16; "
          f"bucket {args.bucket_mb:g} MB; {args.versions} syncs per transport (first = warm-up), medians")
    points = []
    for transport in args.transports.split(","):
        points.append(run_point(transport, versions=args.versions, bucket_mb=args.bucket_mb))
        print(f"  {transport}: sync {points[-1]['sender']['total']:.3f}s ({points[-1]['wall']:.0f}s wall with "
              "start-up)", flush=True)
    print(format_rows(points))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
