"""The transfer plan: which bytes each trainer rank sends to each inference rank, and where they land.

Pure data, computed once from both layouts and identical on every rank (compare `digest()`):

- For every receiver (an inference rank, with the rank layout its engine published) and
  every placement of its layout, the holder of that HF tensor (from the replica assignment)
  sends the placement's region, cut into ranges of whole rows (dim 0 of the region) of at
  most `bucket_bytes`. A range is contiguous on both ends: the sender takes the range's rows
  of the region and sends them contiguous; the receiver writes them at `dst` in a staging
  set of its params (`dst` counts from the set's start; the set a version goes to is the
  receiver's, see `megatron_sync.layout.staging`).
- Ranges of one (sender, receiver) pair are packed, in plan order, into messages of at most
  `bucket_bytes` (one range larger than that, a single row, travels alone).
- Each sender walks its messages round-robin over its receivers, starting at a receiver
  that depends on its rank, so concurrent senders start on different receivers.

Every receiver gets each of its placements exactly once and nothing else: the bytes it
receives equal its shard bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from megatron_sync.layout.rank import Placement, RankLayout
from megatron_sync.layout.regions import Region, TensorSpec


@dataclass(frozen=True)
class Receiver:
    """One inference rank: rank `rank` of engine `engine`, and its layout."""

    engine: int
    rank: int
    layout: RankLayout


@dataclass(frozen=True)
class Range:
    """Rows [row, row + rows) of one region of HF tensor `name`, from `sender` to `receiver` at `dst`."""

    index: int
    sender: int
    receiver: int
    name: str
    region: Region
    row: int
    rows: int
    dst: int
    nbytes: int

    def source(self, full: torch.Tensor) -> torch.Tensor:
        """Return the bytes of this range from the sender's full tensor, contiguous (uint8, flat)."""
        return self.region.rows(self.row, self.rows).of(full).contiguous().view(-1).view(torch.uint8)


@dataclass(frozen=True)
class Message:
    """Ranges of one (sender, receiver) pair that travel together; payload is their bytes back to back."""

    index: int
    sender: int
    receiver: int
    ranges: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    """Every range and message of a sync, plus the receivers' layouts it was built from."""

    tensors: tuple[TensorSpec, ...]
    receivers: tuple[Receiver, ...]
    ranges: tuple[Range, ...]
    messages: tuple[Message, ...]
    bucket_bytes: int

    def senders(self) -> list[int]:
        """Return the trainer ranks that send something, ascending."""
        return sorted({m.sender for m in self.messages})

    def sender_queue(self, sender: int) -> list[Message]:
        """Return `sender`'s messages in sending order: round-robin over receivers, staggered by rank."""
        mine = [m for m in self.messages if m.sender == sender]
        nth: dict[int, int] = {}
        keyed = []
        for m in mine:
            k = nth[m.receiver] = nth.get(m.receiver, -1) + 1
            keyed.append(((k, (m.receiver - sender) % len(self.receivers)), m))
        return [m for _, m in sorted(keyed, key=lambda km: km[0])]

    def incoming(self, receiver: int) -> list[Message]:
        """Return the messages `receiver` gets, in plan order."""
        return [m for m in self.messages if m.receiver == receiver]

    def bytes_to_receiver(self) -> dict[int, int]:
        """Return the bytes each receiver gets (every receiver listed)."""
        out = {i: 0 for i in range(len(self.receivers))}
        for r in self.ranges:
            out[r.receiver] += r.nbytes
        return out

    def bytes_from_sender(self) -> dict[int, int]:
        """Return the bytes each sending trainer rank sends."""
        out: dict[int, int] = {}
        for r in self.ranges:
            out[r.sender] = out.get(r.sender, 0) + r.nbytes
        return out

    def set_bytes(self, receiver: int) -> int:
        """Return the bytes of one staging set of `receiver` (where its second set starts)."""
        return self.receivers[receiver].layout.nbytes

    def digest(self) -> str:
        """Return the sha256 hex digest of a canonical JSON encoding of the plan."""
        canonical = {
            "bucket_bytes": self.bucket_bytes,
            "tensors": [t.to_wire() for t in self.tensors],
            "receivers": [[r.engine, r.rank, r.layout.to_wire()] for r in self.receivers],
            "ranges": [[r.index, r.sender, r.receiver, r.name, r.region.to_wire(), r.row, r.rows, r.dst, r.nbytes]
                       for r in self.ranges],
            "messages": [[m.index, m.sender, m.receiver, list(m.ranges), m.nbytes] for m in self.messages],
        }
        return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()


