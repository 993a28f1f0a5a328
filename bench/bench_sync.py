"""Benchmark: the pipelined sync against raw broadcasts of the same bytes and a naive baseline.

Per model (small / medium / large, dense Qwen3 and Qwen3-MoE) and bucket size,
in one run and interleaved (see `sync_workers.py`): the sync, the raw
transport of the same buckets, and a naive baseline (gather the whole stage on
one rank, convert, send tensor by tensor). Reports per-phase times, sync ÷ raw,
naive ÷ raw, sync ÷ slowest phase, CPU seconds (all processes; robust to load
from other jobs), peak memory of sender and receivers against their bounds, and
draws the timeline of one sync (bench/timeline.png). Nothing asserts on time.

    python bench/bench_sync.py                                      # = make bench
    python bench/bench_sync.py --models moe-large --bucket-mb 16,64 --reps 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also in spawned workers

from sync_workers import ENGINE_TP, KINDS, engine_main, trainer_main  # noqa: E402
from timeline_plot import draw_timeline  # noqa: E402

from megatron_sync.core.metrics import align  # noqa: E402
from tests.support.dist import free_port, run_distributed  # noqa: E402
from tests.support.models import ModelSpec  # noqa: E402

_MOE = dict(family="qwen3_moe", moe_topk=2)
MODELS = {
    # name: (spec, trainer layout). MoE trainers use EP=2, dense ones TP=2; the engine always TP=2.
    "moe-small": (ModelSpec(**_MOE, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                            ffn_hidden_size=256, vocab_size=2000, num_experts=8, moe_ffn_hidden_size=128),
                  {"ep": 2}),  # 4.6 MB of bf16 weights
    "moe-medium": (ModelSpec(**_MOE, hidden_size=384, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=48,
                             ffn_hidden_size=768, vocab_size=8000, num_experts=16, moe_ffn_hidden_size=256),
                   {"ep": 2}),  # 95 MB
    "moe-large": (ModelSpec(**_MOE, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, head_dim=64,
                            ffn_hidden_size=1024, vocab_size=16000, num_experts=32, moe_ffn_hidden_size=256),
                  {"ep": 2}),  # 354 MB, 1263 tensors
    "dense-small": (ModelSpec(family="qwen3", hidden_size=192, num_layers=4, num_heads=4, num_kv_heads=2,
                              head_dim=48, ffn_hidden_size=512, vocab_size=2000), {"tp": 2}),  # 4.8 MB
    "dense-medium": (ModelSpec(family="qwen3", hidden_size=640, num_layers=8, num_heads=10, num_kv_heads=2,
                               head_dim=64, ffn_hidden_size=1920, vocab_size=8000), {"tp": 2}),  # 95 MB
    "dense-large": (ModelSpec(family="qwen3", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                              head_dim=64, ffn_hidden_size=3072, vocab_size=16000), {"tp": 2}),  # 355 MB
}
MB = 1e6


def run_model(name: str, cfg: dict) -> tuple[list[dict], list[dict]]:
    """Run the trainer and engine jobs concurrently; return (per-trainer-rank, per-engine-rank) results."""
    spec, layout_kw = MODELS[name]
    cfg = {**cfg, "port": free_port()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_distributed, trainer_main, 2, spec, layout_kw, cfg, timeout=cfg["job_timeout_s"])
        engine = pool.submit(run_distributed, engine_main, ENGINE_TP, spec, layout_kw, cfg,
                             timeout=cfg["job_timeout_s"])
        # Whichever fails first is the informative one; the other then times out on the transport.
        done, _ = concurrent.futures.wait([trainer, engine], return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
        return trainer.result(), engine.result()


# ---------------------------------------------------------------- summaries (pure)


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _phases(rows: list[dict]) -> dict[str, float]:
    return {p: _median([r["phases"][p] for r in rows]) for p in rows[0]["phases"]}


def summarize(name: str, mb: float, trainers: list[dict], engines: list[dict]) -> dict:
    """Return one result row (medians over the rounds) for a model and bucket size."""
    source, other = trainers[0][mb], trainers[1][mb]
    recv = [e[mb] for e in engines]
    reps = len(source["rows"]["sync"])

    def wall(kind: str) -> float:  # a measurement ends when its slowest transport rank is done
        return _median([max([source["rows"][kind][i]["wall_s"]] + [e["rows"][kind][i]["wall_s"] for e in recv])
                        for i in range(reps)])

    def cpu(kind: str) -> float:  # CPU seconds of all four processes
        return _median([sum(r["rows"][kind][i]["cpu_s"] for r in (source, other, *recv)) for i in range(reps)])

    def cpu_of(kind: str) -> list[float]:  # per process: trainer 0, trainer 1, engine ranks
        return [_median([r["cpu_s"] for r in side["rows"][kind]]) for side in (source, other, *recv)]

    send = _phases(source["rows"]["sync"])
    engine = {p: statistics.fmean(_phases(e["rows"]["sync"])[p] for e in recv) for p in send}
    engine_work = max(_median([r["phases"]["checksum"] + r["phases"]["apply"] for r in e["rows"]["sync"]])
                      for e in recv)
    rounds = [max([source["rows"]["sync"][i]["wall_s"]] + [e["rows"]["sync"][i]["wall_s"] for e in recv])
              for i in range(reps)]
    out = {"model": name, "bucket_mb": mb, "buckets": source["rows"]["sync"][0]["num_buckets"], "sync_rounds": rounds,
           "nbytes": source["rows"]["sync"][0]["bytes"], "send": send, "engine": engine,
           "other_gather": _median([r["phases"]["gather"] for r in other["rows"]["sync"]]),
           "overlap": _median([r["overlap_s"] for r in source["rows"]["sync"]]),
           **{f"{k}_s": wall(k) for k in KINDS}, **{f"{k}_cpu": cpu(k) for k in KINDS},
           "cpu_by_rank": {k: cpu_of(k) for k in KINDS},
           "info": {**source["info"], **{f"engine_{k}": v for k, v in recv[0]["info"].items()}}}
    out["stages"] = {
        "gather (trainer 0, thread)": send["gather"],
        "convert+pack+checksum (trainer 0)": send["convert"] + send["pack"] + send["checksum"],
        "verify+stage+load (engine)": engine_work,
        "wire (raw run)": out["raw_s"],
    }
    out["memory"] = _memory(source, recv)
    out["median_sync"] = min(range(reps), key=lambda i: abs(source["rows"]["sync"][i]["wall_s"]
                                                             - _median([r["wall_s"] for r in source["rows"]["sync"]])))
    return out


def _memory(source: dict, recv: list[dict]) -> dict:
    def growth(rows):
        return _median([r["rss_growth"] for r in rows])

    return {
        "sender_rss": growth(source["rows"]["sync"]), "sender_gathered": _median(
            [r["gathered_peak"] for r in source["rows"]["sync"]]),
        "sender_device": _median([r["device_growth"] for r in source["rows"]["sync"]]),
        "engine_rss": max(growth(e["rows"]["sync"]) for e in recv),
        "engine_device": max(_median([r["device_growth"] for r in e["rows"]["sync"]]) for e in recv),
        "naive_sender_rss": growth(source["rows"]["naive"]),
        "naive_engine_rss": max(growth(e["rows"]["naive"]) for e in recv),
    }


PHASE_COLUMNS = ("gather", "convert", "pack", "checksum", "transfer", "apply", "commit", "total")


def format_phases(rows: list[dict]) -> str:
    """Per-phase seconds of the sync: trainer 0 (the stage source), trainer 1, engine (mean of its ranks)."""
    header = ["model", "MiB", "n", "role", *PHASE_COLUMNS, "overlap"]
    lines = []
    for r in rows:
        for role, m in (("trainer0", r["send"]), ("engine", r["engine"])):
            lines.append([r["model"], f"{r['bucket_mb']:g}", str(r["buckets"]), role,
                          *(f"{m[p]:.3f}" for p in PHASE_COLUMNS),
                          f"{r['overlap']:.3f}" if role == "trainer0" else "-"])
        lines.append([r["model"], f"{r['bucket_mb']:g}", str(r["buckets"]), "trainer1",
                      f"{r['other_gather']:.3f}", *("-" for _ in PHASE_COLUMNS[1:]), "-"])
    return align(header, lines)


def format_totals(rows: list[dict]) -> str:
    """Sync, raw and naive: wall seconds, ratios to raw, sync ÷ slowest phase, CPU-seconds ratios."""
    header = ["model", "MiB", "n", "MB", "sync_s", "raw_s", "naive_s", "sync/raw", "naive/raw",
              "sync/slowest", "slowest phase", "cpu sync/raw", "cpu naive/raw"]
    lines = []
    for r in rows:
        slowest = max(r["stages"], key=r["stages"].get)
        lines.append([r["model"], f"{r['bucket_mb']:g}", str(r["buckets"]), f"{r['nbytes'] / MB:.1f}",
                      f"{r['sync_s']:.3f}", f"{r['raw_s']:.3f}", f"{r['naive_s']:.3f}",
                      f"{r['sync_s'] / r['raw_s']:.2f}", f"{r['naive_s'] / r['raw_s']:.2f}",
                      f"{r['sync_s'] / r['stages'][slowest]:.2f}", slowest,
                      f"{r['sync_cpu'] / r['raw_cpu']:.2f}", f"{r['naive_cpu'] / r['raw_cpu']:.2f}"])
    return align(header, lines)


def format_cpu(rows: list[dict]) -> str:
    """CPU-seconds per process (all its threads) for sync, raw and naive: where the work goes."""
    header = ["model", "MiB", "kind", "trainer0", "trainer1", "engine0", "engine1", "all"]
    lines = []
    for r in rows:
        for kind in KINDS:
            per = r["cpu_by_rank"][kind]
            lines.append([r["model"], f"{r['bucket_mb']:g}", kind, *(f"{c:.3f}" for c in per), f"{sum(per):.3f}"])
    return align(header, lines)


def format_memory(rows: list[dict]) -> str:
    """Peak memory during a warm sync (growth over the RSS at its start) against the bounds, MB."""
    header = ["model", "MiB", "sender held", "sender peak+", "gathered peak", "bound: budget+largest",
              "engine held", "engine peak+", "bound: bucket+largest", "device", "naive sender peak+",
              "naive engine peak+"]
    lines = []
    for r in rows:
        info, mem = r["info"], r["memory"]
        device = "n/a (CPU)" if mem["sender_device"] != mem["sender_device"] else (
            f"{mem['sender_device'] / MB:.0f}/{mem['engine_device'] / MB:.0f}")
        lines.append([r["model"], f"{r['bucket_mb']:g}", f"{info['replica_bytes'] / MB:.0f}",
                      f"{mem['sender_rss'] / MB:.0f}", f"{mem['sender_gathered'] / MB:.0f}",
                      f"{(info['gather_budget'] + info['largest_gathered']) / MB:.0f}",
                      f"{info['engine_buffer_bytes'] / MB:.0f}", f"{mem['engine_rss'] / MB:.0f}",
                      f"{(info['max_bucket'] + info['largest_tensor']) / MB:.0f}", device,
                      f"{mem['naive_sender_rss'] / MB:.0f}", f"{mem['naive_engine_rss'] / MB:.0f}"])
    return align(header, lines)


def timeline_ranks(trainers: list[dict], engines: list[dict], mb: float, rep: int) -> list:
    """Return [(rank label, events)] of measured sync `rep` at bucket size `mb`."""
    ranks = [("trainer 0", trainers[0][mb]["rows"]["sync"][rep]["timeline"]),
             ("trainer 1", trainers[1][mb]["rows"]["sync"][rep]["timeline"])]
    ranks += [(f"engine {i}", e[mb]["rows"]["sync"][rep]["timeline"]) for i, e in enumerate(engines)]
    return ranks


def machine_description() -> str:
    """Return cores, CPU model, RAM, versions and load average, one per line."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return "\n".join([
        f"nproc (usable cores): {len(os.sched_getaffinity(0))}  (os.cpu_count {os.cpu_count()})",
        f"CPU: {cpu}",
        f"RAM: {mem_kb / 2**20:.1f} GiB",
        f"python {platform.python_version()}, torch {torch.__version__}, {platform.platform()}",
        f"load average (1/5/15 min): {load_average()}",
    ])


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="moe-small,moe-medium,moe-large,dense-small,dense-medium,dense-large",
                        help=f"comma-separated models from {list(MODELS)}")
    parser.add_argument("--bucket-mb", default="4,16,64", help="comma-separated bucket sizes in MiB")
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds (sync, raw, naive) per bucket size")
    parser.add_argument("--gather-budget-mb", type=float, default=64.0,
                        help="trainer gather budget (MiB; default 64: smaller batches pipeline better)")
    parser.add_argument("--checksum", default="auto", help="weight_sync.checksum for the sync (default auto)")
    parser.add_argument("--timeline", default="moe-large", help="model whose fastest bucket size is drawn")
    parser.add_argument("--timeline-png", default=os.path.join(os.path.dirname(__file__), "timeline.png"))
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds one model may take")
    parser.add_argument("--json", default=None, help="also write the result rows here (bench_scale_check.py reads them)")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    try:
        args.bucket_mb = [float(x) for x in args.bucket_mb.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--bucket-mb must be comma-separated numbers, got {args.bucket_mb!r}")
    if not args.bucket_mb or min(args.bucket_mb) <= 0 or args.reps < 1:
        parser.error("--bucket-mb needs positive sizes and --reps >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description())
    print(f"trainer 2 processes (MoE: EP=2, dense: TP=2; 1 stage) -> broadcast over gloo -> 1 engine TP=2; "
          f"bf16; per bucket size 2 warm-up syncs, then {args.reps} rounds of sync / raw / naive (order "
          f"alternating); medians; gather budget {args.gather_budget_mb:g} MiB; checksum {args.checksum}; "
          "1 torch thread per process\n", flush=True)
    cfg = {"bucket_mb": args.bucket_mb, "reps": args.reps, "checksum": args.checksum, "timeout_s": 300.0,
           "gather_budget_bytes": int(args.gather_budget_mb * 2**20), "job_timeout_s": args.timeout}
    rows, drawn = [], None
    for name in args.models:
        start, load_before = time.monotonic(), load_average()
        trainers, engines = run_model(name, cfg)
        model_rows = [summarize(name, mb, trainers, engines) for mb in args.bucket_mb]
        rows.extend(model_rows)
        print(f"{name}: {time.monotonic() - start:.0f}s wall; load average before {load_before}, "
              f"after {load_average()}", flush=True)
        if name == args.timeline:
            best = min(model_rows, key=lambda r: r["sync_s"])
            drawn = (best, timeline_ranks(trainers, engines, best["bucket_mb"], best["median_sync"]))
    print("\nPer phase of the sync (s, medians). trainer0 = the stage source: gather = busy time of its gather"
          "\nthread, transfer = blocked on the wire, overlap = broadcast time hidden behind producing buckets;"
          "\ntrainer1 = the other trainer rank's walk (its sends of experts / TP shards); engine = mean of TP ranks,"
          "\nchecksum = verifying, apply = staging + load. Phases run concurrently, so they add up to more than total.\n")
    print(format_phases(rows))
    print("\nSync against raw transport and the naive baseline (s, medians; a measurement ends when the slowest"
          "\ntransport rank is done). slowest = the slowest pipeline stage (a phase of one rank, or the raw wire);"
          "\ncpu = CPU-seconds of all four processes (all threads), the load-robust comparison.\n")
    print(format_totals(rows))
    print("\nCPU-seconds per process (medians; all threads, gloo's included).\n")
    print(format_cpu(rows))
    print("\nMemory (MB). held = buffers kept between syncs (sender: host replica = the stage's bf16 weights;"
          "\nengine: 2 receive buffers + 2 staging sets of its shards). peak+ = peak RSS during a warm sync minus"
          "\nRSS at its start (transient). gathered peak = the gather tracker's peak. device: GPU peak growth.\n")
    print(format_memory(rows))
    if drawn is not None:
        best, ranks = drawn
        title = (f"{best['model']}, {best['bucket_mb']:g} MiB buckets ({best['buckets']}): one sync, "
                 f"{best['sync_s']:.2f} s (raw {best['raw_s']:.2f} s)")
        draw_timeline(args.timeline_png, ranks, title)
        print(f"\ntimeline of one {best['model']} sync at {best['bucket_mb']:g} MiB: {args.timeline_png}")
    print(f"load average at end: {load_average()}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "command": " ".join(sys.argv),
                       "rows": [{k: v for k, v in r.items() if k not in ("info", "memory")} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
