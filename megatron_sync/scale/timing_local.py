"""This machine (`local` profile): every phase of every transport is CPU work on shared cores.

Each process's streaming work is CPU-seconds from rates measured on this machine per byte and per item
(`bench/bench_scale_rates.py`, stored in `rates_local.json`); the processes share the cores fairly
(`processor_sharing`: the one that finishes last bounds the streaming phase), or the loopback wire
bounds it; a sync also costs its fixed part, measured whole per transport on a model of almost no
bytes (threads, control messages, agreement rounds, polls).

- broadcast: the stage source walks its stage (gathers + convert), sends every bucket and its header;
  the other trainer rank sends its shards; every engine rank receives every bucket, verifies and
  stages its part; then the load.
- p2p (one model per backend: torch = gloo point-to-point, mooncake, nixl; each over TCP on this host):
  every trainer rank walks its share (all-gathers + convert), copies each piece into its arena,
  checksums it (wsum64 on the CPU) and writes it; every head engine rank receives and verifies its
  shard, forwards it along its chain, and loads it.
- ipc: the stage source walks its stage and copies each bucket into the shared segment; every engine
  rank verifies every bucket (xxh3 over the segment) and copies its regions; then the load.
- disk_delta: `sync()` returns once the stage sources converted their stage into the writer's buffer;
  that is what is predicted here (encoding and the engines' apply run off the training path).
"""

from __future__ import annotations

from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import Phase, SyncOptions
from megatron_sync.scale.summary import PlanSummary

P2P_BACKENDS = ("torch", "mooncake", "nixl")


def processor_sharing(work: dict[str, float], cores: float) -> tuple[float, str]:
    """Return when the last of these processes finishes its CPU work, and which one it is, when `cores`
    cores are shared fairly among the runnable ones (each runs at most one core), all starting together."""
    left = dict(work)
    now = 0.0
    last = max(work, key=work.get) if work else ""
    while left:
        rate = min(1.0, cores / len(left))
        name = min(left, key=left.get)
        now += left[name] / rate
        done = left.pop(name)
        for other in left:
            left[other] -= done
        last = name
    return now, last


def fixed_key(transport: str, options: SyncOptions) -> str:
    """Return the rates-file key of a transport's fixed cost per sync."""
    return {"broadcast": "sync_fixed_s", "p2p": f"sync_fixed_s_p2p_{options.p2p_backend}"}.get(
        transport, f"sync_fixed_s_{transport}")


def required(transport: str, summary_trainer_tp: int, options: SyncOptions) -> list[str]:
    """Return the rates a transport's model reads (`models` refuses a profile that lacks one)."""
    axis = "tp" if summary_trainer_tp > 1 else "ep"
    walk = [f"produce_{axis}_byte", f"produce_{axis}_unit", "load_byte", "load_tensor", fixed_key(transport, options)]
    b = options.p2p_backend
    return walk + {"broadcast": ["bcast_root_byte", "bcast_recv_byte", "bcast_wall_byte", "xxh3_byte",
                                 "stage_byte", "stage_tensor", f"peer_{axis}_byte", "bcast_op_root_cpu",
                                 "bcast_op_recv_cpu", "message_s", "sync_fixed_cpu"],
                   "p2p": ["copy_byte", "wsum64_byte", "allgather_byte", f"send_{b}_byte", f"recv_{b}_byte",
                           f"wall_{b}_byte", f"op_{b}_s"],
                   "ipc": ["copy_byte", "xxh3_byte", "stage_byte", "stage_tensor", f"peer_{axis}_byte"],
                   "disk_delta": [f"peer_{axis}_byte"]}[transport]


def _streaming(work: dict[str, float], profile: HardwareProfile, wire: float, fixed: float, extra: list[Phase]):
    """Return phases, total, bound, CPU-seconds of a sync whose streaming `work` shares the cores."""
    cores = profile.cores.value
    shared, last = processor_sharing(work, cores)
    phases = [Phase("streaming (processes sharing the cores)", shared,
                    f"{last} finishes last; {len(work)} processes on {cores:g} cores"),
              Phase("wire (loopback)", wire, "all bytes"), Phase("fixed", fixed, "a sync of ~0 bytes")] + extra
    bound = (f"CPU: {last}, its work while it shares {cores:g} cores with {len(work) - 1} other processes"
             if shared >= wire else "the loopback wire")
    return phases, fixed + max(shared, wire), bound, sum(work.values())


def _walk(summary: PlanSummary, c: Callable[[str], float], rank: int) -> float:
    """Return a trainer rank's CPU-seconds for its walk (gathers + convert) of what it converts."""
    axis = "tp" if summary.trainer.tp > 1 else "ep"
    traffic = summary.gather.get(rank)
    if traffic is None:
        return 0.0
    return traffic.converted * c(f"produce_{axis}_byte") + traffic.units * c(f"produce_{axis}_unit")


def _peers_send(summary: PlanSummary, work: dict[str, float], source: int, seconds: float) -> None:
    """Add to `work` the stage's other ranks' CPU for sending their shards to `source` (split evenly)."""
    peers = {r for r, t in summary.gather.items() if t.out_intra + t.out_inter and r != source}
    for rank in peers:
        work[f"trainer {rank}"] = work.get(f"trainer {rank}", 0.0) + seconds / len(peers)


def _load(summary: PlanSummary, c: Callable[[str], float], rank: int) -> float:
    return summary.shard_bytes[rank] * c("load_byte") + summary.shard_tensors[rank] * c("load_tensor")


