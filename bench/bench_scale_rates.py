"""Measure this machine's costs of the sync's own work, per byte and per item; write them for the scale model.

Each rate is CPU-seconds (this process, all threads: gloo's included) per byte or per item, taken
separately from any sync (`make bench` is not involved), the median of --reps rounds, with the
spread of the rounds stored beside it. The real code paths are timed where they exist:

- produce: a stage source's walk of its stream into a host replica (`MegatronWeightStream.walk(into=
  HostReplica.slot)`: the gathers from the other rank, conversion into bucket slots) on two-process
  Megatron models laid out as the bench's trainers (MoE: EP=2, dense: TP=2), per layout two models
  (larger tensors, many small ones) fitted to seconds = a * HF bytes + b * units, and the other rank's
  CPU per byte of the stage (its casts and sends); the models are not the bench's (CALIBRATION);
- xxh3, wsum64, copy, cast: `megatron_sync.core.checksum.checksum` and torch copies of 64 MiB;
- stage + load: what an engine rank does with its slices (`layout.staging.StagingSets.write` through its
  rank layout, `ReferenceEngine.load_shards`), fitted per byte and per tensor;
- wire: a 3-process gloo group over loopback as the bench runs it: a broadcast (CPU per byte on the
  root and on a receiver, wall per byte), point-to-point send/recv (CPU per byte each side), an
  all-gather (CPU per byte received), one agreement round (`Transport.agree` over the group) and the
  latency of a tiny broadcast;
- each P2P backend's writes between two processes (`bench_scale_movers.py`: torch, mooncake, nixl);
- a whole sync of a model of almost no bytes through the bench's own jobs, per transport (broadcast,
  p2p with each backend, ipc, disk_delta): what a sync costs apart from its bytes and tensors.

    PYTHONPATH=. .venv/bin/python bench/bench_scale_rates.py            # writes megatron_sync/scale/rates_local.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale_local import TRANSPORTS as LOCAL_TRANSPORTS, run_point  # noqa: E402
from bench_scale_movers import BACKENDS, measure  # noqa: E402
from bench_sync import _MOE, MODELS, load_average, machine_description  # noqa: E402

from megatron_sync.scale.hardware import RATES_FILE  # noqa: E402
from tests.support.dist import free_port, run_distributed  # noqa: E402

from tests.support.models import ModelSpec  # noqa: E402

MB = 2**20
BIG = 64 * MB

# Models measured here; none is one of bench_sync's, whose syncs the scale model predicts from these rates.
# Per layout of the bench's trainer (MoE: EP=2, dense: TP=2), one model of larger tensors and one of many
# small ones, so seconds split into per byte and per unit.
CALIBRATION = {
    "cal-moe-wide": (ModelSpec(**_MOE, hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
                               ffn_hidden_size=768, vocab_size=6000, num_experts=16, moe_ffn_hidden_size=384),
                     {"ep": 2}),
    "cal-moe-many": (ModelSpec(**_MOE, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32,
                               ffn_hidden_size=256, vocab_size=1000, num_experts=48, moe_ffn_hidden_size=64),
                     {"ep": 2}),
    "cal-dense-wide": (ModelSpec(family="qwen3", hidden_size=896, num_layers=6, num_heads=14, num_kv_heads=2,
                                 head_dim=64, ffn_hidden_size=2560, vocab_size=10000), {"tp": 2}),
    "cal-dense-many": (ModelSpec(family="qwen3", hidden_size=128, num_layers=24, num_heads=4, num_kv_heads=2,
                                 head_dim=32, ffn_hidden_size=256, vocab_size=1000), {"tp": 2}),
}
LAYOUTS = {"ep": ("cal-moe-wide", "cal-moe-many"), "tp": ("cal-dense-wide", "cal-dense-many")}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn) -> tuple[float, float]:
    """Return (CPU seconds, wall seconds) of fn()."""
    c0, w0 = cpu_seconds(), time.perf_counter()
    fn()
    return cpu_seconds() - c0, time.perf_counter() - w0


def fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of seconds = a * bytes + b * items over rows (bytes, items, seconds); a, b >= 0."""
    sxx = sum(b * b for b, _, _ in rows)
    syy = sum(n * n for _, n, _ in rows)
    sxy = sum(b * n for b, n, _ in rows)
    sxt = sum(b * t for b, _, t in rows)
    syt = sum(n * t for _, n, t in rows)
    det = sxx * syy - sxy * sxy
    a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
    if b < 0:  # items cost nothing measurable: bytes alone
        return sxt / sxx, 0.0
    if a < 0:
        return 0.0, syt / syy
    return a, b


# ---------------------------------------------------------------- one process


