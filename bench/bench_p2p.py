"""Benchmark: device-direct P2P against the raw writes of the same bytes, and against broadcast, one run.

Topology per point: a Megatron trainer (qwen3 dense, TP=2: 2 gloo processes, one stage; its weights in bf16
as a `--bf16` Megatron job holds them, `--params-dtype float32` for a trainer whose every sync also casts) and
`engines` reference engines of N ranks each, started as separate jobs that meet at the weight-sync rendezvous,
exactly as `tests/support/jobs.py::run_pair` runs them through the unchanged drivers. Per point:
`--versions` syncs with a training step between them; the first is a warm-up. After each measured sync
every trainer rank writes the same messages again from its arena, the wire alone (`P2PSender.replay_last`:
no gather, conversion, staging, checksums, reports or agreement), `--replays` times; that is the raw
transport of the same bytes over the same mover between the same processes. Reported (medians):

- sync s: the slowest trainer rank's `TrainerWeightSync.sync()` (returns after every engine rank
  committed), every trainer rank starting it at a barrier as each replay starts, and its phases; raw s and
  sync / raw (one-sided movers: nixl, mooncake);
- recv MB: bytes each inference rank received at the transport;
- egress / model: the bytes all trainer ranks wrote in one version over the model's bytes; egress / engine:
  over the bytes one engine's ranks received together (engines of one layout form a chain, so 1.00 whatever
  their number; above 1.00 / model where an engine's ranks each hold a replicated tensor, as the reference
  engine holds the vocabulary on every rank; broadcast: not counted).

A point may bound the registered memory on both sides (`nixl:1x2w8`: `p2p.window_mb` and `p2p.arena_mb` of
8 MB, below the 41 MB each rank receives), so each version streams through both in rounds: 8 MB holds one
8 MB piece at a time (one slot: each round waits for the last one's release), 16 MB two (two slots: a round
arrives while the one before is checked and copied out). Such a point has no raw replay (a replay needs the
whole share in the arena); it shows that relays keep egress / model at 1.00.

A point's trainer is TP=2 (`@tp2`, the default: each tensor is all-gathered over gloo before it is converted,
and gloo moves about 350 MB/s per rank on this machine's loopback), or two data-parallel replicas (`@dp2`:
every rank holds every tensor whole, no gather, and the schedule splits the sending between them), which
shows the P2P path's own cost beside the raw writes.

`--staging-sets 1` runs every point with one staging set per inference rank (`weight_sync.staging_sets`): each
version lands in the set the engine's version came from, after the receiver's host copy of it, so there is no
raw replay (it would overwrite that set); compare its syncs with a run of the default two sets.

Machine caveat: 2 + N processes share this machine's cores (2 here): with more processes than cores
every figure is CPU-bound (memcpy, checksums, loopback TCP), not network-bound.

    PYTHONPATH=. python bench/bench_p2p.py                     # the default points
    PYTHONPATH=. python bench/bench_p2p.py --points nixl:1x2,broadcast:1x2 --versions 5
    PYTHONPATH=. python bench/bench_p2p.py --points nixl:1x2 --spec '{"hidden_size": 1024}'
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
    "nixl": {"transport": "p2p", "p2p": {"backend": "nixl"}},
    "nixl-spin": {"transport": "p2p", "p2p": {"backend": "nixl", "nixl_wake_ms": 0}},  # engines' thread spins
    "mooncake": {"transport": "p2p", "p2p": {"backend": "mooncake", "local_hostname": "127.0.0.1"}},
    "torch": {"transport": "p2p", "p2p": {"backend": "torch"}},
}
ONE_SIDED = ("nixl", "nixl-spin", "mooncake")
DEFAULT_POINTS = ("nixl:1x2,mooncake:1x2,torch:1x2,broadcast:1x2,nixl:3x1,broadcast:3x1,nixl:1x2w8,nixl:1x2w16,"
                  "nixl:1x2@dp2,mooncake:1x2@dp2,broadcast:1x2@dp2")
"""transport:ENGINESxTP[wMB][@TRAINER]: one engine of TP=2 per mover and broadcast; three engines of one layout (a
chain); NIXL through windows and arenas of 8 and 16 MB (one and two slots); the trainer as two data-parallel
replicas (no gather). `nixl-spin` is NIXL with the engines' progress thread polling without pause."""
MB = 1e6
TRAINERS = {"tp2": {"tp": 2}, "dp2": {"dp": 2}}
"""The trainer's 2 ranks: TP=2 (each piece's tensor is all-gathered over gloo before it is converted), or two
data-parallel replicas (every rank holds every tensor whole: no gather; the schedule splits the sending)."""