def fleet_receivers(layouts: Sequence[RankLayout], ranks_per_engine: int) -> tuple[Receiver, ...]:
    """Return every inference rank in order, with the layout it published; engines are runs of
    `ranks_per_engine` consecutive inference ranks."""
    return tuple(Receiver(i // ranks_per_engine, i % ranks_per_engine, layout) for i, layout in enumerate(layouts))


def send_bytes_per_tensor(tensors: Sequence[TensorSpec], layouts: Sequence[RankLayout]) -> dict[str, int]:
    """Return the bytes each HF tensor is sent in total (to every rank layout): its holder's sending cost."""
    sent = {t.name: 0 for t in tensors}
    for layout in layouts:
        for p in layout.placements:
            sent[p.name] = sent.get(p.name, 0) + p.nbytes
    return sent


def build_transfer_plan(tensors: Sequence[TensorSpec], holders: Mapping[str, int],
                        receivers: Sequence[Receiver], bucket_bytes: int) -> TransferPlan:
    """Return the plan sending every receiver's placements from the holders of their tensors."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    specs = {t.name: t for t in tensors}
    ranges: list[Range] = []
    for index, receiver in enumerate(receivers):
        offsets = receiver.layout.param_offsets
        for p in receiver.layout.placements:
            if p.name not in specs or p.name not in holders:
                raise ValueError(
                    f"inference rank {receiver.rank} of engine {receiver.engine} needs {p.name}, but "
                    f"{'no trainer rank holds it' if p.name in specs else 'the trainer does not produce it'}; "
                    "the trainer's HF tensors and the engine's layout must cover the same names"
                )
            for row, rows, start, nbytes in _row_ranges(specs[p.name], p, bucket_bytes):
                ranges.append(Range(len(ranges), holders[p.name], index, p.name, p.source, row, rows,
                                    offsets[p.param] + p.offset + start, nbytes))
    return TransferPlan(tuple(tensors), tuple(receivers), tuple(ranges), _messages(ranges, bucket_bytes), bucket_bytes)


def _row_ranges(spec: TensorSpec, p: Placement, bucket_bytes: int) -> list[tuple[int, int, int, int]]:
    """Return (first row, rows, byte offset in the shard, bytes) pieces of placement `p`, each <= the bucket."""
    shape = p.source.sizes
    if not shape or shape[0] == 0:
        return [(0, 1 if not shape else 0, 0, p.nbytes)] if p.nbytes else []
    row_bytes = math.prod(shape[1:]) * spec.dtype.itemsize
    step = max(1, bucket_bytes // row_bytes) if row_bytes else shape[0]
    return [(row, min(step, shape[0] - row), row * row_bytes, min(step, shape[0] - row) * row_bytes)
            for row in range(0, shape[0], step)]


def _messages(ranges: Sequence[Range], bucket_bytes: int) -> tuple[Message, ...]:
    """Pack each (sender, receiver) pair's ranges, in plan order, into messages of <= bucket_bytes."""
    pairs: dict[tuple[int, int], list[Range]] = {}
    for r in ranges:
        pairs.setdefault((r.sender, r.receiver), []).append(r)
    messages: list[Message] = []
    for (sender, receiver), pair_ranges in sorted(pairs.items()):
        batch: list[Range] = []
        batch_bytes = 0
        for r in pair_ranges:
            if batch and batch_bytes + r.nbytes > bucket_bytes:
                messages.append(_message(len(messages), sender, receiver, batch))
                batch, batch_bytes = [], 0
            batch.append(r)
            batch_bytes += r.nbytes
        messages.append(_message(len(messages), sender, receiver, batch))
    return tuple(messages)


def _message(index: int, sender: int, receiver: int, batch: Sequence[Range]) -> Message:
    return Message(index, sender, receiver, tuple(r.index for r in batch), sum(r.nbytes for r in batch))
