"""The processes of `bench_sync.py`: a Megatron trainer job and a reference-engine job.

Per model, the trainer (2 gloo processes: EP=2 for MoE, TP=2 for dense; one
pipeline stage, so trainer rank 0 is the only stage source) and one engine
with TP=2 (2 processes) are started concurrently and meet on a 3-rank
broadcast transport group (trainer rank 0 = transport rank 0, engine ranks =
transport ranks 1..2). Per bucket size the same processes run two warm-up
syncs, then `reps` rounds of three measurements, interleaved (A/B/C, the order
alternating every round) so that machine load hits all three alike:

- sync: the library's pipelined sync (`WeightSender` / `WeightReceiver`);
- raw: the very same buckets (the sender's host-replica bytes) broadcast
  through the same transport with the same in-flight depth and receive
  buffers, and no gather, convert, checksum, staging, load or commit;
- naive: gather the whole stage on trainer rank 0, convert it all, then
  broadcast tensor by tensor (no buckets, no overlap); engine ranks receive
  each tensor, slice and copy their shard, then load (into a second engine
  instance, so the sync's engine keeps the version its receiver committed).

Every measurement records, per rank: wall seconds, process CPU seconds (all
threads), and the growth of peak RSS over the RSS at its start
(`/proc/self/clear_refs` resets the peak); syncs add their phase times and
timeline events.
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
import warnings
from typing import Callable

import torch

from tests.support.models import ModelSpec

NUM_STAGES = 1  # PP=1: trainer rank 0 is the only stage source
ENGINE_TP = 2
TRANSPORT_WORLD = NUM_STAGES + ENGINE_TP
DTYPE = torch.bfloat16  # what the engine computes in; the converter casts to it
KINDS = ("sync", "raw", "naive")
WARMUP_SYNCS = 2  # the receiver's two staging sets are allocated by the first two syncs


def round_order(rep: int) -> tuple[str, ...]:
    """The order of the three measurements in round `rep` (alternating, so none always goes first)."""
    return KINDS if rep % 2 == 0 else KINDS[::-1]


# ---------------------------------------------------------------- measuring one thing on one rank


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _trim_heap() -> None:
    """Give freed heap memory back to the OS, so RSS at a measurement's start is what is really held
    (glibc keeps large freed blocks, which would hide the next measurement's transient growth)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def measure(fn: Callable[[], dict | None]) -> dict:
    """Run `fn` and return its dict plus wall_s, cpu_s (this process, all threads) and rss_growth
    (peak RSS during the run minus RSS at its start, bytes; None where the peak cannot be reset)."""
    _trim_heap()
    resettable = _reset_peak_rss()
    rss0 = _status_kib("VmRSS")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        device0 = torch.cuda.memory_allocated()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    out = fn() or {}
    wall = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    out.update(wall_s=wall, cpu_s=(usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime),
               rss_growth=(_status_kib("VmHWM") - rss0) * 1024 if resettable else None,
               device_growth=(torch.cuda.max_memory_allocated() - device0) if torch.cuda.is_available() else None)
    return out


def _sync_row(metrics) -> dict:
    return {"phases": dict(metrics.phases), "bytes": metrics.bytes, "overlap_s": metrics.overlap_s,
            "num_buckets": metrics.num_buckets,
            "timeline": metrics.timeline.to_wire()["events"] if metrics.timeline is not None else []}


def _transport(rank: int, cfg: dict):
    from megatron_sync.transports.broadcast import BroadcastTransport
    from megatron_sync.session.group import init_transport_group

    group = init_transport_group("127.0.0.1", cfg["port"], TRANSPORT_WORLD, rank,
                                 timeout=cfg["timeout_s"], group_name="bench")
    return BroadcastTransport(group, NUM_STAGES)


def _quiet() -> None:
    warnings.filterwarnings("ignore")  # megatron's "Apex / TE not installed" notes
    torch.set_num_threads(cfg_threads())


def cfg_threads() -> int:
    """Intra-op threads per process: 1 (four processes share the machine's cores)."""
    return int(os.environ.get("BENCH_TORCH_THREADS", "1"))


# ---------------------------------------------------------------- trainer


def trainer_main(rank: int, world_size: int, spec: ModelSpec, layout_kw: dict, cfg: dict) -> dict:
    """Build the Megatron model, then per bucket size: warm-up, then rounds of sync / raw / naive."""
    _quiet()
    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.transports.buckets.sender import WeightSender
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=7), spec)
    layout = ParallelLayout.from_megatron()
    converter = get_converter(spec.family, models.hf_config(spec), dtype=DTYPE)
    stream = MegatronWeightStream(chunks, layout, converter, gather_budget_bytes=cfg["gather_budget_bytes"])
    transport = _transport(0, cfg) if stream.is_source else None
    results: dict = {}
    try:
        version = 0
        for mb in cfg["bucket_mb"]:
            sender = WeightSender.connect(stream, transport, bucket_size_bytes=int(mb * 2**20), timeline=True,
                                          checksum=cfg["checksum"])
            plan = sender.plan if transport else None
            version, rows = _rounds(cfg, transport, version, sender.sync, {  # warm-up: the replica's pages
                "sync": lambda v: _measured_sync(sender, stream, v),
                "raw": lambda v: measure(lambda: _raw_send(transport, sender) if transport else None),
                "naive": lambda v: measure(lambda: _naive_send(chunks, layout, converter, transport, plan)),
            })
            info = {"gather_budget": stream.gather_budget_bytes, "largest_gathered": stream.tracker.largest_tensor}
            if transport is not None:
                info.update(replica_bytes=sender.replica.nbytes, max_bucket=sender.plan.max_bucket_bytes,
                            largest_tensor=max(e.nbytes for b in sender.plan.buckets for e in b.entries),
                            checksum=sender.checksum)
            results[mb] = {"rows": rows, "info": info}
    finally:
        if transport is not None:
            transport.close()
    return results