def broadcast_cpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """The stage source's walk and sends, the other rank's sends, every engine rank's receive (module doc)."""
    c = lambda key: profile.cpu[key].value  # noqa: E731
    xxh3 = c("xxh3_byte") if options.checksum else 0.0
    axis = "tp" if summary.trainer.tp > 1 else "ep"
    work: dict[str, float] = {}
    for sender in summary.senders:
        wire = sender.bytes * (c("bcast_root_byte") + xxh3) + 2 * sender.messages * c("bcast_op_root_cpu")
        work[f"trainer {sender.rank}"] = _walk(summary, c, sender.rank) + wire
        _peers_send(summary, work, sender.rank, sender.bytes * c(f"peer_{axis}_byte"))
    receiver = summary.receivers[0]  # every engine rank receives every bucket
    for r, shard in enumerate(summary.shard_bytes):
        work[f"engine {r}"] = (receiver.bytes * (c("bcast_recv_byte") + xxh3) + 2 * receiver.messages
                               * c("bcast_op_recv_cpu") + shard * c("stage_byte") + summary.tensors * c("stage_tensor"))
    ops = 2 * sum(s.messages for s in summary.senders)  # every bucket: payload, then header
    wire_wall = sum(s.bytes for s in summary.senders) * c("bcast_wall_byte") + ops * c("message_s")
    return _with_load(summary, profile, work, wire_wall, c("sync_fixed_s"), c("sync_fixed_cpu"))


def _with_load(summary: PlanSummary, profile: HardwareProfile, work: dict[str, float], wire: float, fixed: float,
               fixed_cpu: float = 0.0):
    """Streaming work, then every engine rank's load (shared cores again)."""
    c = lambda key: profile.cpu[key].value  # noqa: E731
    loads = {f"engine {r}": _load(summary, c, r) for r in range(len(summary.shard_bytes))}
    load, _ = processor_sharing(loads, profile.cores.value)
    phases, total, bound, cpu = _streaming(work, profile, wire, fixed,
                                           [Phase("apply", load, f"{len(loads)} engine ranks")])
    return phases, total + load, bound, cpu + sum(loads.values()) + fixed_cpu


def p2p_cpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Every trainer rank writes its share, every engine rank verifies, forwards and loads (module doc)."""
    c = lambda key: profile.cpu[key].value  # noqa: E731
    b = options.p2p_backend
    wsum = c("wsum64_byte") if options.checksum else 0.0
    totals = summary.extra["p2p"]
    work: dict[str, float] = {}
    for rank, traffic in summary.gather.items():
        sent = totals.balance.load.get(rank, 0)
        gathered = traffic.in_intra + traffic.in_inter
        work[f"trainer {rank}"] = (_walk(summary, c, rank) + gathered * c("allgather_byte")
                                   + sent * (c("copy_byte") + wsum + c(f"send_{b}_byte"))
                                   + totals.sent_items.get(rank, 0) * c(f"op_{b}_s"))
    ranks = summary.fleet.engine_ranks
    for r in summary.receivers:
        forwards = r.rank + ranks < summary.fleet.ranks and totals.chain > 1
        work[f"engine {r.rank}"] = (r.bytes * (c(f"recv_{b}_byte") + wsum)
                                    + (r.bytes * c(f"send_{b}_byte") if forwards else 0.0))
    wire = sum(r.bytes for r in summary.receivers) * c(f"wall_{b}_byte")
    return _with_load(summary, profile, work, wire, c(fixed_key("p2p", options)))


def ipc_cpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """The stage source's walk and copies into the segment, every engine rank's verify and copy (module doc)."""
    c = lambda key: profile.cpu[key].value  # noqa: E731
    xxh3 = c("xxh3_byte") if options.checksum else 0.0
    axis = "tp" if summary.trainer.tp > 1 else "ep"
    work: dict[str, float] = {}
    for sender in summary.senders:
        work[f"trainer {sender.rank}"] = _walk(summary, c, sender.rank) + sender.bytes * (c("copy_byte") + xxh3)
        _peers_send(summary, work, sender.rank, sender.bytes * c(f"peer_{axis}_byte"))
    for r, shard in enumerate(summary.shard_bytes):
        work[f"engine {r}"] = (summary.model_bytes * xxh3 + shard * c("stage_byte")
                               + summary.shard_tensors[r] * c("stage_tensor"))
    return _with_load(summary, profile, work, 0.0, c(fixed_key("ipc", options)))


def disk_delta_cpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """What `sync()` waits for: the stage sources' walks into the writer's buffer (module doc)."""
    c = lambda key: profile.cpu[key].value  # noqa: E731
    axis = "tp" if summary.trainer.tp > 1 else "ep"
    work: dict[str, float] = {}
    for sender in summary.senders:
        work[f"trainer {sender.rank}"] = _walk(summary, c, sender.rank)
        stage = summary.extra["raw_stage_bytes"][summary.sender_stage[sender.rank]]
        _peers_send(summary, work, sender.rank, stage * c(f"peer_{axis}_byte"))
    return _streaming(work, profile, 0.0, c(fixed_key("disk_delta", options)), [])


MODELS: dict[str, Callable] = {"broadcast": broadcast_cpu, "p2p": p2p_cpu, "ipc": ipc_cpu,
                               "disk_delta": disk_delta_cpu}
