"""The distributed host replica: each trainer rank gathers, converts and keeps only its assigned share.

Every rank of a stage walks the stage's gather units in the same order. For each unit the
ranks that hold its shards gather them onto the unit's assigned holder (`assign`):

- dense, TP-sharded: the holder's TP group (its own DP/CP replica) gathers to the holder;
- routed expert, ETP-sharded: the owning EP rank's ETP group (the holder's expert-DP
  replica) gathers to the holder; experts never hop across EP ranks;
- unsharded: the holder uses its own copy, nothing moves.

Different replicas' gathers run at the same time on disjoint groups. The holder converts
the full tensor at once (the weight stream's walk, with this module's gatherer) and copies
the HF outputs into host buffers allocated once, from metadata, at construction: the
replica never holds more than the rank's assigned share.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_sync.trainer.gather import GatherMemoryTracker, GatherUnit, merge_strided_shards
from megatron_sync.transports.p2p.assign import ReplicaAssignment, ReplicaUnit, TrainerRank, assign_replica
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.stream import DEFAULT_GATHER_BUDGET_BYTES, MegatronWeightStream


def replica_units(units: list[GatherUnit], converter: Any, stage: int) -> list[ReplicaUnit]:
    """Return the replica units of a stage: each gather unit with the HF tensors (name, bytes) it yields."""
    return [
        ReplicaUnit(u.name, stage, tuple((m.name, m.nbytes) for m in converter.convert_meta(u.name, u.full_shape, u.dtype)),
                    u.owner_ep)
        for u in units
    ]


def gather_to_rank(unit: GatherUnit, *, group: Any, size: int, dst: int, receiving: bool,
                   budget_bytes: int, tracker: GatherMemoryTracker) -> torch.Tensor | None:
    """Gather `unit`'s shards over `group` (`size` ranks) into its full tensor on global rank `dst`.

    Pieces run along a dim other than the partition dim, each at most half the budget, so
    the shards of a piece plus their merge stay within the budget; returns None off `dst`.
    """
    local, sharding = unit.local, unit.sharding
    full = torch.empty(unit.full_shape, dtype=unit.dtype, device=unit.device) if receiving else None
    if receiving:
        tracker.add(unit.nbytes)
    along: int | None = 1 if sharding.dim == 0 else 0
    if local.dim() < 2:  # a 1-D tensor is split along its only dim: one piece
        along, pieces = None, [(0, 0)]
    else:
        slab = max(1, local.numel() // local.shape[along]) * unit.dtype.itemsize * size
        step = max(1, (budget_bytes // 2) // slab)
        pieces = [(a, min(step, local.shape[along] - a)) for a in range(0, local.shape[along], step)]
    for start, length in pieces:
        piece = (local if along is None else local.narrow(along, start, length)).contiguous()
        shards = [torch.empty_like(piece) for _ in range(size)] if receiving else None
        piece_bytes = piece.numel() * unit.dtype.itemsize * size
        if receiving:
            tracker.add(2 * piece_bytes)  # the shards and their merge
        dist.gather(piece, shards, dst=dst, group=group)
        if receiving:
            merged = merge_strided_shards(shards, sharding.dim, sharding.stride)
            (full if along is None else full.narrow(along, start, length)).copy_(merged)
            del shards, merged
            tracker.release(2 * piece_bytes)
    return full


class AssignedGatherer:
    """Gathers every unit of a stage onto its assigned holder (see the module docstring)."""

    def __init__(self, layout: ParallelLayout, me: TrainerRank, ranks: Mapping[int, TrainerRank],
                 holders: Mapping[str, int], *, budget_bytes: int, tracker: GatherMemoryTracker):
        self.layout, self.me, self.ranks, self.holders = layout, me, ranks, holders
        self.budget_bytes, self.tracker = budget_bytes, tracker

    def _group_of(self, unit: GatherUnit, holder: TrainerRank) -> tuple[Any, int, bool] | None:
        """Return (group, size, sharded) when this rank takes part in gathering `unit`, else None."""
        me, layout = self.me, self.layout
        if unit.owner_ep is None:
            if (me.dp, me.cp) != (holder.dp, holder.cp):
                return None
            return layout.tp_group, layout.tp, unit.sharding.axis == "tp" and layout.tp > 1
        if (me.ep, me.edp) != (holder.ep, holder.edp):
            return None
        return layout.etp_group, layout.etp, unit.sharding.axis == "etp" and layout.etp > 1

    def gather(self, units: list[GatherUnit]) -> Iterator[tuple[GatherUnit, torch.Tensor]]:
        """Yield (unit, full tensor) for the units this rank holds; take part in the others' gathers."""
        for unit in units:
            holder = self.ranks[self.holders[unit.name]]
            found = self._group_of(unit, holder)
            if found is None:
                continue
            group, size, sharded = found
            receiving = holder.rank == self.me.rank
            if not sharded:
                if receiving:
                    yield unit, unit.local
                continue
            full = gather_to_rank(unit, group=group, size=size, dst=holder.rank, receiving=receiving,
                                  budget_bytes=self.budget_bytes, tracker=self.tracker)
            if full is not None:
                self.tracker.saw_tensor(unit.nbytes)
                try:
                    yield unit, full
                finally:
                    self.tracker.release(unit.nbytes)


