"""Bytes a trainer rank receives in its TP / ETP gathers, counted at torch.distributed, and what a P2P
schedule says it should receive: each unit's shards reach only the ranks that write pieces of it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist


class GatherBytes:
    """Counts, while `counting()`, the bytes arriving on this rank over its TP and ETP groups (the
    receives of `batch_isend_irecv`, the other ranks' parts of `all_gather`)."""

    def __init__(self, layout: Any) -> None:
        self.groups = [g for g in (layout.tp_group, layout.etp_group) if g is not None]
        self.received = 0

    def _ours(self, group: Any) -> bool:
        return any(group is g for g in self.groups)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        batch, all_gather = dist.batch_isend_irecv, dist.all_gather

        def counted_batch(ops):
            self.received += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                 if op.op is dist.irecv and self._ours(op.group))
            return batch(ops)

        def counted_all_gather(outputs, tensor, group=None, **kwargs):
            if self._ours(group):
                self.received += (len(outputs) - 1) * tensor.numel() * tensor.element_size()
            return all_gather(outputs, tensor, group=group, **kwargs)

        dist.batch_isend_irecv, dist.all_gather = counted_batch, counted_all_gather
        try:
            yield
        finally:
            dist.batch_isend_irecv, dist.all_gather = batch, all_gather


def scheduled_gather_bytes(sender: Any, rank: int) -> tuple[int, int]:
    """Return (the bytes trainer rank `rank` should receive in one version's gathers: the other members'
    shards of each split unit it writes pieces of, what an all-gather of every unit its group sends would
    bring it)."""
    from megatron_sync.core.grid import TrainerRank
    from megatron_sync.transports.p2p.holders import group_of

    layout = sender.stream.layout
    me = TrainerRank.of(layout, sender.transport.rank)
    sizes = {"tp": layout.tp, "etp": layout.etp}
    split = {u.name: u for u in sender.schedule.units if u.gather is not None}
    senders = sender.schedule.unit_senders()
    gathering = sender.schedule.balance.gathering
    want = every = 0
    for unit in sender.stream.units():
        source = split.get(unit.name)
        if source is None:
            continue
        size = sizes[source.gather]
        nbytes = unit.nbytes // size * (size - 1)  # the other members' shards
        want += nbytes if rank in senders.get(unit.name, ()) else 0
        every += nbytes if group_of(source, me) in gathering.get(unit.name, ()) else 0
    return want, every