def run_point(transport: str, *, engines: int = 1, engine_tp: int = 1, versions: int = 4, bucket_mb: float = 8.0,
              replays: int = 3, dtype: str = "bfloat16", window_mb: float = 0.0, trainer: str = "tp2",
              staging_sets: int = 2) -> dict:
    """Run one trainer job of 2 ranks (`trainer`: "tp2" or "dp2") and `engines` engines of `engine_tp` ranks
    over `transport` (P2P windows and arenas of `window_mb`, 0: unbounded); return medians."""
    raw = replays if transport in ONE_SIDED and not window_mb and staging_sets == 2 else 0
    settings = dict(TRANSPORTS[transport], staging_sets=staging_sets)
    if window_mb:
        settings["p2p"] = {**settings["p2p"], "window_mb": window_mb, "arena_mb": window_mb}
    case = {"spec": SPEC, "layout": TRAINERS[trainer], "engines": engines, "engine_tp": engine_tp, "versions": versions,
            "receiver_metrics": True, "keep_tensors": False, "timeout_s": 600.0, "raw_replays": raw,
            "aligned_start": True,  # every trainer rank starts each sync at a barrier, as each raw replay does
            "env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"} if transport.startswith("nixl") else {},
            "weight_sync": {"dtype": dtype, "bucket_size_mb": bucket_mb, **settings}}
    start = time.monotonic()
    trainers, _ = run_pair(case, timeout=1800)
    wall = time.monotonic() - start
    syncs = [[json.loads(t["metrics"][v]) for t in trainers] for v in range(versions)]
    received = [[json.loads(m) for m in reports] for reports in trainers[0]["received"]]
    measured = range(1, versions)  # version 1 is the warm-up

    def slowest(v):
        return max(syncs[v], key=lambda m: m["phases_s"]["total"])

    phases = {p: statistics.median(slowest(v)["phases_s"].get(p, 0.0) for v in measured)
              for p in ("gather", "convert", "pack", "checksum", "transfer", "commit", "total")}
    recv = [m["bytes"] for m in sorted(received[-1], key=lambda m: m["rank"])]
    # every rank's replay runs from one barrier to the next: the slowest rank's time is the replay's
    raw_s = statistics.median(max(t["raw_s"][k][r] for t in trainers) for k in range(len(measured))
                              for r in range(raw)) if raw else None
    share = trainers[0].get("share")
    # each measured sync's wall-clock span (first trainer rank's start to last one's end; P2P metrics carry
    # them) and each raw replay's
    spans = {"sync": [[min(m["started_at"] for m in syncs[v]), max(m["ended_at"] for m in syncs[v])]
                      for v in measured if all("started_at" in m for m in syncs[v])],
             "raw": trainers[0].get("raw_spans", [])}
    egress = sum(statistics.median(syncs[v][i]["bytes"] for v in measured) for i in range(len(trainers)))
    return {"transport": transport, "engines": engines, "tp": engine_tp, "window_mb": window_mb, "trainer": trainer,
            "staging_sets": staging_sets,
            "sync_s": phases["total"], "phases": phases,
            "warmup_s": slowest(0)["phases_s"]["total"], "recv": recv, "raw_s": raw_s, "wall": wall, "spans": spans,
            "egress_over_model": egress / MODEL_BYTES if share else None,
            "egress_over_engine": egress / sum(recv[:engine_tp]) if share else None}


