"""Gather full Megatron tensors from their TP / ETP / EP shards, one bounded batch at a time.

Every rank of a pipeline stage walks the same list of `GatherUnit`s in the
same order; the collectives inside make them move in lockstep. Only the
stage's source rank (the first rank of each group) ends up with full tensors.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_sync.core.grid import ParallelLayout, group_rank0_global
from megatron_sync.trainer.gather_plan import (  # noqa: F401 (their import path of earlier releases)
    GatherUnit, _batch_key, _batches, merge_strided_shards, plan_gather_units, split_strided_shard,
)


def gather_to_first(tensor: torch.Tensor, group, size: int, rank: int) -> list[torch.Tensor] | None:
    """Return every group rank's `tensor` on group rank 0 (its own first, no copy of it); None elsewhere.

    Point-to-point rather than `dist.gather`: gloo's gather stages all shards
    in one more buffer and copies them out, an extra pass over the bytes.
    """
    return gather_to(tensor, group, size, rank, (0,))


def gather_to(tensor: torch.Tensor, group, size: int, rank: int, to: Sequence[int]) -> list[torch.Tensor] | None:
    """Return every group rank's `tensor`, in group rank order, on each group rank in `to` (its own as is);
    None elsewhere. Every rank of `to` but this one gets this rank's tensor point to point, batched (so
    NCCL runs each pair's sends and receives together); to every rank of the group: an all-gather."""
    if len(set(to)) == size:
        return _all_gathered(tensor, group, size)
    shards = None
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, r), group) for r in sorted(set(to)) if r != rank]
    if rank in to:
        shards = [tensor if r == rank else torch.empty_like(tensor) for r in range(size)]
        ops += [dist.P2POp(dist.irecv, shards[r], dist.get_global_rank(group, r), group) for r in range(size)
                if r != rank]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return shards


def flat_shards(units: Sequence[GatherUnit]) -> torch.Tensor:
    """Return the units' local shards end to end as bytes, each cast to its gather dtype on the way in
    (one pass: one message carries many small shards)."""
    flat = torch.empty(sum(u.local.numel() * u.dtype.itemsize for u in units), dtype=torch.uint8,
                       device=units[0].local.device)
    offset = 0
    for u in units:
        n = u.local.numel() * u.dtype.itemsize
        flat[offset:offset + n].view(u.dtype).view(u.local.shape).copy_(u.local)
        offset += n
    return flat