def _rounds(cfg: dict, transport, version: int, warm_up: Callable[[int], object],
            run: dict[str, Callable[[int], dict]]) -> tuple[int, dict[str, list[dict]]]:
    """Run WARMUP_SYNCS syncs, then `reps` rounds of every kind (order alternating), each after a barrier;
    return the last version and the rows per kind. Every rank of both jobs calls it in lockstep."""
    for _ in range(WARMUP_SYNCS):
        version += 1
        warm_up(version)
    rows: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for rep in range(cfg["reps"]):
        for kind in round_order(rep):
            _start_together(transport)
            if kind == "sync":
                version += 1
            rows[kind].append(run[kind](version))
    return version, rows


def _start_together(transport) -> None:
    """Barrier of the transport ranks before a measurement (trainer ranks off the transport meet
    their source in its first gather)."""
    if transport is not None:
        transport.agree(None, what="bench start")


def _measured_sync(sender, stream, version: int) -> dict:
    stream.tracker.peak = stream.tracker.live
    row = measure(lambda: _sync_row(sender.sync(version)))
    row["gathered_peak"] = stream.tracker.peak
    return row


def _raw_send(transport, sender) -> None:
    """Broadcast the replica's buckets as they are (header + payload), `max_in_flight` deep."""
    from megatron_sync.transports.base import BucketHeader

    in_flight = []
    for b in sender.plan.buckets:
        if len(in_flight) >= sender.max_in_flight:
            in_flight.pop(0).wait()
        header = BucketHeader(0, b.index, b.nbytes, 0)
        in_flight.append(transport.send_bucket(b, sender.replica.payload(b.index), lambda h=header: h))
    for pending in in_flight:
        pending.wait()


def _naive_send(chunks, layout, converter, transport, plan) -> dict:
    """Gather the whole stage at once, convert all of it, then broadcast tensor by tensor."""
    from megatron_sync.trainer.gather import ShardGatherer, plan_gather_units
    from megatron_sync.trainer.source import walk_model_chunks

    tensors = walk_model_chunks(chunks, layout, is_buffer=converter.is_buffer)
    units = [u for u in plan_gather_units(tensors, layout) if not converter.is_skipped(u.name)]
    gatherer = ShardGatherer(layout, budget_bytes=2**62)  # no bound: the whole stage in one go
    gathered = {u.name: full for u, full in gatherer.gather(units) if full is not None}
    if transport is None:
        return {}
    converted: dict[str, torch.Tensor] = {}
    for name, full in gathered.items():
        converted.update(converter.convert(name, full))
    for meta in plan.tensors():
        transport.group.broadcast(converted[meta.name].reshape(-1).view(torch.uint8), src=0)
    return {}


# ---------------------------------------------------------------- engine


def engine_main(rank: int, world_size: int, spec: ModelSpec, layout_kw: dict, cfg: dict) -> dict:
    """One TP rank of the reference engine: receive every sync, raw run and naive run the trainer makes."""
    _quiet()
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.transports.buckets.receiver import WeightReceiver
    from tests.support import models

    engine = ReferenceEngine(models.hf_config(spec), tp_rank=rank, tp_size=world_size, dtype=DTYPE)
    naive_engine = ReferenceEngine(models.hf_config(spec), tp_rank=rank, tp_size=world_size, dtype=DTYPE)
    transport = _transport(NUM_STAGES + rank, cfg)
    results: dict = {}
    try:
        version = 0
        for mb in cfg["bucket_mb"]:
            receiver = WeightReceiver(engine, transport, bucket_size_bytes=int(mb * 2**20), timeline=True,
                                      checksum=cfg["checksum"])
            scratch = [transport.alloc(receiver.plan.max_bucket_bytes) for _ in range(2)]
            # warm-up: allocates both staging sets (and takes the receiver's one snapshot)
            version, rows = _rounds(cfg, transport, version, receiver.receive, {
                "sync": lambda v: measure(lambda: _sync_row(receiver.receive(v))),
                "raw": lambda v: measure(lambda: _raw_receive(transport, receiver.plan, scratch)),
                "naive": lambda v: measure(lambda: _naive_receive(transport, receiver.plan, naive_engine, v)),
            })
            results[mb] = {"rows": rows, "info": {"buffer_bytes": receiver.buffer_bytes,
                                                  "receive_buffers": 2 * receiver.plan.max_bucket_bytes,
                                                  "staging_bytes": receiver.staging.nbytes,
                                                  "snapshots_taken": receiver.snapshots_taken}}
    finally:
        transport.close()
    return results


def _raw_receive(transport, plan, scratch) -> None:
    """Receive the plan's buckets with the next receive posted on the other buffer, as the receiver does."""
    buckets = plan.buckets
    pending = transport.recv_bucket(buckets[0], scratch[0])
    for k in range(len(buckets)):
        pending.wait()
        if k + 1 < len(buckets):
            pending = transport.recv_bucket(buckets[k + 1], scratch[(k + 1) % 2])


def _naive_receive(transport, plan, engine, version: int) -> None:
    """Receive tensor by tensor, keep a copy of this rank's regions of each, then load them all."""
    layout = engine.rank_layout()
    staging = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for meta in plan.tensors():
        buf = torch.empty(meta.nbytes, dtype=torch.uint8)
        transport.group.broadcast(buf, src=0)
        layout.write(staging, meta.name, buf.view(meta.dtype).view(meta.shape))
    engine.load_shards(layout.param_views(staging), version)
