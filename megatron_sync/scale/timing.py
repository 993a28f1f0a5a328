"""The time model: a transport's plan summary and a hardware profile in, predicted seconds per phase out.

Each transport is modelled with the pipelining its code really does (the module docstrings of
`sender.py`, `receiver.py`, `p2p/endpoints.py`, `p2p/execute.py`, `delta/`):

- broadcast: per stage, the source's gather thread, its conversion into bucket slots (and on GPUs the
  host copy on a side stream) and the checksum overlap each other and the wire; stages go on the wire
  in stage order, each as soon as the previous stage's buckets went out and its own are ready. Every
  inference rank receives every bucket, verifies and stages it while the next arrives; the load
  follows the last bucket; then the two agreement rounds.
- p2p: every trainer rank gathers and converts its share into host memory (one walk, in turn), then
  sends its messages one after another (pack, xxh3 per range, write); receivers verify after all
  arrived; load; two rounds. NICs are shared per node.
- disk_delta: stage sources hand the stage to the writer, which encodes and writes the delta; one
  applier per inference host reads, decodes into its local copy and verifies; every rank loads; three
  rounds through files (one poll interval each).
- ipc (colocated at scale, a design the built single-host `transport: ipc` does not implement): the P2P assignment, kept in device memory; slices move device to device
  (NVLink on a node, the NIC across nodes); no host copy, no checksum.

On a `cpu_bound` profile (this machine) every phase is CPU work with measured seconds per byte and per
item, the loopback wire included; several processes share the cores, so the sync takes at least the
CPU-seconds of its streaming phases divided by the cores, and the model reports that bound too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.summary import PlanSummary

DELTA_POLL_S = 0.05  # disk_delta: one poll interval per control message and agreement round (README)


@dataclass(frozen=True)
class Phase:
    """Seconds one phase takes on the endpoint where it is longest."""

    name: str
    seconds: float
    where: str


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one sync, the phases behind it, and what bounds it."""

    transport: str
    profile: str
    seconds: float
    bound: str  # the phase (and where) that sets the time
    phases: tuple[Phase, ...]
    physical_bound: float  # the largest shard any inference rank needs / its NIC (its input link)
    cpu_seconds: float | None = None  # cpu_bound profiles: CPU-seconds of all processes
    notes: tuple[str, ...] = field(default_factory=tuple)

    def phase(self, name: str) -> float:
        return max((p.seconds for p in self.phases if p.name == name), default=0.0)


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Settings the prediction depends on besides the plan: the checksum, and the encoder's threads."""

    checksum: bool = True
    delta_threads: int = 2
    pause_resume: bool = True  # driven engines pause and resume around the sync


def models(transport: str, profile: HardwareProfile) -> bool:
    """Return True if the time model covers `transport` on `profile` (this machine: what `make bench` runs)."""
    return (transport, profile.cpu_bound) in _MODELS


def physical_bound(summary: PlanSummary, profile: HardwareProfile) -> float:
    """Return the largest shard any inference rank must receive divided by its input link (its NIC; on
    the CPU machine, the measured loopback rate)."""
    largest = max(summary.shard_bytes, default=0)
    if profile.cpu_bound:
        return largest * profile.cpu["bcast_wall_byte"].value
    return largest / profile.nic_per_gpu


def predict(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions = SyncOptions()) -> Prediction:
    """Return the predicted time of the sync `summary` plans on `profile`."""
    model = _MODELS[(summary.transport, profile.cpu_bound)]
    phases, total, bound, cpu = model(summary, profile, options)
    notes = (("colocated ipc at scale is a design (per-rank slices in device memory), not the built single-host "
              "transport: ipc; this is what its plan would take",) if summary.transport == "ipc" else ())
    return Prediction(summary.transport, profile.name, total, bound, tuple(phases), physical_bound(summary, profile),
                      cpu, notes)


def _gather_seconds(traffic, profile: HardwareProfile) -> float:
    if traffic is None:
        return 0.0
    links = max(traffic.in_intra / profile.nvlink.value, traffic.in_inter / profile.nic_per_gpu,
                traffic.out_intra / profile.nvlink.value, traffic.out_inter / profile.nic_per_gpu)
    return links + traffic.units * profile.message_s.value