class DistributedReplica:
    """This trainer rank's share of the inference-format weights, kept in host memory.

    Built over the trainer's `MegatronWeightStream` (its chunks, layout, converter and
    trainer group). Construction is collective over that group (its default: the whole
    trainer job): every rank lists its stage's units, all lists and rank coordinates are
    all-gathered, and every rank computes the same `assignment`. `rank` is this process's
    global rank (the holders are global ranks). `cost` (bytes sent per HF tensor, from the
    transfer plan's layouts) balances sending instead of memory. `refresh()` (collective
    over each stage) walks the stream with this rank's assigned gathers.
    """

    def __init__(self, stream: MegatronWeightStream, *, rank: int, cost: Mapping[str, int] | None = None,
                 gather_budget_bytes: int = DEFAULT_GATHER_BUDGET_BYTES, tracker: GatherMemoryTracker | None = None):
        self.stream, self.layout, self.converter = stream, stream.layout, stream.converter
        self.me = TrainerRank.of(self.layout, rank)
        self.tracker = tracker or stream.tracker
        units = stream.units()
        self.assignment = _all_assign(self.me, replica_units(units, self.converter, self.layout.pp_rank),
                                      stream.group, cost)
        ranks = {r.rank: r for r in self.assignment.ranks}
        self._gatherer = AssignedGatherer(self.layout, self.me, ranks, self.assignment.holder_of(),
                                          budget_bytes=gather_budget_bytes, tracker=self.tracker)
        holder = self.assignment.holder_of()
        self.metas = [m for u in units if holder[u.name] == self.me.rank
                      for m in self.converter.convert_meta(u.name, u.full_shape, u.dtype)]
        self.tensors = {m.name: torch.empty(m.shape, dtype=m.dtype, pin_memory=torch.cuda.is_available())
                        for m in self.metas}  # allocated once: exactly this rank's share

    @property
    def held_bytes(self) -> int:
        """Return the bytes of host memory this rank's replica holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds the last `refresh` spent gathering and converting."""
        return self.stream.phase_seconds

    def refresh(self) -> None:
        """Gather and convert the current weights into this rank's buffers (collective over the stage).

        A local conversion error is raised after the walk, so the stage's other ranks are
        never left waiting in a gather.
        """
        for name, tensor in self.stream.walk(self._gatherer, self.metas):
            self.tensors[name].copy_(tensor)


def _all_assign(me: TrainerRank, units: list[ReplicaUnit], group: Any,
                cost: Mapping[str, int] | None) -> ReplicaAssignment:
    """All-gather every rank's coordinates and stage units; return the assignment (identical everywhere)."""
    mine = [me.to_wire(), [u.to_wire() for u in units]]
    everyone: list[Any] = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    ranks = [TrainerRank.from_wire(r) for r, _ in everyone]
    by_stage: dict[int, list[ReplicaUnit]] = {}
    for rank, wire_units in everyone:
        stage = TrainerRank.from_wire(rank).pp
        by_stage.setdefault(stage, [ReplicaUnit.from_wire(w) for w in wire_units])
    all_units = [u for stage in sorted(by_stage) for u in by_stage[stage]]
    return assign_replica(all_units, ranks, cost=cost)