def primitive_rates() -> dict[str, float]:
    from megatron_sync.core.checksum import checksum

    src32 = torch.randn(BIG // 2)  # casting it to bf16 writes BIG bytes
    src = torch.randn(BIG // 2).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src32)
    raw = src.view(torch.uint8)
    return {"copy_byte": timed(lambda: dst.copy_(src))[0] / BIG,
            "cast_byte": timed(lambda: dst.copy_(src32))[0] / BIG,  # per byte written (bf16)
            "xxh3_byte": timed(lambda: checksum(raw, "xxh3"))[0] / BIG,
            "wsum64_byte": timed(lambda: checksum(raw, "wsum64"))[0] / BIG}


def trainer_walk(rank: int, world: int, cfg: dict) -> dict:
    """One warm walk of a stage's stream into a host replica on rank 0 (gathers from rank 1 included),
    per calibration model of one layout: {model: (HF bytes, units, CPU seconds) of this rank}."""
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.plan.buckets import build_plan
    from megatron_sync.trainer.replica import HostReplica
    from megatron_sync.trainer.stream import MegatronWeightStream
    from megatron_sync.convert import get_converter
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(**cfg["layout"])
    out = {}
    for name in cfg["models"]:
        spec, _ = CALIBRATION[name]
        chunks = models.build_model_chunks(spec)
        converter = get_converter(spec.family, models.hf_config(spec), dtype=torch.bfloat16)
        stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(), converter, gather_budget_bytes=64 * MB)
        plan = build_plan([stream.metadata()] if rank == 0 else [[]], 64 * MB, converter.keep_together)
        replica = HostReplica(plan, 0) if rank == 0 else None

        def walk():
            if replica is not None:
                replica.begin(1)
            for hf_name, tensor in stream.walk(into=replica.slot if replica else None):
                if replica is not None:
                    replica.pack(hf_name, tensor)

        walk()
        torch.distributed.barrier()
        cpu, _ = timed(walk)
        out[name] = (plan.total_bytes, len(stream.units()), cpu)
    return out


def engine_rows(rank: int, world: int, names: list[str]) -> tuple[list, list]:
    """Per model: (shard bytes, tensors, CPU s) of staging this engine rank's slices of every full tensor
    into its staging set (of an engine with TP = world, as the bench runs it), and of loading them."""
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.layout.staging import StagingSets
    from tests.support import models

    stage_rows, load_rows = [], []
    for name in names:
        spec, _ = CALIBRATION[name]
        engine = ReferenceEngine(models.hf_config(spec), tp_rank=rank, tp_size=world, dtype=torch.bfloat16)
        full = {m.name: torch.randn(m.shape).to(m.dtype) for m in engine.expected_tensors()}
        layout = engine.rank_layout()
        staging = StagingSets(layout, lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))

        def stage():
            staging.begin()
            for n, t in full.items():
                staging.write(n, t)

        stage()
        cpu, _ = timed(stage)
        stage_rows.append((layout.shard_bytes, len(full), cpu))
        shards = staging.params()
        engine.load_shards(shards, 1)
        cpu, _ = timed(lambda: engine.load_shards(shards, 2))
        load_rows.append((layout.shard_bytes, len(full), cpu))
    return stage_rows, load_rows


def single_process(rank: int, world: int, cfg: dict) -> dict:
    return primitive_rates()


def engine_ranks(rank: int, world: int, cfg: dict) -> dict:
    stage, load = engine_rows(rank, world, cfg["models"])
    return {"stage": stage, "load": load}


# ---------------------------------------------------------------- three processes over loopback