def _tail(summary: PlanSummary, profile: HardwareProfile, rounds: int, options: SyncOptions) -> list[Phase]:
    """The load of the largest shard and the agreement rounds (and pause + resume of driven engines)."""
    rank = max(range(len(summary.shard_bytes)), key=summary.shard_bytes.__getitem__, default=0)
    apply = (summary.shard_bytes[rank] / profile.device_copy
             + summary.shard_tensors[rank] * profile.apply_tensor_s.value) if summary.shard_bytes else 0.0
    phases = [Phase("apply", apply, f"inference rank {rank}"),
              Phase("commit", rounds * profile.round_s.value, f"{rounds} agreement rounds")]
    if options.pause_resume:
        phases.append(Phase("pause+resume", profile.pause_resume_s.value, "engines"))
    return phases


def _bound_of(phases: list[Phase], streaming: set[str]) -> str:
    top = max((p for p in phases if p.name in streaming), key=lambda p: p.seconds)
    return f"{top.name} ({top.where})"


# ---------------------------------------------------------------- GPU clusters


def _broadcast_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Stages on the wire in order, each source funnelling its stage through its own NIC.

    Stage s goes on the wire once stage s-1's buckets went out and its own first bucket is ready, and
    ends no earlier than its production plus its last bucket: the critical path is the chain of wires
    unless some stage's production (its gather, mostly) is longer than the wires before it.
    """
    wire_rate = profile.nic_per_gpu  # the root is its node's only group member: one NIC (see hardware)
    device_checksum = profile.hbm.value / 2 if options.checksum else math.inf
    worst: dict[str, Phase] = {}
    wire_end, wires = 0.0, 0.0
    for sender in sorted(summary.senders, key=lambda s: summary.sender_stage[s.rank]):
        where = f"stage {summary.sender_stage[sender.rank]} source"
        traffic = summary.gather.get(sender.rank)
        produce = {"gather": _gather_seconds(traffic, profile),
                   "convert": (traffic.converted if traffic else sender.bytes) / profile.device_copy,
                   "host copy": sender.bytes / profile.pcie.value,
                   "checksum": sender.bytes / device_checksum}
        for name, seconds in produce.items():
            if name not in worst or seconds > worst[name].seconds:
                worst[name] = Phase(name, seconds, where)
        ready = max(produce.values())
        wire = sender.bytes / wire_rate + sender.messages * profile.message_s.value * math.log2(
            max(2, sender.peers + 1))
        wires += wire
        first = ready * min(1.0, summary.bucket_bytes / max(sender.bytes, 1))
        wire_end = max(max(wire_end, first) + wire, ready + wire / max(sender.messages, 1))
    receiver = summary.receivers[0]  # every inference rank receives every bucket
    shard = max(summary.shard_bytes)
    phases = list(worst.values()) + [
        Phase("wire", wires, f"{len(summary.senders)} stage sources in stage order, one NIC each, every byte to every "
                             "inference rank"),
        Phase("verify+stage", receiver.bytes / device_checksum + shard / profile.device_copy, "every inference rank")]
    last_bucket = summary.extra["max_bucket"] / device_checksum + shard / max(1, receiver.messages) / profile.device_copy
    tail = _tail(summary, profile, 2, options)
    total = wire_end + last_bucket + sum(p.seconds for p in tail)
    slowest = max(worst.values(), key=lambda p: p.seconds)
    bound = (f"wire ({wires:.1f} s: {phases[-2].where})" if wires >= wire_end - wires else
             f"{slowest.name} ({slowest.where}): production outlasts the wires")
    return phases + tail, total, bound, None


def _p2p_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Every rank refreshes its host share, then writes its messages in turn; NICs shared per node."""
    xxh3 = profile.host_xxh3.value if options.checksum else math.inf
    phases, finish = [], []
    for s in summary.senders:
        traffic = summary.gather.get(s.rank)
        converted = traffic.converted if traffic else 0
        refresh = _gather_seconds(traffic, profile) + converted / profile.device_copy + converted / profile.pcie.value
        send = (s.bytes / profile.host_copy.value + s.bytes / xxh3 + s.bytes / min(profile.nic_per_gpu,
                profile.pcie.value) + s.messages * profile.message_s.value)
        finish.append((refresh + send, s.rank, refresh, send))
    total_send, rank, refresh, send = max(finish)
    phases += [Phase("refresh (gather+convert+host copy)", refresh, f"trainer rank {rank}"),
               Phase("send (pack+xxh3+write)", send, f"trainer rank {rank}")]
    egress, ingress = _node_loads(summary)
    if egress:
        node, nbytes = max(egress.items(), key=lambda kv: kv[1])
        phases.append(Phase("node NICs out", nbytes / profile.node_nic, f"trainer node {node}"))
    if ingress:
        node, nbytes = max(ingress.items(), key=lambda kv: kv[1])
        phases.append(Phase("node NICs in", nbytes / profile.node_nic, f"inference node {node}"))
    receiver = max(summary.receivers, key=lambda r: r.bytes)
    recv = receiver.bytes / profile.nic_per_gpu
    verify = receiver.bytes / profile.pcie.value + receiver.bytes / xxh3 + receiver.tensors * 2e-6
    phases += [Phase("receive", recv, f"inference rank {receiver.rank}"),
               Phase("verify", verify, f"inference rank {receiver.rank}")]
    network = max(p.seconds for p in phases if p.name in ("node NICs out", "node NICs in", "receive"))
    tail = _tail(summary, profile, 2, options)
    total = max(total_send, network) + verify + sum(p.seconds for p in tail)
    streaming = {"refresh (gather+convert+host copy)", "send (pack+xxh3+write)", "node NICs out", "node NICs in",
                 "receive", "verify"}
    return phases + tail, total, _bound_of(phases, streaming), None