class GatherMemoryTracker:
    """Counts bytes of gathered tensors that are alive (gathered but not yet released); thread-safe."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.largest_tensor = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            assert self.live >= 0, "released more gathered bytes than were added"

    def saw_tensor(self, nbytes: int) -> None:
        with self._lock:
            self.largest_tensor = max(self.largest_tensor, nbytes)


def gather_in_pieces(unit: GatherUnit, group: Any, size: int, rank: int, *, budget_bytes: int,
                     tracker: GatherMemoryTracker, to: Sequence[int] = (0,)) -> torch.Tensor | None:
    """Return `unit`'s full tensor gathered over `group` straight into it, piece by piece, on each group
    rank in `to` (default group rank 0; every rank: an all-gather); None elsewhere.

    Pieces run along a dim other than the partition dim, so each piece of every shard is a slab of the
    full tensor; the shards of a piece plus their merge stay within half the budget each.
    """
    local, sharding = unit.local, unit.sharding
    receiving = rank in to
    full = torch.empty(unit.full_shape, dtype=unit.dtype, device=unit.device) if receiving else None
    if receiving:
        tracker.add(unit.nbytes)
    along = 0 if sharding.dim != 0 else 1
    if local.dim() < 2:
        pieces, along = [(0, local.shape[0])], 0
    else:
        bytes_per_slab = max(1, local.numel() // local.shape[along]) * unit.dtype.itemsize * size
        slabs = max(1, (budget_bytes // 2) // bytes_per_slab)
        pieces = [(a, min(slabs, local.shape[along] - a)) for a in range(0, local.shape[along], slabs)]
    for start, length in pieces:
        piece = (local if len(pieces) == 1 else local.narrow(along, start, length)).to(unit.dtype).contiguous()
        piece_bytes = piece.numel() * unit.dtype.itemsize * size
        if receiving:
            tracker.add(2 * piece_bytes)  # the shards and their merge
        shards = gather_to(piece, group, size, rank, to)
        if receiving:
            merged = merge_strided_shards(shards, sharding.dim, sharding.stride)
            target = full if len(pieces) == 1 and local.dim() < 2 else full.narrow(along, start, length)
            target.copy_(merged)
            del shards, merged
            tracker.release(2 * piece_bytes)
    return full


def _all_gathered(piece: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    shards = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(shards, piece, group=group)
    return shards


class ShardGatherer:
    """Produces full Megatron tensors on the stage source, walking `GatherUnit`s in lockstep.

    Memory bound: gathered bytes alive at once never exceed the budget plus
    the largest single tensor. Small TP-sharded tensors share one collective
    (a batch whose full tensors and this rank's contribution fit the budget)
    and are merged one at a time; routed
    experts whole on their owner share one message per owner (at most
    `budget_bytes`), received into one buffer whose views are yielded; a tensor
    larger than the budget, and every ETP-split expert, is gathered straight
    into its full tensor in pieces of at most half the budget.

    A yielded full tensor counts as gathered until the consumer asks for the
    next one; with `handoff` it counts until the consumer calls
    `release(unit, full)` (a consumer that converts in another thread than
    the one gathering); a batch's buffer counts until all its views are released.
    """

    def __init__(self, layout: ParallelLayout, *, budget_bytes: int, tracker: GatherMemoryTracker | None = None,
                 handoff: bool = False):
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.tracker = tracker or GatherMemoryTracker()
        self.handoff = handoff
        self._owed: dict[int, list[int]] = {}  # handoff: id(yielded tensor) -> [views left, bytes]

    def release(self, unit: GatherUnit, full: torch.Tensor | None) -> None:
        """Handoff mode: the consumer is done with a yielded (unit, full); its bytes stop counting
        (a batch buffer's once every view of it is released)."""
        entry = self._owed.pop(id(full), None) if full is not None else None
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.tracker.release(entry[1])

    def _owe(self, tensors: list[torch.Tensor], nbytes: int) -> None:
        entry = [len(tensors), nbytes]
        for t in tensors:
            self._owed[id(t)] = entry

    def gather(self, units: list[GatherUnit]) -> Iterator[tuple[GatherUnit, torch.Tensor | None]]:
        """Yield (unit, full tensor) on the source rank and (unit, None) on other participants.

        A yielded full tensor counts as gathered until the consumer asks for the
        next one (with `handoff`: until `release`); units this rank takes no part in are not yielded here.
        """
        layout = self.layout
        for batch in _batches(units, self.budget_bytes, layout.etp, layout.tp):
            first = batch[0]
            if first.owner_ep is not None:
                if not layout.gathers_experts:
                    continue
                if _batch_key(first, layout.etp) is None:
                    yield from self._gather_expert(first)
                else:
                    yield from self._gather_expert_batch(batch)
            elif not layout.gathers_dense:
                continue
            elif first.sharding.axis != "tp" or layout.tp == 1:
                for unit in batch:
                    yield from self._unsharded(unit)
            elif len(batch) == 1 and first.nbytes > self.budget_bytes:
                full = self._gather_in_pieces(first, layout.tp_group, layout.tp, layout.tp_rank)
                yield from self._hold(first, full)
            else:
                yield from self._gather_tp_batch(batch)

    def _hold(self, unit: GatherUnit, full: torch.Tensor | None, *, counted: bool = True):
        """Hand `full` to the consumer; it stops counting as gathered when the consumer moves on."""
        if full is None:
            yield unit, None
            return
        self.tracker.saw_tensor(unit.nbytes)
        if not counted:  # a local parameter: nothing was allocated
            yield unit, full
            return
        if self.handoff:  # the consumer releases it
            self._owe([full], unit.nbytes)
            yield unit, full
            return
        try:
            yield unit, full
        finally:
            self.tracker.release(unit.nbytes)

    def _unsharded(self, unit: GatherUnit):
        yield from self._hold(unit, unit.local if self.layout.is_stage_source else None, counted=False)

    def _gather_tp_batch(self, batch: list[GatherUnit]):
        """One gather over the TP group for the whole batch, as flat bytes, merged one unit at a time."""
        layout = self.layout
        local_bytes = sum(u.local.numel() * u.dtype.itemsize for u in batch)
        self.tracker.add(local_bytes)  # this rank's contribution, alive until the gather returns
        flat = flat_shards(batch)
        receiving = layout.tp_rank == 0
        if receiving:
            self.tracker.add(local_bytes * (layout.tp - 1))  # the other ranks' shards; this rank's is `flat`
        try:
            shards = gather_to_first(flat, layout.tp_group, layout.tp, layout.tp_rank)
            del flat
            if not receiving:
                self.tracker.release(local_bytes)
            offset = 0
            for unit in batch:
                if not receiving:
                    yield unit, None
                    continue
                n = unit.local.numel() * unit.dtype.itemsize
                parts = [s[offset:offset + n].view(unit.dtype).view(unit.local.shape) for s in shards]
                offset += n
                self.tracker.add(unit.nbytes)
                yield from self._hold(unit, merge_strided_shards(parts, unit.sharding.dim, unit.sharding.stride))
        finally:
            if receiving:
                shards = None
                self.tracker.release(local_bytes * layout.tp)

    def _gather_in_pieces(self, unit: GatherUnit, group, size: int, rank: int) -> torch.Tensor | None:
        return gather_in_pieces(unit, group, size, rank, budget_bytes=self.budget_bytes, tracker=self.tracker)

    def _gather_expert_batch(self, batch: list[GatherUnit]):
        """Routed experts of one owner, whole on it: one message from the owner to EP rank 0.

        The owner copies (and casts to the gather dtype) its experts into one
        buffer; EP rank 0 receives it and yields a view per expert (no copy).
        The owner's own experts on EP rank 0 are its parameters, yielded as they are.
        """
        layout = self.layout
        owner = batch[0].owner_ep
        flat = None
        nbytes = sum(u.nbytes for u in batch)
        if layout.etp_rank == 0 and layout.ep > 1 and owner != 0:
            if layout.ep_rank == owner:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=batch[0].device)
                offset = 0
                for u in batch:
                    flat[offset:offset + u.nbytes].view(u.dtype).view(u.full_shape).copy_(u.local)
                    offset += u.nbytes
                dist.send(flat, dst=group_rank0_global(layout.ep_group), group=layout.ep_group)
                flat = None
            elif layout.ep_rank == 0:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=batch[0].device)
                self.tracker.add(nbytes)
                dist.recv(flat, src=dist.get_global_rank(layout.ep_group, owner), group=layout.ep_group)
        if not layout.is_stage_source or (flat is None and owner != layout.ep_rank):
            if flat is not None:
                self.tracker.release(nbytes)
            for unit in batch:
                yield unit, None
            return
        if flat is None:  # this rank's own experts
            for unit in batch:
                yield from self._hold(unit, unit.local, counted=False)
            return
        views, offset = [], 0
        for u in batch:
            views.append(flat[offset:offset + u.nbytes].view(u.dtype).view(u.full_shape))
            offset += u.nbytes
        del flat
        for u in batch:
            self.tracker.saw_tensor(u.nbytes)
        if self.handoff:
            self._owe(views, nbytes)
            yield from zip(batch, views)
            return
        try:
            yield from zip(batch, views)
        finally:
            self.tracker.release(nbytes)

    def _gather_expert(self, unit: GatherUnit):
        """ETP gather inside the owning EP rank, then a point-to-point hop to EP rank 0."""
        layout = self.layout
        full = None
        if unit.owner_ep == layout.ep_rank:
            if unit.sharding.axis == "etp" and layout.etp > 1:
                full = self._gather_in_pieces(unit, layout.etp_group, layout.etp, layout.etp_rank)
            else:
                full = unit.local
        counted = full is not None and full is not unit.local
        if layout.etp_rank == 0 and layout.ep > 1:
            if layout.ep_rank == 0 and unit.owner_ep != 0:
                full = torch.empty(unit.full_shape, dtype=unit.dtype, device=unit.device)
                self.tracker.add(unit.nbytes)
                counted = True
                dist.recv(full, src=dist.get_global_rank(layout.ep_group, unit.owner_ep), group=layout.ep_group)
            elif layout.ep_rank != 0 and unit.owner_ep == layout.ep_rank:
                dist.send(full.to(unit.dtype).contiguous(), dst=group_rank0_global(layout.ep_group),
                          group=layout.ep_group)
                if counted:
                    self.tracker.release(unit.nbytes)
                full, counted = None, False
        if not layout.is_stage_source:
            if counted:
                self.tracker.release(unit.nbytes)
            yield unit, None
            return
        yield from self._hold(unit, full, counted=counted)
