"""Gather full Megatron tensors from their TP / ETP / EP shards, one bounded batch at a time.

Every rank of a pipeline stage walks the same list of `GatherUnit`s in the
same order; the collectives inside make them move in lockstep. Only the
stage's source rank (the first rank of each group) ends up with full tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_sync.core.grid import ParallelLayout, group_rank0_global
from megatron_sync.trainer.source import Split, SourceTensor


def _piece_sizes(stride: int | tuple[int, ...], length: int, size: int) -> list[int]:
    """Return the sizes of the pieces one shard of `length` holds along its dim (see `Split.stride`)."""
    if isinstance(stride, int):
        return [length // stride] * stride
    return [piece // size for piece in stride]


def merge_strided_shards(shards: list[torch.Tensor], dim: int, stride: int | tuple[int, ...]) -> torch.Tensor:
    """Return the full tensor from equal TP shards along `dim`.

    With stride s each shard holds s consecutive pieces (gated linear_fc1:
    `[gate_r; up_r]`), and the full tensor is piece 0 of every shard, then
    piece 1 of every shard, and so on. A tuple stride gives unequal pieces by
    their sizes in the full tensor (each shard holds 1/len(shards) of each).
    """
    if stride == 1:
        return torch.cat(shards, dim=dim)
    sizes = _piece_sizes(stride, shards[0].shape[dim], len(shards))
    pieces = [shard.split(sizes, dim=dim) for shard in shards]
    return torch.cat([p[k] for k in range(len(sizes)) for p in pieces], dim=dim)


def split_strided_shard(full: torch.Tensor, dim: int, stride: int | tuple[int, ...], size: int,
                        rank: int) -> torch.Tensor:
    """Return rank `rank`'s shard of `full` (the inverse of `merge_strided_shards`)."""
    sizes = _piece_sizes(stride, full.shape[dim] // size, size)
    full_pieces = full.split([piece * size for piece in sizes], dim=dim)
    return torch.cat([piece.chunk(size, dim=dim)[rank] for piece in full_pieces], dim=dim)


def gather_to_first(tensor: torch.Tensor, group, size: int, rank: int) -> list[torch.Tensor] | None:
    """Return every group rank's `tensor` on group rank 0 (its own first, no copy of it); None elsewhere.

    Point-to-point rather than `dist.gather`: gloo's gather stages all shards
    in one more buffer and copies them out, an extra pass over the bytes.
    """
    if rank != 0:
        dist.send(tensor, dst=group_rank0_global(group), group=group)
        return None
    shards = [tensor] + [torch.empty_like(tensor) for _ in range(size - 1)]
    receives = [dist.irecv(shards[r], src=dist.get_global_rank(group, r), group=group) for r in range(1, size)]
    for receive in receives:
        receive.wait()
    return shards


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


@dataclass(frozen=True)
class GatherUnit:
    """One full Megatron tensor to produce: its global name, full shape and where its shards live.

    `local` is this rank's shard, or None for a routed expert another EP rank owns. `dtype` is the
    dtype it is gathered in: the parameter's, or a narrower one the converter allows (see
    `Converter.gather_dtype`); a tensor that needs no gather is yielded as the local parameter itself.
    """

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: Split
    local: torch.Tensor | None
    device: torch.device
    owner_ep: int | None = None  # routed experts only

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.full_shape:
            n *= s
        return n


def _full_shape(t: SourceTensor, layout: ParallelLayout) -> tuple[int, ...]:
    shape = list(t.tensor.shape)
    size = {"tp": layout.tp, "etp": layout.etp}.get(t.sharding.axis, 1)
    if t.sharding.axis is not None:
        shape[t.sharding.dim] *= size
    return tuple(shape)


def plan_gather_units(tensors: list[SourceTensor], layout: ParallelLayout) -> list[GatherUnit]:
    """Return the units of one stage in a deterministic order, identical on all its ranks.

    Dense tensors keep model order. A layer's routed experts are listed at the
    place of its first expert parameter, by global expert index, then by kind
    (linear_fc1 before linear_fc2), so every EP rank lists every expert.
    """
    units: list[GatherUnit] = []
    templates: dict[int, list[str]] = {}
    local_experts: dict[tuple[str, int], SourceTensor] = {}
    num_local_by_layer: dict[int, int] = {}
    emitted: set[int] = set()
    for t in tensors:
        if t.expert is not None:
            layer_templates = templates.setdefault(t.expert.layer, [])
            if t.expert.template not in layer_templates:
                layer_templates.append(t.expert.template)
            local_experts[(t.expert.template, t.expert.local_index)] = t
            num_local_by_layer[t.expert.layer] = t.expert.num_local
    for t in tensors:
        if t.expert is None:
            units.append(
                GatherUnit(t.name, _full_shape(t, layout), t.tensor.dtype, t.sharding, t.tensor, t.tensor.device)
            )
            continue
        layer = t.expert.layer
        if layer in emitted:
            continue
        emitted.add(layer)
        num_local = num_local_by_layer[layer]
        for expert in range(num_local * layout.ep):
            owner, j = divmod(expert, num_local)
            for template in templates[layer]:
                ref = local_experts[(template, 0)]
                mine = local_experts[(template, j)].tensor if owner == layout.ep_rank else None
                units.append(
                    GatherUnit(
                        template.format(expert=expert), _full_shape(ref, layout), ref.tensor.dtype,
                        ref.sharding, mine, ref.tensor.device, owner_ep=owner,
                    )
                )
    return units


def _batch_key(unit: GatherUnit, etp: int) -> tuple | None:
    """Return what units must share to travel in one collective (None: alone).

    TP-sharded dense tensors share one gather over the TP group; routed experts
    of one owning EP rank, whole on it (no ETP split), share one point-to-point
    message to EP rank 0.
    """
    if unit.owner_ep is None:
        return ("tp",) if unit.sharding.axis == "tp" else None
    if unit.sharding.axis != "etp" or etp == 1:
        return ("ep", unit.owner_ep)
    return None


def _batches(units: list[GatherUnit], budget_bytes: int, etp: int = 1, tp: int = 1) -> Iterator[list[GatherUnit]]:
    """Group consecutive units of one batch key up to their bound; everything else alone.

    A TP batch holds its full tensors plus this rank's flat contribution (1/tp of them) during
    the gather, so its full bytes stay within budget * tp / (tp + 1).
    """
    batch: list[GatherUnit] = []
    batch_bytes = 0
    key = None
    for unit in units:
        unit_key = _batch_key(unit, etp)
        bound = budget_bytes * tp // (tp + 1) if unit_key == ("tp",) else budget_bytes
        if batch and (unit_key != key or batch_bytes + unit.nbytes > bound):
            yield batch
            batch, batch_bytes = [], 0
        if unit_key is None:
            yield [unit]
            continue
        batch.append(unit)
        batch_bytes += unit.nbytes
        key = unit_key
    if batch:
        yield batch


def gather_in_pieces(unit: GatherUnit, group: Any, size: int, rank: int, *, budget_bytes: int,
                     tracker: GatherMemoryTracker, everyone: bool = False) -> torch.Tensor | None:
    """Return `unit`'s full tensor gathered over `group` straight into it, piece by piece: on group rank 0
    (None elsewhere), or on every rank of the group with `everyone` (an all-gather).

    Pieces run along a dim other than the partition dim, so each piece of every shard is a slab of the
    full tensor; the shards of a piece plus their merge stay within half the budget each.
    """
    local, sharding = unit.local, unit.sharding
    receiving = everyone or rank == 0
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
        shards = _all_gathered(piece, group, size) if everyone else gather_to_first(piece, group, size, rank)
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
        flat = torch.empty(local_bytes, dtype=torch.uint8, device=batch[0].local.device)
        self.tracker.add(local_bytes)  # this rank's contribution, alive until the gather returns
        offset = 0
        for u in batch:  # one pass: copy (and cast to the gather dtype) straight into the flat buffer
            n = u.local.numel() * u.dtype.itemsize
            flat[offset:offset + n].view(u.dtype).view(u.local.shape).copy_(u.local)
            offset += n
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