def _node_loads(summary: PlanSummary) -> tuple[dict[int, int], dict[int, int]]:
    """Return bytes out per trainer node and in per inference node (a colocated plan's local bytes excluded)."""
    egress: dict[int, int] = {}
    ingress: dict[int, int] = {}
    share = 1 - summary.extra.get("local_bytes", 0) / max(1, sum(s.bytes for s in summary.senders))
    for s in summary.senders:
        egress[s.node] = egress.get(s.node, 0) + int(s.bytes * share)
    for r in summary.receivers:
        ingress[r.node] = ingress.get(r.node, 0) + int(r.bytes * share)
    return egress, ingress


def _ipc_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Device-resident shares; local slices over NVLink/IPC, remote ones over the NIC; no host, no checksum."""
    phases = []
    refresh = max((_gather_seconds(summary.gather.get(s.rank), profile)
                   + (summary.gather[s.rank].converted if s.rank in summary.gather else 0) / profile.device_copy,
                   s.rank) for s in summary.senders)
    phases.append(Phase("refresh (gather+convert)", refresh[0], f"trainer rank {refresh[1]}"))
    local = summary.extra.get("local_bytes", 0) / max(1, sum(r.bytes for r in summary.receivers))
    receiver = max(summary.receivers, key=lambda r: r.bytes)
    phases.append(Phase("IPC copies", receiver.bytes * local / profile.nvlink.value, f"inference rank {receiver.rank}"))
    phases.append(Phase("receive (remote)", receiver.bytes * (1 - local) / profile.nic_per_gpu,
                        f"inference rank {receiver.rank}"))
    tail = _tail(summary, profile, 2, options)
    total = refresh[0] + max(phases[1].seconds, phases[2].seconds) + sum(p.seconds for p in tail)
    return phases + tail, total, _bound_of(phases, {p.name for p in phases}), None


def _disk_delta_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Writer per stage source, one applier per inference host, storage shared per node."""
    raw = summary.extra["raw_stage_bytes"]
    steps = len(summary.extra["chain"])
    phases, publish = [], []
    for s in summary.senders:
        stage = summary.sender_stage[s.rank]
        traffic = summary.gather.get(s.rank)
        produce = max(_gather_seconds(traffic, profile), raw[stage] / profile.device_copy,
                      raw[stage] / profile.pcie.value)
        encode = raw[stage] / (profile.delta_encode.value * options.delta_threads) + s.bytes / profile.storage.value
        publish.append((produce + encode, stage, produce, encode))
    _, stage, produce, encode = max(publish)
    phases += [Phase("produce into writer", produce, f"stage {stage} source"),
               Phase("encode+write", encode, f"stage {stage} source")]
    host = max(summary.receivers, key=lambda r: r.bytes)
    model = sum(raw)
    read = host.bytes / profile.storage.value
    decode = model / (profile.delta_decode.value * options.delta_threads) * steps
    verify = model / profile.host_xxh3.value if options.checksum else 0.0
    load = max(summary.shard_bytes) / profile.pcie.value
    phases += [Phase("read", read, f"inference node {host.node}"),
               Phase("decode into local copy", decode, f"inference node {host.node}"),
               Phase("verify digests", verify, f"inference node {host.node}"),
               Phase("load from local copy", load, "every inference rank")]
    tail = _tail(summary, profile, 0, options) + [Phase("commit", 3 * DELTA_POLL_S, "3 rounds through files")]
    total = max(p[0] for p in publish) + read + decode + verify + load + sum(p.seconds for p in tail)
    return phases + tail, total, _bound_of(phases, {p.name for p in phases}), None


# ---------------------------------------------------------------- this machine: CPU-bound


def _cpu(profile: HardwareProfile, key: str) -> float:
    return profile.cpu[key].value