def parse_point(point: str) -> dict:
    """Return `run_point`'s transport, engines, engine_tp, window_mb and trainer from a point's text,
    "transport:ENGINESxTP[wMB][@TRAINER]"."""
    transport, sizes = point.split(":")
    sizes, _, trainer = sizes.partition("@")
    sizes, _, window = sizes.partition("w")
    engines, tp = map(int, sizes.split("x"))
    return dict(transport=transport, engines=engines, engine_tp=tp, window_mb=float(window or 0),
                trainer=trainer or "tp2")


MODEL_BYTES = None  # filled from the converter by main(): the HF checkpoint's bytes in the sync dtype


def model_bytes(dtype: str) -> int:
    """Return the bytes of the HF checkpoint the engines receive, in `dtype`."""
    from megatron_sync.convert import get_converter
    from megatron_sync.core.meta import dtype_from_name
    from tests.support import models

    spec = models.ModelSpec(**SPEC)
    converter = get_converter(SPEC["family"], models.hf_config(spec))
    size = dtype_from_name(dtype).itemsize
    return sum(s.numel * size for s in converter.tensor_specs())


def format_rows(rows: list[dict]) -> str:
    header = ["transport", "engines x TP", "sync s", "raw s", "sync/raw", "warm-up s", "gather", "convert", "pack",
              "checksum", "transfer", "commit", "recv MB/rank", "egress/model", "egress/engine"]
    lines = []
    for r in rows:
        p = r["phases"]
        raw = r["raw_s"]
        window = (f" w{r['window_mb']:g}MB" if r["window_mb"] else "") + (
            f" {r['trainer']}" if r["trainer"] != "tp2" else "") + (" s1" if r["staging_sets"] == 1 else "")
        lines.append([r["transport"], f"{r['engines']}x{r['tp']}{window}", f"{r['sync_s']:.3f}",
                      "-" if raw is None else f"{raw:.3f}", "-" if raw is None else f"{r['sync_s'] / raw:.2f}",
                      f"{r['warmup_s']:.3f}", *(f"{p[k]:.3f}" for k in ("gather", "convert", "pack", "checksum",
                                                                          "transfer", "commit")),
                      "/".join(f"{b / MB:.1f}" for b in r["recv"]),
                      "-" if r["egress_over_model"] is None else f"{r['egress_over_model']:.3f}",
                      "-" if r["egress_over_engine"] is None else f"{r['egress_over_engine']:.3f}"])
    return align(header, lines)


def main(argv=None) -> None:
    global MODEL_BYTES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default=DEFAULT_POINTS, help="transport:ENGINESxTP, comma-separated")
    parser.add_argument("--versions", type=int, default=4, help="syncs per point; the first is a warm-up")
    parser.add_argument("--replays", type=int, default=3, help="raw replays of the writes after each measured sync")
    parser.add_argument("--bucket-mb", type=float, default=8.0)
    parser.add_argument("--spec", type=json.loads, default={},
                        help='model fields over the default, JSON (e.g. \'{"hidden_size": 1024}\')')
    parser.add_argument("--staging-sets", type=int, default=2, choices=(1, 2),
                        help="staging sets per inference rank (1: no raw replays)")
    parser.add_argument("--params-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the trainer's Megatron weights (bfloat16: as a --bf16 job holds them; float32: each "
                             "sync also casts them)")
    args = parser.parse_args(argv)
    SPEC.update(params_dtype=args.params_dtype, **args.spec)
    MODEL_BYTES = model_bytes("bfloat16")
    print(machine_description())
    print(f"model: {SPEC} ({MODEL_BYTES / MB:.1f} MB in bf16); trainer of 2 processes, one stage, TP=2 unless "
          f"the point says dp2 (two replicas); bucket "
          f"{args.bucket_mb:g} MB; {args.versions} syncs per point (first = warm-up), medians; raw = "
          f"{args.replays} replays of the same writes after each measured sync")
    rows = []
    for point in args.points.split(","):
        rows.append(run_point(**parse_point(point), versions=args.versions, bucket_mb=args.bucket_mb,
                              replays=args.replays, staging_sets=args.staging_sets))
        r = rows[-1]
        print(f"  {point}: sync {r['sync_s']:.3f}s ({r['wall']:.0f}s wall with start-up)", flush=True)
    print(format_rows(rows))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")


if __name__ == "__main__":
    main()
