"""What each trainer rank gathers and converts in a P2P version: only the units its group sends pieces of.

Every rank of a stage walks the stage's units in the same order (`MegatronWeightStream.walk`). A unit that
needs a gather (split over TP, or an expert split over ETP) is all-gathered over the rank's TP or ETP group
when the schedule has that group send pieces of it (`Balance.gathering`), so every member holds it whole and
any of them may write its pieces; groups that send nothing of it skip it. A unit whole on its holders needs
no gather. Only a rank with pieces of a unit converts it.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from megatron_sync.core.grid import TrainerRank
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.gather import GatherMemoryTracker, GatherUnit, gather_in_pieces
from megatron_sync.transports.p2p.holders import GroupKey, SourceUnit, group_of


class ScheduledGatherer:
    """Gathers, on one trainer rank, the units its TP or ETP group sends pieces of (see the module doc).

    `sources` are the stage's units as the schedule knows them (same order as the stream's), `gathering` the
    groups that send each unit, `sends` the units this rank itself writes pieces of.
    """

    def __init__(self, layout: ParallelLayout, me: TrainerRank, sources: Mapping[str, SourceUnit],
                 gathering: Mapping[str, frozenset[GroupKey]], sends: set[str], *, budget_bytes: int,
                 tracker: GatherMemoryTracker) -> None:
        self.layout, self.me, self.sources, self.gathering, self.sends = layout, me, sources, gathering, sends
        self.budget_bytes, self.tracker = budget_bytes, tracker

    def gather(self, units: list[GatherUnit]) -> Iterator[tuple[GatherUnit, torch.Tensor | None]]:
        """Yield (unit, full tensor) for the units this rank sends, (unit, None) for those it only helps
        gather; skip the rest."""
        for unit in units:
            source = self.sources[unit.name]
            mine = unit.name in self.sends
            if source.gather is None:
                if mine:
                    yield unit, unit.local
                continue
            if group_of(source, self.me) not in self.gathering.get(unit.name, ()):
                continue
            group, size, rank = self._group(source.gather)
            full = gather_in_pieces(unit, group, size, rank, budget_bytes=self.budget_bytes, tracker=self.tracker,
                                    everyone=True)
            self.tracker.saw_tensor(unit.nbytes)
            try:
                yield unit, full if mine else None
            finally:
                self.tracker.release(unit.nbytes)

    def _group(self, axis: str) -> tuple[Any, int, int]:
        layout = self.layout
        if axis == "tp":
            return layout.tp_group, layout.tp, layout.tp_rank
        return layout.etp_group, layout.etp, layout.etp_rank