def _broadcast_cpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Every phase is CPU work (measured per byte and per item); the cores are shared by all processes.

    The sync takes its fixed cost (measured whole on a model of almost no bytes: threads, control, the
    agreement rounds) plus its streaming phases, at least their CPU-seconds over the cores, plus the load.
    """
    c = lambda key: _cpu(profile, key)  # noqa: E731
    xxh3 = c("xxh3_byte") if options.checksum else 0.0
    axis = "tp" if summary.trainer.tp > 1 else "ep"  # which measured walk (gathers + convert) applies
    work: dict[str, float] = {}  # CPU-seconds of the streaming phases, per process
    phases: list[Phase] = []
    for sender in summary.senders:
        traffic = summary.gather.get(sender.rank)
        produce = sender.bytes * c(f"produce_{axis}_byte") + (traffic.units if traffic else 0) * c(f"produce_{axis}_unit")
        wire = (sender.bytes * (c("bcast_root_byte") + xxh3)
                + 2 * sender.messages * c("bcast_op_root_cpu"))  # payload, then the header with the checksum
        where = f"trainer rank {sender.rank}"
        phases += [Phase("produce (gather+convert)", produce, where), Phase("wire+checksum (root)", wire, where)]
        work[f"trainer {sender.rank}"] = produce + wire
        peers = {r for r, t in summary.gather.items() if t.out_intra + t.out_inter and r != sender.rank}
        for rank in peers:  # the stage's other ranks: their casts and sends, per byte of the stage
            work[f"trainer {rank}"] = work.get(f"trainer {rank}", 0.0) + sender.bytes * c(f"peer_{axis}_byte") / len(peers)
            phases.append(Phase("gather (peer)", sender.bytes * c(f"peer_{axis}_byte") / len(peers), f"trainer rank {rank}"))
    receiver = summary.receivers[0]  # every engine rank receives every bucket
    i = max(range(len(summary.shard_bytes)), key=summary.shard_bytes.__getitem__)
    for r, shard in enumerate(summary.shard_bytes):
        work[f"engine {r}"] = (receiver.bytes * (c("bcast_recv_byte") + xxh3) + 2 * receiver.messages
                               * c("bcast_op_recv_cpu") + shard * c("stage_byte") + summary.tensors * c("stage_tensor"))
    phases += [Phase("receive+verify+stage", work[f"engine {i}"], f"inference rank {i}")]
    cores = profile.cores.value
    shared, last = processor_sharing(work, cores)
    ops = 2 * sum(s.messages for s in summary.senders)  # every bucket: payload, then header
    wire_wall = sum(s.bytes for s in summary.senders) * c("bcast_wall_byte") + ops * c("message_s")
    engines = len(summary.shard_bytes)
    load_cpu = summary.shard_bytes[i] * c("load_byte") + summary.tensors * c("load_tensor")
    load, _ = processor_sharing({f"engine {r}": load_cpu for r in range(engines)}, cores)
    fixed = c("sync_fixed_s")
    phases += [Phase("streaming (processes sharing the cores)", shared,
                     f"{last} finishes last; {len(work)} processes on {cores:g} cores"),
               Phase("wire (loopback)", wire_wall, f"all stages, {ops} broadcasts"),
               Phase("apply", load, f"{engines} engine ranks"), Phase("fixed", fixed, "a sync of ~0 bytes")]
    cpu_total = sum(work.values()) + engines * load_cpu + c("sync_fixed_cpu")
    total = fixed + max(shared, wire_wall) + load
    bound = (f"CPU: {last}, its work while it shares {cores:g} cores with {len(work) - 1} other processes"
             if shared >= wire_wall else "the loopback wire")
    return phases, total, bound, cpu_total


def processor_sharing(work: dict[str, float], cores: float) -> tuple[float, str]:
    """Return when the last of these processes finishes its CPU work, and which one it is, when `cores`
    cores are shared fairly among the runnable ones (each runs at most one core), all starting together."""
    left = dict(work)
    now = 0.0
    last = max(work, key=work.get) if work else ""
    while left:
        rate = min(1.0, cores / len(left))
        name = min(left, key=left.get)
        step = left[name] / rate
        now += step
        done = left.pop(name)
        for other in left:
            left[other] -= done
        last = name
    return now, last


_MODELS: dict[tuple[str, bool], Callable] = {
    ("broadcast", False): _broadcast_gpu,
    ("p2p", False): _p2p_gpu,
    ("ipc", False): _ipc_gpu,
    ("disk_delta", False): _disk_delta_gpu,
    ("broadcast", True): _broadcast_cpu,
}
"""(transport, cpu_bound) -> model; this machine's model exists for what `make bench` runs (broadcast)."""
