"""What each trainer rank gathers and converts in a P2P version: only the units it sends pieces of.

Every rank of a stage walks the stage's units in the same order (`MegatronWeightStream.walk`). A unit that
needs a gather (split over TP, or an expert split over ETP) is gathered over the rank's TP or ETP group
when the schedule has ranks of that group send pieces of it (`Balance.gathering`): each member sends its
shard to those members only (its *receivers*), so a unit is whole only on the ranks that write it, and a
group moves each unit's bytes once per sender of it rather than to every member (an all-gather only when
every member sends some of it). Groups that send nothing of a unit skip it. A unit whole on its holders
needs no gather. Only a rank with pieces of a unit converts it (and only it merges the unit's shards).

Consecutive units of one gather axis that a group gathers share one exchange of their shards as flat
bytes, one message per pair of members that has bytes for each other, as the bucket transports' gather
batches them (a collective per tensor costs more than its bytes for small ones): a run of such units ends
at a unit of another kind, whose kind every rank of the stage knows, or at the budget, which every member
of the group counts alike; so the members of a group post matching messages, and every rank exchanges in
unit order. A unit larger than the budget is gathered alone, in pieces.

With `handoff` (the P2P sender's walk: its gathers run in the stream's prefetch thread, ahead of the thread
that converts, stages and writes) a yielded full tensor counts as gathered until the consumer calls
`release`, not merely until it asks for the next one.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sync.core.grid import ParallelLayout, TrainerRank
from megatron_sync.trainer.gather import GatherMemoryTracker, GatherUnit, flat_shards, gather_in_pieces
from megatron_sync.trainer.gather_plan import merge_strided_shards
from megatron_sync.transports.p2p.holders import GroupKey, SourceUnit, group_of

Gathered = Iterator[tuple[GatherUnit, Optional[torch.Tensor]]]


class ScheduledGatherer:
    """Gathers, on one trainer rank, the units its TP or ETP group sends pieces of (see the module doc).

    `sources` are the stage's units as the schedule knows them (same order as the stream's), `gathering` the
    groups that send each unit, `senders` the trainer ranks (global) that write pieces of each unit; this
    rank writes pieces of the units it is a sender of.
    """

    def __init__(self, layout: ParallelLayout, me: TrainerRank, sources: Mapping[str, SourceUnit],
                 gathering: Mapping[str, frozenset[GroupKey]], senders: Mapping[str, frozenset[int]], *,
                 budget_bytes: int, tracker: GatherMemoryTracker, handoff: bool = False) -> None:
        self.layout, self.me, self.sources, self.gathering = layout, me, sources, gathering
        self.senders = senders
        self.sends = {name for name, ranks in senders.items() if me.rank in ranks}
        self.budget_bytes, self.tracker, self.handoff = budget_bytes, tracker, handoff
        self._owed: dict[int, int] = {}  # handoff: id(yielded full tensor) -> its bytes, until `release`

    def release(self, unit: GatherUnit, full: Optional[torch.Tensor]) -> None:
        """Handoff mode: the consumer is done with a yielded (unit, full); its bytes stop counting."""
        nbytes = self._owed.pop(id(full), None) if full is not None else None
        if nbytes is not None:
            self.tracker.release(nbytes)

    def gather(self, units: list[GatherUnit]) -> Gathered:
        """Yield (unit, full tensor) for the units this rank sends, (unit, None) for those it only helps
        gather; skip the rest."""
        run: list[GatherUnit] = []  # consecutive units of `axis` this rank's group gathers
        axis: Optional[str] = None
        for unit in units:
            source = self.sources[unit.name]
            if source.gather != axis:  # a unit of another kind ends the run (the same on every rank)
                yield from self._gathered(run, axis)
                run, axis = [], source.gather
            if source.gather is None:
                if unit.name in self.sends:
                    yield unit, unit.local
                continue
            if group_of(source, self.me) not in self.gathering.get(unit.name, ()):
                continue
            if run and sum(u.nbytes for u in run) + unit.nbytes > self._bound(axis):
                yield from self._gathered(run, axis)
                run = []
            run.append(unit)
        yield from self._gathered(run, axis)

    def _bound(self, axis: str) -> int:
        """The full bytes of one run: they, this rank's flat shards (1/size of them) and a merge fit the budget."""
        size = self._group(axis)[1]
        return self.budget_bytes * size // (size + 1)

    def _gathered(self, run: list[GatherUnit], axis: Optional[str]) -> Gathered:
        if not run:
            return
        group, size, rank = self._group(axis)
        members = [dist.get_global_rank(group, r) for r in range(size)]
        receivers = [tuple(r for r in range(size) if members[r] in self.senders.get(u.name, ())) for u in run]
        if len(run) == 1 and run[0].nbytes > self._bound(axis):  # alone, straight into its full tensor
            unit = run[0]
            full = gather_in_pieces(unit, group, size, rank, budget_bytes=self.budget_bytes, tracker=self.tracker,
                                    to=receivers[0])
            yield from self._held(unit, full)
            return
        yield from self._gathered_flat(run, receivers, group, size, rank)

    def _gathered_flat(self, run: list[GatherUnit], receivers: Sequence[tuple[int, ...]], group: Any, size: int,
                       rank: int) -> Gathered:
        """One exchange of the run's shards as flat bytes: to each other member, this rank's shards of the
        units it receives, in run order; from each, its shards of the units this rank receives (one message
        per direction and pair that has bytes). Each unit this rank receives is merged in turn."""
        sizes = [u.local.numel() * u.dtype.itemsize for u in run]
        mine = [i for i, to in enumerate(receivers) if rank in to]
        outgoing = {p: [i for i, to in enumerate(receivers) if p in to] for p in range(size) if p != rank}
        held = sum(sizes[i] for ids in outgoing.values() for i in ids) + sum(sizes[i] for i in mine) * (size - 1)
        self.tracker.add(held)
        try:
            device = run[0].local.device
            sends = {p: flat_shards([run[i] for i in ids]) for p, ids in outgoing.items() if ids}
            inbox = {p: torch.empty(sum(sizes[i] for i in mine), dtype=torch.uint8, device=device)
                     for p in outgoing} if mine else {}
            ops = [dist.P2POp(dist.isend, flat, dist.get_global_rank(group, p), group) for p, flat in sends.items()]
            ops += [dist.P2POp(dist.irecv, box, dist.get_global_rank(group, p), group) for p, box in inbox.items()]
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
            sends = None
            offset = 0
            for i, unit in enumerate(run):
                full = None
                if i in mine:
                    n = sizes[i]
                    parts = [unit.local.to(unit.dtype) if p == rank else
                             inbox[p][offset:offset + n].view(unit.dtype).view(unit.local.shape) for p in range(size)]
                    full = merge_strided_shards(parts, unit.sharding.dim, unit.sharding.stride)
                    self.tracker.add(unit.nbytes)
                    offset += n
                yield from self._held(unit, full)
        finally:
            sends = inbox = None
            self.tracker.release(held)

    def _held(self, unit: GatherUnit, full: Optional[torch.Tensor]) -> Gathered:
        """Hand the consumer `full` (None: this rank only helped gather it); it stops counting when the
        consumer moves on."""
        self.tracker.saw_tensor(unit.nbytes)
        if self.handoff and unit.name in self.sends:  # the consumer releases it
            if full is not None:
                self._owed[id(full)] = unit.nbytes
            yield unit, full
            return
        try:
            yield unit, full if unit.name in self.sends else None
        finally:
            if full is not None:
                self.tracker.release(unit.nbytes)

    def _group(self, axis: str) -> tuple[Any, int, int]:
        """Return the group of `axis` ("tp", "etp") this rank gathers over, its size, and this rank in it."""
        layout = self.layout
        if axis == "tp":
            return layout.tp_group, layout.tp, layout.tp_rank
        return layout.etp_group, layout.etp, layout.etp_rank

