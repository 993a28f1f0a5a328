"""Benchmark: sync time against the sum of its phases and against raw broadcasts of the same bytes.

Topology per model size: a Megatron trainer with EP=2 (2 gloo processes, one
pipeline stage, so one stage source) and one reference engine with TP=2
(2 processes). Both are separate `run_distributed` jobs, started concurrently,
that meet on a 3-rank broadcast transport group (trainer rank 0 = transport
rank 0, engine ranks = transport ranks 1..2). For each bucket size the same
processes run a warm-up sync, `--syncs` measured syncs, then `--syncs` raw
runs: the very same buckets (the sender's host-replica bytes) broadcast
through the same transport with no gather, convert, checksum, apply or commit.

Prints figures only; nothing asserts on time.

    python bench/bench_sync.py                          # small, medium, large; buckets 1/4/16/64 MiB
    python bench/bench_sync.py --sizes small --bucket-mb 4,16 --syncs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import sys
import time
import warnings

import torch

from tests.support.dist import free_port, run_distributed
from tests.support.models import ModelSpec

SIZES = {
    # ~4.6 MB of bf16 weights (one bucket from 16 MiB up)
    "small": ModelSpec(family="qwen3_moe", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=32, ffn_hidden_size=256, vocab_size=2000, num_experts=8,
                       moe_topk=2, moe_ffn_hidden_size=128),
    # ~95 MB of bf16 weights: 3x wider, twice the layers and experts
    "medium": ModelSpec(family="qwen3_moe", hidden_size=384, num_layers=8, num_heads=8, num_kv_heads=4,
                        head_dim=48, ffn_hidden_size=768, vocab_size=8000, num_experts=16,
                        moe_topk=2, moe_ffn_hidden_size=256),
    # ~354 MB of bf16 weights; about a minute for all bucket sizes on 2 busy cores
    "large": ModelSpec(family="qwen3_moe", hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4,
                       head_dim=64, ffn_hidden_size=1024, vocab_size=16000, num_experts=32,
                       moe_topk=2, moe_ffn_hidden_size=256),
}
TRAINER_EP, ENGINE_TP = 2, 2
NUM_STAGES = 1  # PP=1: trainer rank 0 is the only stage source
TRANSPORT_WORLD = NUM_STAGES + ENGINE_TP
DTYPE = torch.bfloat16  # what the engine computes in; the converter casts to it
GATHER_BUDGET_BYTES = 256 * 2**20  # the library's default gather budget
SHOWN_PHASES = ("gather", "convert", "pack", "transfer", "apply", "commit")  # metrics.PHASES less total


# ---------------------------------------------------------------- worker processes


def _transport(rank: int, cfg: dict):
    from megatron_sync.transport.group import init_transport_group
    from megatron_sync.transport.broadcast import BroadcastTransport

    group = init_transport_group("127.0.0.1", cfg["port"], TRANSPORT_WORLD, rank,
                                 timeout=cfg["timeout_s"], group_name="bench")
    return BroadcastTransport(group, NUM_STAGES)


def _metrics_row(m) -> dict:
    return {"version": m.version, "phases": dict(m.phases), "bytes": m.bytes,
            "overlap_s": m.overlap_s, "num_buckets": m.num_buckets}


def _trainer_main(rank: int, world_size: int, spec: ModelSpec, cfg: dict) -> dict:
    """Build the EP=2 Megatron model, then sync it once per version for every bucket size."""
    warnings.filterwarnings("ignore")  # megatron's "Apex / TE not installed" notes, once per process
    from converters import get_converter
    from megatron_sync.parallel import ParallelLayout
    from megatron_sync.sender import WeightSender
    from megatron_sync.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(ep=TRAINER_EP)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=7), spec)
    layout = ParallelLayout.from_megatron()
    converter = get_converter(spec.family, models.hf_config(spec), dtype=DTYPE)
    stream = MegatronWeightStream(chunks, layout, converter, gather_budget_bytes=GATHER_BUDGET_BYTES)
    transport = _transport(0, cfg) if stream.is_source else None
    results: dict = {}
    try:
        version = 0
        for mb in cfg["bucket_mb"]:
            sender = WeightSender.connect(stream, transport, bucket_size_bytes=int(mb * 2**20))
            version, rows = _measured_syncs(sender.sync, version, cfg)
            raw = []
            if transport is not None:
                raw = [_raw_broadcast_s(transport, sender.plan, sender.replica.data) for _ in range(cfg["syncs"])]
            results[mb] = {"syncs": rows, "raw_s": raw}
    finally:
        if transport is not None:
            transport.close()
    return results if stream.is_source else {}


def _measured_syncs(run_sync, version: int, cfg: dict) -> tuple[int, list]:
    """Run warm-up then measured syncs (`run_sync(version)` returns SyncMetrics); return the
    last version and the measured rows. Sender and engines call it in lockstep."""
    rows = []
    for i in range(cfg["warmup"] + cfg["syncs"]):
        version += 1
        metrics = run_sync(version)
        if i >= cfg["warmup"]:
            rows.append(_metrics_row(metrics))
    return version, rows


def _engine_main(rank: int, world_size: int, spec: ModelSpec, cfg: dict) -> dict:
    """Build one TP rank of the reference engine and receive every version the trainer sends."""
    warnings.filterwarnings("ignore")
    from megatron_sync.engines.reference import ReferenceEngine
    from megatron_sync.receiver import WeightReceiver
    from tests.support import models

    engine = ReferenceEngine(models.hf_config(spec), tp_rank=rank, tp_size=world_size, dtype=DTYPE)
    transport = _transport(NUM_STAGES + rank, cfg)
    results: dict = {}
    try:
        version = 0
        for mb in cfg["bucket_mb"]:
            receiver = WeightReceiver(engine, transport, bucket_size_bytes=int(mb * 2**20))
            version, rows = _measured_syncs(receiver.receive, version, cfg)
            scratch = [transport.alloc(receiver.plan.max_bucket_bytes) for _ in range(2)]
            raw = [_raw_broadcast_s(transport, receiver.plan, None, scratch) for _ in range(cfg["syncs"])]
            results[mb] = {"syncs": rows, "raw_s": raw}
    finally:
        transport.close()
    return results


def _raw_broadcast_s(transport, plan, payload_of, scratch=None) -> float:
    """Return seconds to move the plan's buckets as bare broadcasts (header + payload, no work between).

    The source keeps one bucket in flight, as the sender does; receivers keep
    the next receive posted on a second buffer, as the receiver does.
    """
    from megatron_sync.transport.base import BucketHeader

    buckets = plan.buckets
    transport.agree(None)  # start together
    start = time.perf_counter()
    if transport.is_source:
        for b in buckets:
            transport.send_bucket(BucketHeader(0, b.index, b.nbytes, 0), b, payload_of(b.index)).wait()
    else:
        pending = transport.recv_bucket(buckets[0], scratch[0])
        for k in range(len(buckets)):
            pending.wait()
            if k + 1 < len(buckets):
                pending = transport.recv_bucket(buckets[k + 1], scratch[(k + 1) % 2])
    return time.perf_counter() - start


# ---------------------------------------------------------------- driver


def run_size(spec: ModelSpec, cfg: dict) -> tuple[dict, list[dict]]:
    """Run the trainer and engine jobs concurrently; return (source results, per-engine-rank results)."""
    cfg = {**cfg, "port": free_port()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_distributed, _trainer_main, TRAINER_EP, spec, cfg, timeout=cfg["job_timeout_s"])
        engine = pool.submit(run_distributed, _engine_main, ENGINE_TP, spec, cfg, timeout=cfg["job_timeout_s"])
        # Whichever fails first is the informative one; the other then times out on the transport.
        done, _ = concurrent.futures.wait([trainer, engine], return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
        return trainer.result()[0], engine.result()


def _median(values) -> float:
    return statistics.median(values) if values else 0.0


def _phase_medians(rows: list[dict]) -> dict:
    """Return the median of every phase, of the sum of the non-total phases, and of the overlap."""
    phases = [p for p in rows[0]["phases"] if p != "total"]
    out = {p: _median([r["phases"][p] for r in rows]) for p in (*phases, "total")}
    out["sum"] = _median([sum(r["phases"][p] for p in phases) for r in rows])
    out["overlap"] = _median([r["overlap_s"] for r in rows])
    return out


def summarize(name: str, mb: float, source: dict, engines: list[dict]) -> dict:
    """Return one result row: medians over the measured syncs (engine figures: mean of the TP ranks)."""
    sent = source[mb]["syncs"]
    per_engine = [_phase_medians(e[mb]["syncs"]) for e in engines]
    recv = {k: statistics.fmean(p[k] for p in per_engine) for k in per_engine[0]}
    # A raw run ends when its last rank is done.
    raw = _median([max(rs) for rs in zip(source[mb]["raw_s"], *(e[mb]["raw_s"] for e in engines))])
    return {"model": name, "bucket_mb": mb, "buckets": sent[0]["num_buckets"], "nbytes": sent[0]["bytes"],
            "send": _phase_medians(sent), "recv": recv, "raw_s": raw}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, *rows]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)


def format_phases(rows: list[dict]) -> str:
    """Return the per-phase table: sender (stage source) and engine ranks, seconds."""
    header = ["model", "bucketMiB", "n", "role", *SHOWN_PHASES, "sum", "total", "total-sum", "overlap"]
    lines = []
    for r in rows:
        for role in ("send", "recv"):
            m = r[role]
            lines.append([r["model"], f"{r['bucket_mb']:g}", str(r["buckets"]),
                          "sender" if role == "send" else "engine",
                          *(f"{m.get(p, 0.0):.3f}" for p in SHOWN_PHASES),
                          *(f"{m[k]:.3f}" for k in ("sum", "total")),
                          f"{m['total'] - m['sum']:.3f}", f"{m['overlap']:.3f}" if role == "send" else "-"])
    return _table(header, lines)


def format_totals(rows: list[dict]) -> str:
    """Return the sync-against-raw table: total, sum of phases and raw broadcast time for the same bytes."""
    header = ["model", "bucketMiB", "n", "MB", "total_s", "phase_sum_s", "overlap_s", "GB/s",
              "raw_s", "raw_GB/s", "total/raw"]
    lines = []
    for r in rows:
        s = r["send"]
        lines.append([r["model"], f"{r['bucket_mb']:g}", str(r["buckets"]), f"{r['nbytes'] / 1e6:.1f}",
                      f"{s['total']:.3f}", f"{s['sum']:.3f}", f"{s['overlap']:.3f}",
                      f"{r['nbytes'] / s['total'] / 1e9:.3f}", f"{r['raw_s']:.3f}",
                      f"{r['nbytes'] / r['raw_s'] / 1e9:.3f}", f"{s['total'] / r['raw_s']:.1f}"])
    return _table(header, lines)


def machine_description() -> str:
    """Return cores, CPU model, RAM, torch version and load average, one per line."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        f"nproc (usable cores): {len(os.sched_getaffinity(0))}  (os.cpu_count {os.cpu_count()})",
        f"CPU: {cpu}",
        f"RAM: {mem_kb / 2**20:.1f} GiB",
        f"python {platform.python_version()}, torch {torch.__version__}, {platform.platform()}",
        f"load average (1/5/15 min): {load}",
    ])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,large",
                        help=f"comma-separated model sizes from {sorted(SIZES)} (default: small,medium,large)")
    parser.add_argument("--bucket-mb", default="1,4,16,64",
                        help="comma-separated bucket sizes in MiB (default: 1,4,16,64)")
    parser.add_argument("--syncs", type=int, default=3, help="measured syncs per bucket size (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured syncs first (default: 1)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one model size may take, all bucket sizes together (default: 900)")
    args = parser.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    try:
        args.bucket_mb = [float(x) for x in args.bucket_mb.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--bucket-mb must be comma-separated numbers, got {args.bucket_mb!r}")
    if not args.bucket_mb or min(args.bucket_mb) <= 0:
        parser.error("--bucket-mb needs at least one positive size")
    if args.syncs < 1 or args.warmup < 0:
        parser.error("--syncs must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description())
    print(f"topology: trainer EP={TRAINER_EP} (1 stage) -> broadcast over gloo -> 1 engine TP={ENGINE_TP}; "
          f"{DTYPE}; {args.warmup} warm-up + {args.syncs} measured syncs and {args.syncs} raw runs "
          "per bucket size; medians\n", flush=True)
    cfg = {"bucket_mb": args.bucket_mb, "syncs": args.syncs, "warmup": args.warmup,
           "timeout_s": 120.0, "job_timeout_s": args.timeout}
    rows = []
    for name in args.sizes:
        start = time.monotonic()
        source, engines = run_size(SIZES[name], cfg)
        rows.extend(summarize(name, mb, source, engines) for mb in args.bucket_mb)
        print(f"{name}: {time.monotonic() - start:.0f}s wall (processes, model build, all bucket sizes)", flush=True)
    print("\nPer phase (s, medians; engine = mean of its TP ranks). transfer = time blocked on broadcasts;"
          "\nsum = all phases but total; overlap = broadcast time hidden behind producing the next bucket.\n")
    print(format_phases(rows))
    print("\nSync against raw transport (s, medians). total and phase_sum are the sender's; raw = the same"
          "\nbuckets broadcast with nothing else, until the slowest rank has them; GB/s = bytes / time.\n")
    print(format_totals(rows))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
