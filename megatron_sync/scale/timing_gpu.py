"""The bucket transports and disk-delta on GPU clusters: phases with the pipelining their code does.

- broadcast: per stage, the source's gather thread, its conversion into bucket slots, the host copy on
  a side stream and the checksum overlap each other and the wire; stages go on the wire in stage order,
  each as soon as the previous stage's buckets went out and its own are ready, at the rate NCCL gives
  the stage's group (`phases.broadcast_rate`: NVLink when every member shares one node). Every inference
  rank receives every bucket, verifies and stages it while the next arrives; the load follows the last
  bucket; then the two agreement rounds.
- ipc (built: trainer and engines colocated on one host): each stage source produces its buckets as for
  broadcast (the host replica filled on a side stream included) and copies each from its device bucket
  into its shared segment's slot (CUDA IPC on GPUs); every engine rank of the
  host verifies the bucket (wsum64 over the slot, read from the source's GPU) and copies its own
  regions into its staging set; all readers share the source GPU's NVLink.
- disk_delta: stage sources hand the stage to the writer, which encodes and writes the delta; one
  applier per inference host reads, decodes into its local copy and verifies; every rank loads; three
  rounds through files (one poll interval each).
"""

from __future__ import annotations

import math

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import (Phase, SyncOptions, bound_of, broadcast_rate, device_checksum_rate,
                                        engine_tail, gather_seconds, members_per_node, rate_of)

LINKS = {"gather": "nvlink", "convert": "copy", "host copy": "pcie", "checksum": "wsum64", "copy into slot": "copy",
         "source NVLink out": "nvlink", "verify+stage": "wsum64", "verify+copy regions": "nvlink",
         "produce into writer": "pcie", "encode+write": "storage", "read": "storage", "verify digests": "host_xxh3",
         "load from local copy": "pcie"}


def _rated(profile: HardwareProfile, phases: list[Phase]) -> list[Phase]:
    """Return `phases` with the rate behind each (and its source) where one link sets it."""
    return [Phase(p.name, p.seconds, p.where, p.rate or (rate_of(profile, LINKS[p.name]) if p.name in LINKS else ""))
            for p in phases]
from megatron_sync.scale.summary import PlanSummary

DELTA_ROUND_S = 0.05  # disk_delta: one round through files per control message and agreement round (docs/scale.md)


def _produce(summary: PlanSummary, profile: HardwareProfile, sender, device_checksum: float) -> dict[str, float]:
    """Return a stage source's production phases (they overlap one another and the wire)."""
    traffic = summary.gather.get(sender.rank)
    return {"gather": gather_seconds(traffic, profile),
            "convert": (traffic.converted if traffic else sender.bytes) / profile.device_copy,
            "host copy": sender.bytes / profile.pcie.value,
            "checksum": sender.bytes / device_checksum}


def broadcast_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Stages on the wire in order, each at the rate NCCL gives its group (see the module doc).

    Stage s goes on the wire once stage s-1's buckets went out and its own first bucket is ready, and
    ends no earlier than its production plus its last bucket: the critical path is the chain of wires
    unless some stage's production (its gather, mostly) is longer than the wires before it.
    """
    device_checksum = device_checksum_rate(profile, options.checksum)
    worst: dict[str, Phase] = {}
    wire_end, wires, rates = 0.0, 0.0, set()
    for sender in sorted(summary.senders, key=lambda s: summary.sender_stage[s.rank]):
        where = f"stage {summary.sender_stage[sender.rank]} source"
        produce = _produce(summary, profile, sender, device_checksum)
        for name, seconds in produce.items():
            if name not in worst or seconds > worst[name].seconds:
                worst[name] = Phase(name, seconds, where)
        ready = max(produce.values())
        rate = broadcast_rate(profile, members_per_node(summary, sender.rank))
        rates.add(rate)
        wire = sender.bytes / rate + sender.messages * profile.message_s.value * math.log2(max(2, sender.peers + 1))
        wires += wire
        first = ready * min(1.0, summary.bucket_bytes / max(sender.bytes, 1))
        wire_end = max(max(wire_end, first) + wire, ready + wire / max(sender.messages, 1))
    receiver = summary.receivers[0]  # every inference rank receives every bucket
    shard = max(summary.shard_bytes)
    how = ("NVLink inside one node" if rates == {profile.nvlink.value} else
           f"{', '.join(f'{r / 1e9:.0f}' for r in sorted(rates))} GB/s per stage's group")
    phases = list(worst.values()) + [
        Phase("wire", wires, f"{len(summary.senders)} stage sources in stage order, every byte to every inference "
                             "rank", f"NCCL broadcast {how} (phases.broadcast_rate) from {rate_of(profile, 'nic')}"),
        Phase("verify+stage", receiver.bytes / device_checksum + shard / profile.device_copy, "every inference rank")]
    last_bucket = (summary.extra["max_bucket"] / device_checksum
                   + shard / max(1, receiver.messages) / profile.device_copy)
    tail = engine_tail(summary, profile, 2, options)
    total = wire_end + last_bucket + sum(p.seconds for p in tail)
    slowest = max(worst.values(), key=lambda p: p.seconds)
    bound = (f"wire ({wires:.1f} s: {phases[-2].where})" if wires >= wire_end - wires else
             f"{slowest.name} ({slowest.where}): production outlasts the wires")
    return _rated(profile, phases + tail), total, bound, None


def ipc_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Stage sources hand buckets over through shared device memory on one host (see the module doc)."""
    device_checksum = device_checksum_rate(profile, options.checksum)
    readers = len(summary.receivers)
    worst: dict[str, Phase] = {}
    finish = []
    shard = max(summary.shard_bytes)
    for sender in summary.senders:
        where = f"stage {summary.sender_stage[sender.rank]} source"
        produce = _produce(summary, profile, sender, device_checksum)  # the host replica fills on a side stream
        produce["copy into slot"] = sender.bytes / profile.device_copy
        share = sender.bytes / max(1, summary.model_bytes)
        # every reader verifies every bucket over NVLink from this GPU, then copies its regions of it
        verify = readers * sender.bytes if options.checksum else 0
        produce["source NVLink out"] = (verify + readers * shard * share) / profile.nvlink.value
        for name, seconds in produce.items():
            if name not in worst or seconds > worst[name].seconds:
                worst[name] = Phase(name, seconds, where)
        finish.append(max(produce.values()))
    reader = summary.receivers[0]
    phases = list(worst.values()) + [Phase("verify+copy regions", reader.bytes / min(device_checksum,
                                           profile.nvlink.value) + shard / profile.nvlink.value, "every engine rank")]
    tail = engine_tail(summary, profile, 2, options)
    total = max(finish) + summary.extra["max_bucket"] / min(device_checksum, profile.nvlink.value) + sum(
        p.seconds for p in tail)
    return _rated(profile, phases + tail), total, bound_of(phases, {p.name for p in phases}), None


def disk_delta_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Writer per stage source, one applier per inference host, storage shared per node."""
    raw = summary.extra["raw_stage_bytes"]
    steps = len(summary.extra["chain"])
    phases, publish = [], []
    for s in summary.senders:
        stage = summary.sender_stage[s.rank]
        produce = max(gather_seconds(summary.gather.get(s.rank), profile), raw[stage] / profile.device_copy,
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
    tail = engine_tail(summary, profile, 0, options, staged=False) + [
        Phase("commit", 3 * DELTA_ROUND_S, "3 rounds through files")]
    total = max(p[0] for p in publish) + read + decode + verify + load + sum(p.seconds for p in tail)
    return _rated(profile, phases + tail), total, bound_of(phases, {p.name for p in phases}), None