def wire(rank: int, world: int, cfg: dict) -> dict:
    from megatron_sync.transports.broadcast import BroadcastTransport
    from megatron_sync.session.group import init_transport_group

    group = init_transport_group("127.0.0.1", cfg["port"], world, rank, timeout=120.0, group_name="rates")
    transport = BroadcastTransport(group, 1)
    buf = torch.empty(BIG, dtype=torch.uint8).fill_(rank)
    tiny = torch.zeros(8, dtype=torch.uint8)
    try:
        transport.agree(None, what="warm-up")
        for _ in range(2):
            group.broadcast(buf, src=0)
        out = {}
        transport.agree(None, what="broadcast")
        out["bcast"] = timed(lambda: [group.broadcast(buf, src=0) for _ in range(4)])
        transport.agree(None, what="p2p")

        def p2p():
            for _ in range(4):
                if rank == 1:
                    group.send(buf, 0).wait()
                elif rank == 0:
                    group.recv(buf, 1).wait()

        out["p2p"] = timed(p2p)
        transport.agree(None, what="all-gather")
        out["allgather"] = timed(lambda: [group._all_gather(buf[:BIG // 2]) for _ in range(2)])
        transport.agree(None, what="rounds")
        out["round"] = timed(lambda: [transport.agree(None, what="round") for _ in range(50)])
        out["message"] = timed(lambda: [group.broadcast(tiny, src=0) for _ in range(200)])
        return out
    finally:
        transport.close()


NULL_MODEL = "null (qwen3, 1 layer, 62 KB)"


def null_sync() -> dict:
    """Wall and CPU seconds (all four processes) of a whole sync of a model of almost no bytes, through
    the bench's own jobs (`bench_sync.run_model`: trainer TP=2, broadcast, engine TP=2): what a sync costs
    apart from its bytes and tensors (threads, control, the two agreement rounds)."""
    from bench_sync import run_model, summarize

    MODELS[NULL_MODEL] = (ModelSpec(family="qwen3", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=32, ffn_hidden_size=128, vocab_size=256), {"tp": 2})
    cfg = {"bucket_mb": [64.0], "reps": 5, "checksum": "auto", "timeout_s": 120.0,
           "gather_budget_bytes": 64 * MB, "job_timeout_s": 600}
    trainers, engines = run_model(NULL_MODEL, cfg)
    return summarize(NULL_MODEL, 64.0, trainers, engines)


def null_syncs() -> dict[str, float]:
    """Return per transport of the bench (bench_scale_local.TRANSPORTS but broadcast) the wall seconds of a
    sync of a model of almost no bytes (the median over its measured versions): `sync_fixed_s_<transport>`,
    p2p per backend as `sync_fixed_s_p2p_<backend>`."""
    null = ModelSpec(family="qwen3", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                     ffn_hidden_size=128, vocab_size=256)
    out = {}
    for name in LOCAL_TRANSPORTS:
        if name == "broadcast":
            continue
        row = run_point(null, {"tp": 2}, name, bucket_mb=64.0, versions=5)
        out["sync_fixed_s_" + name.replace("-", "_")] = row["sync_s"]
    return out


def median_spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def one_round(add) -> None:
    """Measure every rate once, passing (key, value) to `add`."""
    for key, value in run_distributed(single_process, 1, {}, timeout=900)[0].items():
        add(key, value)
    for axis, names in LAYOUTS.items():
        source, peer = run_distributed(trainer_walk, 2, {"layout": {axis: 2}, "models": names}, timeout=900)
        per_byte, per_unit = fit([source[n] for n in names])
        add(f"produce_{axis}_byte", per_byte)
        add(f"produce_{axis}_unit", per_unit)
        add(f"peer_{axis}_byte", sum(peer[n][2] for n in names) / sum(source[n][0] for n in names))
    engine = run_distributed(engine_ranks, 2, {"models": list(CALIBRATION)}, timeout=900)[0]
    for phase in ("stage", "load"):
        per_byte, per_tensor = fit(engine[phase])
        add(f"{phase}_byte", per_byte)
        add(f"{phase}_tensor", per_tensor)
    wire_rates(run_distributed(wire, 3, {"port": free_port()}, timeout=600), add)
    fixed = null_sync()
    add("sync_fixed_s", fixed["sync_s"])
    add("sync_fixed_cpu", fixed["sync_cpu"])
    for backend in BACKENDS:
        for key, value in (measure(backend, BIG, 4, run_distributed) or {}).items():
            add(key, value)
    for key, seconds in null_syncs().items():
        add(key, seconds)


def wire_rates(ranks: list[dict], add) -> None:
    """Pass the loopback group's rates (`wire` on three ranks) to `add`."""
    add("bcast_root_byte", ranks[0]["bcast"][0] / (4 * BIG))
    add("bcast_recv_byte", statistics.fmean(r["bcast"][0] for r in ranks[1:]) / (4 * BIG))
    add("bcast_wall_byte", max(r["bcast"][1] for r in ranks) / (4 * BIG))
    add("send_byte", ranks[1]["p2p"][0] / (4 * BIG))
    add("recv_byte", ranks[0]["p2p"][0] / (4 * BIG))
    received = 2 * (len(ranks) - 1) * (BIG // 2)  # two all-gathers of BIG / 2 from each other rank
    add("allgather_byte", statistics.fmean(r["allgather"][0] for r in ranks) / received)
    add("round_s", max(r["round"][1] for r in ranks) / 50)
    add("message_s", max(r["message"][1] for r in ranks) / 200)
    add("bcast_op_root_cpu", ranks[0]["message"][0] / 200)
    add("bcast_op_recv_cpu", statistics.fmean(r["message"][0] for r in ranks[1:]) / 200)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="rounds of every measurement (median kept)")
    parser.add_argument("--out", default=RATES_FILE)
    args = parser.parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description(), flush=True)
    samples: dict[str, list[float]] = {}
    for rep in range(args.reps):
        one_round(lambda key, value: samples.setdefault(key, []).append(value))
        print(f"round {rep + 1}/{args.reps} done; load average {load_average()}", flush=True)
    stats = {k: median_spread(v) for k, v in samples.items()}
    cpu = open("/proc/cpuinfo").read()
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name")), "?")
    record = {"machine": f"{len(os.sched_getaffinity(0))} cores ({model}), {platform.platform()}",
              "date": datetime.date.today().isoformat(), "cores": len(os.sched_getaffinity(0)),
              "load_average_end": load_average(), "torch": torch.__version__, "models": list(CALIBRATION),
              "rates": {k: s["median"] for k, s in stats.items()}, "spread": stats}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    width = max(map(len, stats))
    for key, s in stats.items():
        unit = "ns/B" if key.endswith("_byte") else "us"
        scale = 1e9 if key.endswith("_byte") else 1e6
        print(f"{key:>{width}}  {s['median'] * scale:10.3f} {unit}  (min {s['min'] * scale:.3f}, max "
              f"{s['max'] * scale:.3f}, {s['n']} rounds)")
    print(f"wrote {args.out}")

if __name__ == "__main__":
    main()
